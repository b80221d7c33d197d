"""The conversation log's writer: served chat completions and the feedback on them, as append-only JSON lines
(the format and the reader: unified.conversations).

One writer thread owns the file, so lines never interleave and a feedback line can only follow the
conversation it names. It commits in groups: everything queued is written in one `write`, then synced,
and only then are the callers answered, so a line a client was told about survives a crash. A line cut
short by a crash mid-write was never acknowledged; it is dropped when the log is next opened. A log
belongs to one server: feedback ids are checked against what this process has read and written.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

from unified.conversations import ConversationLogError, scan, summary
from unified.serve.thread_futures import settle_from_thread

log = logging.getLogger(__name__)


class UnknownConversation(KeyError):
    pass


class ConversationLog:
    """Appends conversations and feedback to `path` from any event loop; one instance per file."""

    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as err:
            raise ConversationLogError(f"cannot append to the conversation log {self.path} ({err.strerror}); "
                                       f"point serve.conversation_log at a writable file") from None
        self._ids: set[str] = set()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="conversation-log", daemon=True)
        self._thread.start()

    async def add_conversation(self, record: dict) -> None:
        """Returns once the line is on disk."""
        await self._submit(record)

    async def add_feedback(self, conversation_id: str, accepted: bool, comment: str | None) -> dict:
        """Returns the feedback line once it is on disk; raises UnknownConversation for an id not in the log."""
        return await self._submit({"feedback_for": conversation_id, "accepted": accepted, "comment": comment,
                                   "created": int(time.time())})

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        os.close(self._fd)

    async def _submit(self, record: dict) -> dict:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._queue.put((record, loop, done))
        await done
        return record

    # The writer thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            records, bad = scan(self.path, repair=True)
        except OSError as err:  # the appends will fail too, and say so to each caller
            log.error("could not read the conversation log %s: %s", self.path, err)
            records, bad = [], []
        if bad:
            log.warning("%s has %d malformed lines (%s); feedback on them is refused", self.path, len(bad),
                        summary(bad))
        self._ids = {r["id"] for r in records if "id" in r}
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in batch
            self._commit([item for item in batch if item is not None])
            if stop:
                return

    def _commit(self, batch: list) -> None:
        lines, answers, new_ids = [], [], []
        for record, loop, done in batch:
            target = record.get("feedback_for")
            if target is not None and target not in self._ids:
                answers.append((loop, done, UnknownConversation(target)))
                continue
            if target is None:
                new_ids.append(record["id"])
            lines.append(json.dumps(record) + "\n")  # ASCII: any string the client sent encodes
            answers.append((loop, done, None))
        error = None
        if lines:
            size = os.fstat(self._fd).st_size
            try:
                _write_all(self._fd, "".join(lines).encode())
                os.fsync(self._fd)
                self._ids.update(new_ids)
            except OSError as err:
                log.error("could not append to the conversation log %s: %s", self.path, err)
                error = err
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, size)  # no partial line for the next append to run on from
        for loop, done, outcome in answers:
            settle_from_thread(loop, done, outcome or error)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
