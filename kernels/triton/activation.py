"""SiLU-and-mul: x = [gate | up] -> silu(gate) * up (Triton; reference: unified/kernels/activation.py)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(COMPUTE)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded to the input dtype, as F.silu's output is
    tl.store(out_ptr + row * n_cols + cols, silu * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    rows, n_cols = x2.shape[0], x2.shape[1] // 2
    out = x2.new_empty(rows, n_cols)
    if rows and n_cols:
        block = min(1024, triton.next_power_of_2(n_cols))
        compute = tl.float64 if x.dtype == torch.float64 else tl.float32
        _silu_and_mul_kernel[(rows, triton.cdiv(n_cols, block))](x2, out, n_cols, BLOCK=block, COMPUTE=compute)
    return out.view(*x.shape[:-1], n_cols)
