"""Training data: labels only where the model should learn, bad lines reported and skipped, packing
that keeps examples apart, and the deterministic step plan."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from unified.train.data import IGNORE, chat_example, completion_example, load_examples
from unified.train.packing import RowStream, collate, pack_rows


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_checkpoint)


def _labelled_text(tokenizer, example) -> str:
    return tokenizer.decode([t for t in example.labels if t != IGNORE])


def test_chat_labels_cover_exactly_the_assistant_turns(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"},
                {"role": "assistant", "content": "Rome."}]
    example = chat_example(tokenizer, messages)
    assert len(example.labels) == len(example.input_ids)
    assert _labelled_text(tokenizer, example) == "Paris.<|im_end|>\nRome.<|im_end|>\n"
    assert "France" not in _labelled_text(tokenizer, example)


def test_completion_labels_cover_the_completion_and_eos(tokenizer):
    example = completion_example(tokenizer, "2 + 2 =", " 4")
    assert _labelled_text(tokenizer, example) == " 4" + tokenizer.eos_token
    assert tokenizer.decode(example.input_ids).startswith("2 + 2 =")


def test_bad_lines_are_reported_by_number_and_skipped(tokenizer, tmp_path, caplog):
    path = tmp_path / "data.jsonl"
    good = {"prompt": "a", "completion": "b"}
    lines = [json.dumps(good), "{not json", json.dumps({"messages": []}), json.dumps([1, 2]), "",
             json.dumps({"messages": [{"role": "user", "content": "hi"}]}), json.dumps(good),
             json.dumps({"messages": [{"role": "assistant", "content": "Hello there"}]}),
             json.dumps({"messages": [{"role": 5, "content": "x"}, {"role": "assistant", "content": "y"}]})]
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"prompt": "bad \xff\xfe", "completion": "ok"}\n')
    with caplog.at_level(logging.WARNING):
        examples = load_examples(path, tokenizer, max_len=64)
    assert len(examples) == 2
    for lineno in (2, 3, 4, 6, 8, 9, 10):
        assert f"data.jsonl:{lineno} skipped" in caplog.text
    assert "starts with an assistant reply" in caplog.text and "not UTF-8" in caplog.text
    assert "data.jsonl:5" not in caplog.text  # blank lines are not errors


def test_no_usable_line_is_a_clear_error(tokenizer, tmp_path):
    from unified.errors import UserError

    path = tmp_path / "data.jsonl"
    path.write_text("oops\n")
    with pytest.raises(UserError, match="no usable training examples"):
        load_examples(path, tokenizer, max_len=64)
    with pytest.raises(UserError, match="is not a file"):
        load_examples(tmp_path / "missing.jsonl", tokenizer, max_len=64)


def test_packing_is_first_fit_in_order_and_never_splits_an_example():
    assert pack_rows([3, 4, 2, 5, 1], [0, 1, 2, 3, 4], seq_len=8, packing=True) == [[0, 1], [2, 3, 4]]
    assert pack_rows([3, 4, 2], [2, 0, 1], seq_len=8, packing=False) == [[2], [0], [1]]
    assert pack_rows([9, 2], [0, 1], seq_len=8, packing=True) == [[0], [1]]


def test_row_stream_is_deterministic_and_crosses_epochs(tokenizer):
    examples = [completion_example(tokenizer, f"{i} +", f" {i}") for i in range(10)]
    a = RowStream(examples, seq_len=16, packing=True, shuffle=True, seed=3)
    b = RowStream(examples, seq_len=16, packing=True, shuffle=True, seed=3)
    per_epoch = a.rows_in_epochs(1)
    assert sorted(i for row in a.rows(0, per_epoch) for i in row) == list(range(10))
    assert a.rows(per_epoch - 1, 4) == b.rows(per_epoch - 1, 4)  # random access, across the epoch boundary
    assert a.rows(per_epoch, per_epoch) != a.rows(0, per_epoch)  # the next epoch is shuffled afresh


def test_collate_restarts_positions_and_shifts_targets_within_each_example(tokenizer):
    examples = [completion_example(tokenizer, "1 +", " 1"), completion_example(tokenizer, "22 +", " 22")]
    batch = collate(examples, [[0, 1], [1]], pad_id=0)
    n0, n1 = len(examples[0].input_ids), len(examples[1].input_ids)
    assert batch.positions[0, :n0].tolist() == list(range(n0))
    assert batch.positions[0, n0:n0 + n1].tolist() == list(range(n1))
    assert batch.targets[0, n0 - 1] == IGNORE  # the first example's last token predicts nothing of the second
    assert batch.targets[0, :n0 - 1].tolist() == examples[0].labels[1:]
    assert batch.segments[1].tolist() == [0] * n1 + [-1] * n0  # padding
    assert batch.num_tokens == n0 + 2 * n1


@pytest.mark.parametrize("family", ["llama", "mistral", "deepseek_v3"])
@pytest.mark.parametrize("recompute", [False, True])
def test_packed_rows_train_exactly_like_separate_examples(runtime, tiny_checkpoint, family, recompute):
    """Packed: same loss and gradients as each example on its own (no attention across examples), with and
    without activation recomputation; covers sliding windows (mistral) and MLA (deepseek_v3)."""
    from unified.checkpoint import load_model
    from unified.train.data import Example
    from unified.train.engine import TrainingModel

    model = load_model(tiny_checkpoint(family)).model.train()
    model.checkpoint_layers = recompute
    wrapped = TrainingModel(model)
    gen = torch.Generator().manual_seed(0)
    examples = [Example(ids := torch.randint(0, 160, (n,), generator=gen).tolist(), ids) for n in (7, 12, 5)]

    def loss_and_grads(rows):
        model.zero_grad()
        batch = collate(examples, rows, pad_id=0)
        loss = wrapped(batch.input_ids, batch.positions, batch.targets, batch.segments)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    packed_loss, packed_grads = loss_and_grads([[0, 1, 2]])
    single = [loss_and_grads([[i]]) for i in range(3)]
    torch.testing.assert_close(packed_loss, sum(loss for loss, _ in single), rtol=1e-5, atol=1e-5)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, sum(g[name] for _, g in single), rtol=1e-4, atol=1e-5)
