import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

from unified import kernels
from unified.kernels.linear import takes_inference_path

linear_module = importlib.import_module("unified.kernels.linear")  # the package exports the function `linear`


@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48), (2, 17, 48), (300, 48), (0, 48)])
def test_inference_linear_matches_f_linear(shape):
    weight, bias = torch.randn(96, 48), torch.randn(96)
    x = torch.randn(*shape)
    with torch.inference_mode():
        assert takes_inference_path(x, weight) == torch.backends.mkldnn.is_available()
        for b in (bias, None):
            torch.testing.assert_close(kernels.linear(x, weight, b), F.linear(x, weight, b))


@pytest.mark.parametrize("layout", ["panels", "onednn"])
@pytest.mark.parametrize("rows", [0, 1, 5, 64, 300, 600])  # 600 rows: more than one row block of the panel kernel
@pytest.mark.parametrize("out_features,in_features", [(96, 48), (101, 45)])  # whole panels of 16 and a part panel
def test_packed_weight_matches_f_linear(layout, rows, out_features, in_features, monkeypatch):
    if layout == "onednn":
        monkeypatch.setattr(linear_module, "_panels_available", lambda: False)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    packed = kernels.pack_weight(weight)
    if packed is None or packed.layout != layout:
        pytest.skip(f"no {layout} packing on this machine")
    for x in (torch.randn(rows, in_features), torch.randn(rows, 2, in_features)[:, 1]):  # contiguous, strided
        with torch.inference_mode():
            for b in (bias, None):
                torch.testing.assert_close(kernels.linear(x.unsqueeze(0), weight, b, packed),
                                           F.linear(x.unsqueeze(0), weight, b))


def test_avx2_machines_pack_in_panels():
    from unified.kernels import cpu_ops

    if not (cpu_ops.available() and torch.backends.cpu.get_cpu_capability() == "AVX2"):
        pytest.skip("the panel kernel is built for AVX2 machines")
    assert kernels.pack_weight(torch.randn(96, 48)).layout == "panels"


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("out_features,in_features", [(96, 48), (101, 45)])
def test_few_row_kernel_matches_f_linear(rows, out_features, in_features):
    """Batch-1 decode shapes take the weight-streaming C++ kernel: whole groups of eight weight rows and
    a remainder, inputs that are and are not whole vectors."""
    from unified.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ CPU kernels on this machine")
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(rows, 1, in_features)
    with torch.no_grad():
        for b in (bias, None):
            expected = F.linear(x, weight, b)
            torch.testing.assert_close(torch.ops.unified_cpu.skinny_linear(x[:, 0], weight, b), expected[:, 0])
            torch.testing.assert_close(kernels.linear(x, weight, b), expected)


def test_a_packed_copy_is_ignored_once_the_weight_changes():
    weight, x = torch.randn(96, 48), torch.randn(64, 48)
    packed = kernels.pack_weight(weight)
    if packed is None:
        pytest.skip("oneDNN is not available in this torch build")
    with torch.no_grad():
        weight.add_(1.0)  # as a LoRA merge does
        torch.testing.assert_close(kernels.linear(x, weight, None, packed), F.linear(x, weight))
        weight.copy_(torch.randn(96, 48))  # as a weight update does
        torch.testing.assert_close(kernels.linear(x, weight, None, packed), F.linear(x, weight))
        torch.testing.assert_close(kernels.linear(x, weight, None, kernels.pack_weight(weight)), F.linear(x, weight))
    with torch.inference_mode():
        assert kernels.pack_weight(torch.randn(8, 4)) is None  # no version counter to check


def test_strided_operands():
    weight, x = torch.randn(96, 100)[:, :48], torch.randn(8, 100)[:, 52:]  # views into wider rows
    with torch.no_grad():
        torch.testing.assert_close(kernels.linear(x, weight), F.linear(x, weight))


def test_training_gets_gradients():
    weight = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(32, 4)
    assert not takes_inference_path(x, weight)
    kernels.linear(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, x.sum(0).expand(8, 4))


def test_the_training_path_ignores_packed_copies_and_kernels_with_autograd_off():
    weight, x = torch.randn(96, 48), torch.randn(5, 48)
    other = kernels.pack_weight(weight + 1.0)
    if other is None:
        pytest.skip("no packed copies on this machine")
    claims_current = dataclasses.replace(other, version=weight._version)  # another weight's copy, passed off as this one's
    with torch.no_grad():
        fast = kernels.linear(x, weight, None, claims_current)
        with kernels.training_path():
            plain = kernels.linear(x, weight, None, claims_current)
    assert torch.equal(plain, F.linear(x, weight))
    assert not torch.allclose(fast, plain)  # outside, the inference path trusts the copy
