import pytest
import torch
import torch.nn.functional as F

from unified import kernels


@pytest.mark.parametrize("rows", [1, 16, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    weight, bias = torch.randn(96, 48), torch.randn(96)
    packed = kernels.pack_linear_weight(weight, 64)
    if packed is None:
        pytest.skip("MKL packing is not available in this torch build")
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(kernels.linear(x, weight, bias, (packed, 64)), F.linear(x, weight, bias))


def test_training_never_uses_the_packed_copy():
    weight = torch.randn(8, 4, requires_grad=True)
    packed = kernels.pack_linear_weight(weight, 64)
    x = torch.randn(32, 4)
    out = kernels.linear(x, weight, None, None if packed is None else (packed, 64))
    out.sum().backward()
    torch.testing.assert_close(weight.grad, x.sum(0).expand(8, 4))
