"""engine.quantization=int8|int4: the engine serves weight-only quantized copies of the linears it was given."""
from __future__ import annotations

import importlib

import pytest
import torch

from tests.engine.conftest import generate_all, make_engine, reference_logits, run_teacher_forced
from unified.checkpoint import load_model
from unified.engine.sampling_params import SamplingParams
from unified.errors import UserError
from unified.model.calibration import calibrate
from unified.model.parallel_layers import PackableLinear

linear_module = importlib.import_module("unified.kernels.linear")


def _dequantized_copy(path, with_head: bool, quantization: str = "int8", smoothing=None):
    """The model with each linear's weight replaced by what its int8 (int4) copy encodes (activation-aware with
    `smoothing`, a dict of each linear's factors by module name)."""
    loaded = load_model(path)
    with torch.no_grad():
        for name, module in loaded.model.named_modules():
            if isinstance(module, PackableLinear) and (module is not loaded.model.lm_head or with_head):
                packed = linear_module.quantize(module.weight, quantization, smoothing=(smoothing or {}).get(name))
                module.weight.copy_(linear_module.dequantize(packed))
    return loaded


@pytest.mark.parametrize("family,quantization,calibrated", [
    ("llama", "int8", False), ("qwen3", "int8", False), ("qwen3_moe", "int8", False), ("llama", "int4", False),
    ("qwen3_moe", "int4", False), ("llama", "int8", True), ("qwen3_moe", "int4", True)])
