"""Activation-aware quantization (unified/model/calibration.py): the per-input factors it searches, and where it
leaves them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unified import kernels
from unified.checkpoint import load_model
from unified.errors import UserError
from unified.model.calibration import BUILTIN, calibrate, calibration_text, smoothing_factors
from unified.model.parallel_layers import PackableLinear


def _output_error(weight, x, quantization, factors=None) -> float:
    copy = kernels.quantize(weight, quantization, smoothing=factors)
    return (F.linear(x, kernels.dequantize(copy)) - F.linear(x, weight)).norm().item()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_search_lowers_the_output_error_where_a_few_inputs_carry_large_activations(quantization):
    """Inputs whose features differ by orders of magnitude (as LLM activations do): the chosen factors give a
    smaller output error than the plain copy on those inputs, and on new inputs of the same kind."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=g) * 0.05
    features = torch.ones(128)
    features[[3, 40, 77]] = 60.0  # a few outlier features
    seen, unseen = (torch.randn(200, 128, generator=g) * features for _ in range(2))
    factors = smoothing_factors(weight, seen, quantization)
    assert factors is not None and factors.shape == (128,) and (factors > 0).all()
    assert factors[[3, 40, 77]].min() > factors.median()  # the outliers get finer steps
    for x in (seen, unseen):
        assert _output_error(weight, x, quantization, factors) < 0.8 * _output_error(weight, x, quantization)


def test_the_search_runs_on_bfloat16_weights_under_inference_mode():
    """As an accelerator's bf16 engine calls it: the float32 copies it makes keep no version counter."""
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(64, 128, generator=g) * 0.05).bfloat16()
    x = torch.randn(100, 128, generator=g)
    x[:, [5, 9]] *= 60.0
    with torch.inference_mode():
        factors = smoothing_factors(weight, x.bfloat16(), "int8")
    assert factors is not None and factors.dtype == torch.float32


def test_inputs_of_even_magnitude_keep_the_plain_copy():
    """Every feature of the same magnitude: no factor does better than 1, so there is none."""
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    x = torch.ones(50, 64)
    x[::2] = -1.0
    assert smoothing_factors(weight, x, "int8") is None


def test_calibrate_leaves_factors_that_the_copies_use_and_keep(tiny_checkpoint, runtime):
    """One forward over the calibration tokens sets the quantized linears' factors (the LM head's only when it is
    quantized); the copies use them, and so do the copies made after the weights change."""
    model = load_model(tiny_checkpoint("llama")).model
    model.weight_quantization = "int8"
    tokens = torch.randint(0, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    calibrate(model, tokens)
    linears = [m for m in model.modules() if isinstance(m, PackableLinear) and m is not model.lm_head]
    assert any(m.input_smoothing is not None for m in linears)
    assert model.lm_head is None or model.lm_head.input_smoothing is None
    model.pack_weights()
    for module in linears:
        assert module.packed.layout == "int8"
        assert (module.packed.input_scale is None) == (module.input_smoothing is None)
    smoothed = next(m for m in linears if m.input_smoothing is not None)
    with torch.no_grad():
        smoothed.weight.add_(0.01)
    model.pack_weights()
    torch.testing.assert_close(smoothed.packed.input_scale, smoothed.input_smoothing.reciprocal())


def test_a_calibration_text_that_cannot_be_read_is_refused(tmp_path):
    assert len(calibration_text(BUILTIN).split()) > 200
    for source, words in ((str(tmp_path / "missing.txt"), "cannot read"), (str(tmp_path), "cannot read")):
        with pytest.raises(UserError, match=words):
            calibration_text(source)
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(UserError, match="empty"):
        calibration_text(str(tmp_path / "empty.txt"))


def test_weights_from_a_quantized_checkpoint_are_not_smoothed(tiny_checkpoint, runtime):
    """Weights dequantized from a quantized checkpoint were rounded once; factors would round them again, so
    `calibrate` leaves them plain (int4 copies of an int4 checkpoint then hold its very values)."""
    model = load_model(tiny_checkpoint("llama")).model
    model.weight_quantization, model.quantized_source = "int8", True
    calibrate(model, list(range(3, 40)))
    assert all(m.input_smoothing is None for m in model.modules() if isinstance(m, PackableLinear))
