import pytest
import torch

from unified.kernels import rms_norm, rms_norm_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype):
    x = torch.randn(3, 7, 64, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(64)).to(dtype)
    expected = rms_norm_reference(x, weight, 1e-6)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), expected)


@pytest.mark.parametrize("shape", [(3, 7, 64), (64, 576), (2, 13)])
def test_rms_norm_inference_kernel_matches_reference(shape):
    x = 3 * torch.randn(shape)
    weight = 1 + 0.1 * torch.randn(shape[-1])
    with torch.no_grad():
        out = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5), rtol=1e-6, atol=1e-6)


def test_rms_norm_reference_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(32))
    x = torch.randn(4, 32)
    torch.testing.assert_close(rms_norm_reference(x, hf.weight, 1e-5), hf(x), rtol=0, atol=0)


def test_rms_norm_gradients_flow():
    x = torch.randn(5, 16, requires_grad=True)
    weight = torch.ones(16, requires_grad=True)
    rms_norm(x, weight, 1e-6).sum().backward()
    assert x.grad is not None and weight.grad is not None
