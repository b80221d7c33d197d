"""Prompt sources: data files are checked line by line; a reasoning-gym task's reward uses its checker."""
from __future__ import annotations

import json

import pytest

from unified.errors import UserError
from unified.rlhf.tasks import read_prompts, task_prompts, task_reward


def test_a_task_generates_seeded_chats_and_scores_tagged_answers():
    prompts = task_prompts("basic_arithmetic", 4, seed=3, options={"min_terms": 2, "max_terms": 2})
    assert prompts == task_prompts("basic_arithmetic", 4, seed=3, options={"min_terms": 2, "max_terms": 2})
    assert prompts != task_prompts("basic_arithmetic", 4, seed=4, options={"min_terms": 2, "max_terms": 2})
    assert [m["role"] for m in prompts[0]["messages"]] == ["system", "user"]
    entries = [p["entry"] for p in prompts[:2]]
    right = f"So the result is <answer>{entries[0]['answer']}</answer>, not 12345."
    untagged = f"It is {entries[1]['answer']}."  # the last number stands in for an answer without tags
    assert task_reward(None, [right, untagged], entry=entries) == [1.0, 1.0]
    wrong, silent = task_reward(None, ["<answer>12345</answer>", "no idea"], entry=entries)
    assert wrong < 1.0 and silent == 0.0  # the task's checker may give a wrong number partial credit
    with pytest.raises(UserError, match="rlhf.task='no_such_task'"):
        task_prompts("no_such_task", 2, 0, {})


@pytest.mark.parametrize("lines,words", [(['{"prompt": "a"}', "not json"], ":2: not JSON"),
                                         (['{"question": "a"}'], ':1: each line needs "prompt"'),
                                         (['{"prompt": "a", "x": 1}', '{"prompt": "b"}'], "same task fields"),
                                         ([], "holds no prompts"),
                                         (['{"prompt": "a"}', '{"prompt": ""}'], ":2: the prompt is empty"),
                                         (['{"prompt": "a", "completions": 1}'], ":1: the task field.* completions"),
                                         (['{"prompt": "one\u2028two"}', "oops"], ":2: not JSON")])
def test_bad_prompt_files_are_named(tmp_path, lines, words):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(UserError, match=words):
        read_prompts(path)


def test_prompt_files_keep_task_fields(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n\n")
    assert read_prompts(path) == [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
