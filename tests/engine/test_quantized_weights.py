"""engine.quantization=int8|int4: the engine serves weight-only quantized copies of the linears it was given."""
from __future__ import annotations

import importlib

import pytest
import torch

from tests.engine.conftest import generate_all, make_engine, reference_logits, run_teacher_forced
from unified.checkpoint import load_model
from unified.engine.sampling_params import SamplingParams
from unified.errors import UserError
from unified.model.parallel_layers import PackableLinear

linear_module = importlib.import_module("unified.kernels.linear")


def _dequantized_copy(path, with_head: bool, quantization: str = "int8"):
    """The model with each linear's weight replaced by what its int8 (int4) copy encodes."""
    loaded = load_model(path)
    with torch.no_grad():
        for module in loaded.model.modules():
            if isinstance(module, PackableLinear) and (module is not loaded.model.lm_head or with_head):
                packed = linear_module.pack_weight(module.weight, quantization=quantization)
                module.weight.copy_(linear_module.dequantize(packed))
    return loaded


@pytest.mark.parametrize("family,quantization", [("llama", "int8"), ("qwen3", "int8"), ("qwen3_moe", "int8"),
                                                 ("llama", "int4"), ("qwen3_moe", "int4")])
def test_quantized_engine_computes_the_dequantized_model(family, quantization, tiny_checkpoint, runtime):
    """Prefill and decode logits equal a plain forward of the weights the int8 / int4 copies stand for; the LM
    head stays in full precision unless asked."""
    path = tiny_checkpoint(family)
    loaded = load_model(path)
    engine = make_engine(loaded, quantization=quantization)
    linears = [m for m in loaded.model.modules() if isinstance(m, PackableLinear)]
    head = loaded.model.lm_head
    assert all(m.packed.layout == quantization for m in linears if m is not head)
    assert head is None or head.packed is None or not head.packed.quantized
    prompts = [[5, 17, 3, 99, 42, 8, 1], [7, 7, 7, 120, 33]]
    continuations = [[11, 12, 13, 14], [50, 60, 70]]
    got = run_teacher_forced(engine, prompts, continuations)
    reference = _dequantized_copy(path, with_head=False, quantization=quantization).model
    for logits, prompt, continuation in zip(got, prompts, continuations):
        torch.testing.assert_close(logits, reference_logits(reference, prompt, continuation), rtol=1e-4, atol=1e-4)


def test_the_head_is_quantized_when_asked(tiny_checkpoint, runtime):
    """engine.quantize_lm_head: an LM head of its own, and one tied to the embedding (whose lookups keep full
    precision), serve int8 too."""
    prompt, continuation = [3, 1, 4, 1, 5, 9, 2, 6], [8, 9, 7, 9]
    for family in ("llama", "qwen3"):
        path = tiny_checkpoint(family)
        loaded = load_model(path)
        engine = make_engine(loaded, quantization="int8", quantize_lm_head=True)
        model = loaded.model
        head = model.lm_head.packed if model.lm_head is not None else model.tied_head_packed.chunks[0][2]
        assert head.layout == "int8"
        got = run_teacher_forced(engine, [prompt], [continuation])[0]
        reference = _dequantized_copy(path, with_head=True).model
        ids = prompt + continuation[:-1]
        with torch.inference_mode():
            hidden = reference(torch.tensor([ids]), torch.arange(len(ids)))[0, len(prompt) - 1:]
            packed = linear_module.quantize_int8((reference.lm_head or reference.embed).weight)
            want = torch.nn.functional.linear(hidden, linear_module.dequantize(packed))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_int8_smollm2_keeps_the_answers(runtime, smollm2_checkpoint):
    """Real weights: logits close to fp32 (cosine >= 0.99 at every position) and the same greedy text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    prompt = "The capital of France is Paris. The largest planet in the solar system is"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = generate_all(make_engine(load_model(smollm2_checkpoint), tokenizer, block_size=16), [prompt], params)
    loaded = load_model(smollm2_checkpoint)
    int8 = generate_all(make_engine(loaded, tokenizer, block_size=16, quantization="int8"), [prompt], params)
    assert int8[0].outputs[0].text == full[0].outputs[0].text
    ids = tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        got = loaded.model.logits(loaded.model(torch.tensor([ids]), torch.arange(len(ids))))[0]
    want = reference_logits(load_model(smollm2_checkpoint).model, ids[:1], ids[1:] + [0])
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() >= 0.99


def test_quantization_settings_that_cannot_run_are_refused(tiny_models):
    for value, words in (("fp8", "not available for full-precision weights"), ("nf4", "unknown")):
        with pytest.raises(UserError, match=words):
            make_engine(tiny_models("llama"), quantization=value)
