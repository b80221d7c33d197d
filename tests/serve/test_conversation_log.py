"""The conversation log on its own: concurrent appends stay whole lines, feedback merges, bad lines are named."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from unified.conversations import ConversationLogError, conversation_record, read_conversations
from unified.serve.conversation_log import ConversationLog, UnknownConversation


def _record(i: int) -> dict:
    outputs = [SimpleNamespace(index=0, text=f"answer {i} " + "x" * 5000, finish_reason="stop")]
    return conversation_record(f"chatcmpl-{i}", 1700000000 + i, "tiny", 0, [{"role": "user", "content": f"q{i}"}],
                               outputs)


def test_concurrent_appends_and_feedback_merge(tmp_path):
    path = tmp_path / "log" / "conversations.jsonl"

    async def main() -> None:
        log = ConversationLog(path)
        try:
            await asyncio.gather(*(log.add_conversation(_record(i)) for i in range(200)))
            await log.add_feedback("chatcmpl-3", False, "wrong")
            await log.add_feedback("chatcmpl-3", True, None)  # the latest verdict wins
            await log.add_feedback("chatcmpl-7", False, "rude \u2028 \ud800")  # any string the client sent
            with pytest.raises(UnknownConversation):
                await log.add_feedback("chatcmpl-nope", True, None)
        finally:
            log.close()

    asyncio.run(main())
    lines = path.read_text().splitlines()
    assert len(lines) == 203 and all(json.loads(line) for line in lines)
    conversations = read_conversations(path)
    assert sorted(c["id"] for c in conversations) == sorted(f"chatcmpl-{i}" for i in range(200))
    by_id = {c["id"]: c for c in conversations}
    assert by_id["chatcmpl-3"]["feedback"]["accepted"] is True and by_id["chatcmpl-3"]["feedback"]["comment"] is None
    assert by_id["chatcmpl-7"]["feedback"]["accepted"] is False
    assert by_id["chatcmpl-0"]["feedback"] is None
    assert by_id["chatcmpl-5"]["choices"][0]["message"]["content"].startswith("answer 5 ")


def test_a_cut_short_last_line_is_skipped_and_repaired_on_reopen(tmp_path):
    path = tmp_path / "conversations.jsonl"
    path.write_text(json.dumps(_record(1)) + "\n" + json.dumps(_record(2))[:100])
    assert [c["id"] for c in read_conversations(path)] == ["chatcmpl-1"]

    async def main() -> None:
        log = ConversationLog(path)
        try:
            await log.add_feedback("chatcmpl-1", True, "known from the earlier run")
            await log.add_conversation(_record(3))
        finally:
            log.close()

    asyncio.run(main())
    conversations = read_conversations(path)
    assert [c["id"] for c in conversations] == ["chatcmpl-1", "chatcmpl-3"]
    assert conversations[0]["feedback"]["comment"] == "known from the earlier run"


def test_malformed_lines_are_reported_by_number(tmp_path):
    path = tmp_path / "conversations.jsonl"
    path.write_text("\n".join([json.dumps(_record(1)), "{not json", json.dumps({"something": "else"}),
                               json.dumps(_record(2))]) + "\n")
    with pytest.raises(ConversationLogError, match=r"2 malformed lines \(line 2: .*; line 3: neither"):
        read_conversations(path)


def test_an_unwritable_log_is_a_clear_error(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConversationLogError, match="serve.conversation_log"):
        ConversationLog(tmp_path / "taken")
