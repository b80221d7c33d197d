"""The reward contract: import paths resolve or fail clearly, and every call's result is checked."""
from __future__ import annotations

import pytest

from unified.errors import UserError
from unified.rlhf.rewards import extract_answer, format_reward, load_reward, score


def length_reward(prompts, completions, target):
    return [float(len(c) == t) for c, t in zip(completions, target)]


def test_reward_functions_load_by_import_path():
    assert load_reward("unified.rlhf.rewards:format_reward") is format_reward
    assert load_reward("unified.rlhf.rewards.format_reward") is format_reward
    for path, words in [("nowhere.at_all:f", "cannot import 'nowhere.at_all'"),
                        ("unified.rlhf.rewards:missing", "has no function 'missing'"),
                        ("format_reward", "not an import path")]:
        with pytest.raises(UserError, match=words):
            load_reward(path)


def test_scores_reach_the_function_with_task_fields():
    assert score(length_reward, ["p", "q"], ["ab", "abc"], {"target": [2, 2]}) == [1.0, 0.0]


@pytest.mark.parametrize("returned,words", [([1.0], "returned 1 for 2 completions"),
                                            (None, "returned NoneType for 2 completions"),
                                            ([1.0, "high"], "returned 'high' for completion 1"),
                                            ([float("nan"), 0.0], "returned nan for completion 0"),
                                            ([True, 0.0], "returned True for completion 0")])
def test_a_wrong_result_names_the_function(returned, words):
    def broken_reward(prompts, completions):
        return returned

    with pytest.raises(UserError, match=f"broken_reward.*{words}"):
        score(broken_reward, ["p", "q"], ["a", "b"])


def test_a_reward_function_that_raises_is_named():
    def failing_reward(prompts, completions):
        raise KeyError("answer")

    with pytest.raises(UserError, match="reward function .*failing_reward raised KeyError: 'answer'"):
        score(failing_reward, ["p"], ["a"])


def test_format_reward_wants_a_tagged_answer():
    assert extract_answer("so <answer> 42 </answer> and <answer>7</answer>") == "7"
    assert format_reward([], ["<answer>12</answer>", "12", "<answer>unclosed"]) == [1.0, 0.0, 0.0]
