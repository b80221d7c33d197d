"""HF-named tensors streamed one at a time into a loaded model land where the loader would have put them."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import build_tiny_hf_model
from unified.checkpoint import load_model
from unified.checkpoint.weight_stream import WeightStream, parse_dtype


@pytest.mark.parametrize("source", ["state_dict", "on_disk"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral", "deepseek_v3"])
def test_streamed_tensors_equal_the_loaded_checkpoint(family, source, runtime, tiny_checkpoint, tmp_path):
    """Names as a transformers model holds them (fused experts) or as its checkpoint stores them."""
    other = build_tiny_hf_model(family, seed=1)
    other.save_pretrained(tmp_path)
    want = dict(load_model(tmp_path).model.named_parameters())
    model = load_model(tiny_checkpoint(family)).model
    stream = WeightStream(model)
    state = other.state_dict() if source == "state_dict" else load_file(next(tmp_path.glob("*.safetensors")))
    names = list(reversed(state))  # any order: q, k and v of one fused weight arrive apart
    assert stream.problems(names, [str(state[n].dtype) for n in names], [list(state[n].shape) for n in names]) == []
    not_in_place = []
    for name in names:
        whole = stream.in_place(name, list(state[name].shape), state[name].dtype)  # a receiver's direct target
        if whole is None:
            stream.write(name, state[name])
            not_in_place.append(name)
        else:
            whole.copy_(state[name])
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
    # on one rank every tensor lies whole in a parameter (a receiver needs no buffer) but a tied head's copy
    assert set(not_in_place) <= stream.ignored, not_in_place


def test_a_bad_update_is_described_before_anything_is_written(runtime, tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3")).model  # tied embeddings: lm_head.weight is accepted, unused
    stream = WeightStream(model)
    q = "model.layers.0.self_attn.q_proj.weight"
    shape = list(stream.full_shape(q))
    assert stream.problems(["lm_head.weight", q], ["float32", "torch.float32"], [[160, 64], shape]) == []
    problems = stream.problems(["model.layers.0.self_attn.qkv.weight", q, q], ["float32", "bfloat16", "float32"],
                               [[1], shape, [shape[0] + 1, shape[1]]])
    assert [p.split(":")[0] for p in problems] == ["the model has no tensor 'model.layers.0.self_attn.qkv.weight' (names "
                                                   "are those of the HF model's state_dict())", q, q]
    assert "dtype 'bfloat16', but the served weights are float32" in problems[1]
    assert f"shape [{shape[0] + 1}, {shape[1]}], but the model's is {shape}" in problems[2]
    assert "one length" in stream.problems([q], [], [])[0]
    assert parse_dtype("torch.bfloat16") is torch.bfloat16 and parse_dtype("Tensor") is None
