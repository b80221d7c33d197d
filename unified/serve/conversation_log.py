"""The conversation log: served chat completions and the feedback on them, as append-only JSON lines.

Two kinds of line share one file. A conversation line is written when a chat completion finishes:
`{"id", "object": "conversation", "created", "model", "weights_version", "messages", "choices", "feedback": null}`.
A feedback line refers back to one: `{"feedback_for", "accepted", "comment", "created"}`. Nothing is ever
rewritten; `read_conversations` merges each conversation with its latest feedback.

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

from unified.errors import UserError
from unified.serve.thread_futures import settle_from_thread

log = logging.getLogger(__name__)


class ConversationLogError(UserError, ValueError):
    pass


class UnknownConversation(KeyError):
    pass


def conversation_record(response_id: str, created: int, model: str, weights_version: int, messages: list[dict],
                        outputs) -> dict:
    """The line for a finished chat completion; `outputs` are its choices (`index`, `text`, `finish_reason`).
    `weights_version` is the one serving when the request was accepted (a reload meanwhile may have
    produced its later tokens)."""
    choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text}, "finish_reason": o.finish_reason}
               for o in outputs]
    return {"id": response_id, "object": "conversation", "created": created, "model": model,
            "weights_version": weights_version, "messages": messages, "choices": choices, "feedback": None}


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
            records, bad = _scan(self.path, repair=True)
        except OSError as err:  # the appends will fail too, and say so to each caller
            log.error("could not read the conversation log %s: %s", self.path, err)
            records, bad = [], []
        if bad:
            log.warning("%s has %d malformed lines (%s); feedback on them is refused", self.path, len(bad),
                        _summary(bad))
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


def _scan(path: Path, repair: bool = False) -> tuple[list[dict], list[str]]:
    """The log's records in order, and what is wrong with each line that is not one. A last line without
    its newline (a write cut short) is skipped, and with `repair` cut off the file so the next line starts clean."""
    if not path.exists():
        return [], []
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        log.warning("%s: ignoring a partial last line (%d bytes) left by an interrupted write",
                    path, len(data) - complete)
        if repair:
            os.truncate(path, complete)
    records, bad = [], []
    for number, line in enumerate(data[:complete].decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            bad.append(f"line {number}: {err.msg}")
            continue
        if not isinstance(record, dict) or not ({"id", "messages", "choices"} <= record.keys()
                                                or {"feedback_for", "accepted"} <= record.keys()):
            bad.append(f"line {number}: neither a conversation nor a feedback record")
            continue
        records.append(record)
    return records, bad


def _summary(bad: list[str]) -> str:
    return "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")


def read_conversations(path: str | Path) -> list[dict]:
    """The logged conversations in the order they finished, each with `feedback` set to the latest
    feedback given on it (`{"accepted", "comment", "created"}`) or None.

    Raises ConversationLogError naming the line numbers of lines that are not records (a partial last
    line, left by a crash mid-write, is skipped with a warning instead)."""
    path = Path(path)
    records, bad = _scan(path)
    if bad:
        raise ConversationLogError(f"{path} has {len(bad)} malformed lines ({_summary(bad)}); remove or repair them")
    conversations = {r["id"]: r for r in records if "id" in r}
    for record in records:
        target = record.get("feedback_for")
        if target is None:
            continue
        if target not in conversations:
            log.warning("%s: feedback for %r, which the log does not hold; ignored", path, target)
            continue
        conversations[target]["feedback"] = {k: record.get(k) for k in ("accepted", "comment", "created")}
    return list(conversations.values())
