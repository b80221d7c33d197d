import pytest
import torch
import torch.nn.functional as F

from unified.kernels import cpu_ops, gated_activation, gated_activation_reference


@pytest.mark.parametrize("shape", [(3, 7, 64), (5, 1536 * 2), (1, 22)])
def test_silu_gated_activation_matches_the_reference(shape):
    x = 4 * torch.randn(shape)
    with torch.no_grad():
        out = gated_activation(x, F.silu)
    torch.testing.assert_close(out, gated_activation_reference(x, F.silu), rtol=1e-6, atol=1e-6)
    assert out.shape == (*shape[:-1], shape[-1] // 2)


def test_silu_gated_activation_goes_through_the_cpu_kernel_without_autograd():
    if not cpu_ops.available():
        pytest.skip("no C++ CPU kernels on this machine")
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(gated_activation(x, F.silu), torch.ops.unified_cpu.silu_and_mul(x))


def test_gated_activation_keeps_gradients_and_other_activations():
    x = torch.randn(4, 32, requires_grad=True)
    gated_activation(x, F.silu).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    with torch.no_grad():
        torch.testing.assert_close(gated_activation(x, F.gelu), gated_activation_reference(x, F.gelu))