def test_quantized_engine_computes_the_dequantized_model(family, quantization, calibrated, tiny_checkpoint, runtime):
    """Prefill and decode logits equal a plain forward of the weights the int8 / int4 copies stand for, plain or
    activation-aware; the LM head stays in full precision unless asked."""
    path = tiny_checkpoint(family)
    loaded = load_model(path)
    smoothing = None
    if calibrated:  # no tokenizer here, so the engine takes the factors calibrate left and searches none itself
        loaded.model.weight_quantization = quantization
        calibrate(loaded.model, [i % loaded.config.vocab_size for i in range(3, 400, 7)])
        smoothing = {name: m.input_smoothing for name, m in loaded.model.named_modules()
                     if isinstance(m, PackableLinear) and m.input_smoothing is not None}
        assert smoothing
    engine = make_engine(loaded, quantization=quantization)
    linears = [m for m in loaded.model.modules() if isinstance(m, PackableLinear)]
    head = loaded.model.lm_head
    assert all(m.packed.layout == quantization for m in linears if m is not head)
    assert head is None or head.packed is None or not head.packed.quantized
    prompts = [[5, 17, 3, 99, 42, 8, 1], [7, 7, 7, 120, 33]]
    continuations = [[11, 12, 13, 14], [50, 60, 70]]
    got = run_teacher_forced(engine, prompts, continuations)
    reference = _dequantized_copy(path, with_head=False, quantization=quantization, smoothing=smoothing).model
    for logits, prompt, continuation in zip(got, prompts, continuations):
        torch.testing.assert_close(logits, reference_logits(reference, prompt, continuation), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rescore", [0, 3])
def test_the_head_is_quantized_when_asked(tiny_checkpoint, runtime, rescore):
    """engine.quantize_lm_head: an LM head of its own, and one tied to the embedding (whose lookups keep full
    precision), serve int8 too; with engine.quantized_head_rescore=k each row's k largest logits are the
    full-precision head's, and greedy decoding picks the first maximum of those logits."""
    prompt, continuation = [3, 1, 4, 1, 5, 9, 2, 6], [8, 9, 7, 9]
    for family in ("llama", "qwen3"):
        path = tiny_checkpoint(family)
        loaded = load_model(path)
        engine = make_engine(loaded, quantization="int8", quantize_lm_head=True, quantized_head_rescore=rescore)
        model = loaded.model
        head = model.lm_head.packed if model.lm_head is not None else model.tied_head_packed.chunks[0][2]
        assert head.layout == "int8"
        got = run_teacher_forced(engine, [prompt], [continuation])[0]
        reference = _dequantized_copy(path, with_head=True).model
        ids = prompt + continuation[:-1]
        full = load_model(path).model
        full_weight = (full.lm_head or full.embed).weight
        with torch.inference_mode():
            hidden = reference(torch.tensor([ids]), torch.arange(len(ids)))[0, len(prompt) - 1:]
            want = torch.nn.functional.linear(hidden, linear_module.dequantize(linear_module.quantize_int8(full_weight)))
            if rescore:
                top = want.topk(rescore, -1).indices
                want.scatter_(-1, top, torch.nn.functional.linear(hidden, full_weight).gather(-1, top))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        greedy = generate_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        tokens = greedy[0].outputs[0].token_ids
        forced = run_teacher_forced(engine, [prompt], [tokens])[0]
        assert tokens == forced.argmax(-1).tolist()


HELD_OUT_TEXTS = [  # none of it in the built-in calibration text
    "The capital of France is Paris. The largest planet in the solar system is Jupiter. Water boils at 100 degrees "
    "Celsius at sea level, and the tallest mountain on Earth is",
    "My grandmother grew tomatoes, beans and pumpkins in a small garden behind the house. Every August she made jars "
    "of sauce and gave them to the neighbours, who paid her back with eggs and honey.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        "
    "self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "The French Revolution began in 1789 with the storming of the Bastille. Over the next decade the monarchy was "
    "abolished, a republic was declared, and Napoleon Bonaparte rose to power.",
    "To reset your password, open the settings page, choose Account, then Security, and press the button labelled "
    "Change password. You will receive an email with a link that expires after 24 hours.",
    "Mitochondria are the power stations of the cell: they turn the energy stored in food into a molecule called "
    "ATP, which the cell spends on movement, growth and repair.",
]


def test_int8_smollm2_keeps_the_answers(runtime, smollm2_checkpoint):
    """Real weights: logits close to fp32 (cosine >= 0.98 at every position of held-out texts) and the same
    greedy text; the activation-aware copies (calibrated on the built-in text, the default) closer to fp32 on
    those texts than plain ones."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    prompt, texts = HELD_OUT_TEXTS[0], [tokenizer(text)["input_ids"] for text in HELD_OUT_TEXTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = generate_all(make_engine(load_model(smollm2_checkpoint), tokenizer, block_size=16), [prompt], params)
    reference = load_model(smollm2_checkpoint).model
    want = [reference_logits(reference, ids[:1], ids[1:] + [0]) for ids in texts]
    cosines = {}
    for calibration in ("builtin", None):
        loaded = load_model(smollm2_checkpoint)
        engine = make_engine(loaded, tokenizer, block_size=16, quantization="int8",
                             quantization_calibration=calibration)
        assert generate_all(engine, [prompt], params)[0].outputs[0].text == full[0].outputs[0].text
        with torch.inference_mode():
            got = [loaded.model.logits(loaded.model(torch.tensor([ids]), torch.arange(len(ids))))[0] for ids in texts]
        cosines[calibration] = torch.cat([torch.nn.functional.cosine_similarity(a, b, dim=-1)
                                          for a, b in zip(got, want)])
        assert cosines[calibration].min() >= 0.98
    assert 1 - cosines["builtin"].mean() < 0.9 * (1 - cosines[None].mean())


def test_a_calibration_text_that_cannot_be_read_is_refused_at_start(tiny_models, smollm2_checkpoint, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    with pytest.raises(UserError, match="quantization_calibration=.*cannot read"):
        make_engine(tiny_models("llama"), tokenizer, quantization="int8",
                    quantization_calibration=str(tmp_path / "missing.txt"))


def test_quantization_settings_that_cannot_run_are_refused(tiny_models):
    for value, words in (("fp8", "not available for full-precision weights"), ("nf4", "unknown")):
        with pytest.raises(UserError, match=words):
            make_engine(tiny_models("llama"), quantization=value)
    with pytest.raises(UserError, match="quantized_head_rescore=-1: .* or 0 to turn rescoring off"):
        make_engine(tiny_models("llama"), quantization="int8", quantized_head_rescore=-1)
