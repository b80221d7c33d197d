"""RMSNorm, alone or fused with the residual add before it (Triton; reference: unified/kernels/rms_norm.py).

One program per row: the row (plus the residual, whose sum is written back as the new residual) is read
once, its statistics taken in float32, the normalised row cast to the input dtype before the weight
multiplies it, as `transformers` rounds.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, STAT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(residual_ptr + row * n_cols + cols, x, mask=mask)
    xs = x.to(STAT)
    inv = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=0) / n_cols + eps)
    normed = (xs * inv).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, weight * normed, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., H] -> weight * normalise(x (+ residual)); with `residual` (contiguous, x's shape), x + residual
    is first written into it."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x2)
    rows, cols = x2.shape
    if rows:
        stat = tl.float64 if x.dtype == torch.float64 else tl.float32
        _rms_norm_kernel[(rows,)](x2, residual if residual is not None else x2, weight, out, cols, eps,
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols), STAT=stat)
    return out.view(x.shape)
