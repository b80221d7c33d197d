"""The conversation log's format and its reader, shared by the server that writes it and the online learner
that reads it.

Two kinds of line share one file. A conversation line is written when a chat completion finishes:
`{"id", "object": "conversation", "created", "model", "weights_version", "messages", "choices", "feedback": null}`.
A feedback line refers back to one: `{"feedback_for", "accepted", "comment", "created"}`. Nothing is ever
rewritten; `read_conversations` merges each conversation with its latest feedback. The writer lives in
unified.serve.conversation_log.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from unified.errors import UserError
from unified.jsonl import jsonl_lines

log = logging.getLogger(__name__)


class ConversationLogError(UserError, ValueError):
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


def scan(path: Path, repair: bool = False) -> tuple[list[dict], list[str]]:
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
    for number, line in enumerate(jsonl_lines(data[:complete].decode("utf-8", errors="replace")), start=1):
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


def summary(bad: list[str]) -> str:
    return "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")


def read_conversations(path: str | Path) -> list[dict]:
    """The logged conversations in the order they finished, each with `feedback` set to the latest
    feedback given on it (`{"accepted", "comment", "created"}`) or None.

    Raises ConversationLogError naming the line numbers of lines that are not records (a partial last
    line, left by a crash mid-write, is skipped with a warning instead)."""
    path = Path(path)
    records, bad = scan(path)
    if bad:
        raise ConversationLogError(f"{path} has {len(bad)} malformed lines ({summary(bad)}); remove or repair them")
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
