"""Where RLHF prompts come from: a `data=` JSONL file, or a reasoning-gym task generated offline.

A data line carries `prompt` (text) or `messages` (a chat), and any other fields, which reach the reward
function as task fields. A task's prompts are chats asking for the answer between <answer> tags; its
entries (question, answer, metadata) go to `task_reward`, which scores the answer (tagged, or else the
last number) with the task's own checker. Train and held-out prompts are drawn with different seeds, so they do not overlap by design.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from unified.errors import UserError
from unified.jsonl import jsonl_lines
from unified.rlhf.rewards import extract_answer

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
SYSTEM = ("Solve the problem. Reason briefly if you need to, then give only the final answer between "
          "<answer> and </answer>.")


RESERVED_FIELDS = {"prompts", "completions"}  # reward(prompts, completions, **task_fields)


def read_prompts(path: str | Path) -> list[dict]:
    """Lines of `path` as {"prompt" or "messages", ...task fields}; a bad line is an error naming it."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise UserError(f"cannot read the prompts in data={path}: {err.strerror or err}") from None
    prompts = []
    for lineno, line in enumerate(jsonl_lines(text), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{lineno}: not JSON ({err})") from None
        if not isinstance(record, dict) or not (isinstance(record.get("prompt"), str)
                                                or isinstance(record.get("messages"), list)):
            raise UserError(f"{path}:{lineno}: each line needs \"prompt\" (text) or \"messages\" (a chat)")
        if not record.get("prompt", record.get("messages")):
            raise UserError(f"{path}:{lineno}: the prompt is empty")
        clash = sorted(RESERVED_FIELDS & set(record))
        if clash:
            raise UserError(f"{path}:{lineno}: the task field(s) {', '.join(clash)} would clash with the reward "
                            f"function's own arguments (prompts, completions); rename them")
        prompts.append(record)
    if not prompts:
        raise UserError(f"{path} holds no prompts")
    fields = set(prompts[0]) - {"prompt", "messages"}
    for lineno, record in enumerate(prompts, start=1):
        if set(record) - {"prompt", "messages"} != fields:
            raise UserError(f"{path}: prompt {lineno} has the fields {sorted(set(record) - {'prompt', 'messages'})} "
                            f"but the first has {sorted(fields)}; every line must carry the same task fields")
    return prompts


def task_prompts(name: str, count: int, seed: int, options: dict) -> list[dict]:
    """`count` prompts of the reasoning-gym task `name`, each with its `entry` for `task_reward`."""
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(name, size=count, seed=seed, **options)
    except (KeyError, ValueError, TypeError, AssertionError) as err:
        raise UserError(f"rlhf.task={name!r} with rlhf.task_options={options} cannot be generated: {err}") from None
    return [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": entry["question"]}],
             "entry": entry} for entry in dataset]


def _answer(completion: str) -> str | None:
    """The tagged answer, or else the last number in the text (small models rarely use the tags at first)."""
    tagged = extract_answer(completion)
    if tagged is not None:
        return tagged
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def task_reward(prompts, completions, entry=None, **_fields) -> list[float]:
    """A reasoning-gym task's own score of each completion's answer: the tagged one, or else its last number
    (0 with neither)."""
    if entry is None:
        raise UserError("the default reward, unified.rlhf.tasks:task_reward, scores reasoning-gym task prompts; "
                        "with data= name your own with rlhf.reward=package.module:function")
    import reasoning_gym

    scores = []
    for completion, item in zip(completions, entry):
        answer = _answer(completion)
        checker = reasoning_gym.get_score_answer_fn(item["metadata"]["source_dataset"])
        scores.append(float(checker(answer, item)) if answer is not None else 0.0)
    return scores
