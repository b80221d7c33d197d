"""qk-norm (optional) and RoPE over the q and k heads of a fused projection, in place, in one pass (Triton;
reference: the model's own per-head RMSNorm then `apply_rotary`, unified/model/rope.py).

One program per (token, head). cos/sin come per token from the model's rotary embedding, so its scaled
frequencies (llama3, YaRN with its attention scaling, linear, dynamic) are the kernel's too. The halves
rotation over the whole head (not interleaved, not partial); callers check `applies` first.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_kernel(qk_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, token_stride, q_heads, eps,
                      HALF: tl.constexpr, NORM: tl.constexpr, STAT: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    base = qk_ptr + token * token_stride + head * 2 * HALF
    i = tl.arange(0, HALF)
    x1 = tl.load(base + i)
    x2 = tl.load(base + HALF + i)
    if NORM:
        a, b = x1.to(STAT), x2.to(STAT)
        inv = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * HALF) + eps)
        if head < q_heads:
            w1, w2 = tl.load(qw_ptr + i), tl.load(qw_ptr + HALF + i)
        else:
            w1, w2 = tl.load(kw_ptr + i), tl.load(kw_ptr + HALF + i)
        x1 = w1 * (a * inv).to(x1.dtype)
        x2 = w2 * (b * inv).to(x2.dtype)
    cos = tl.load(cos_ptr + token * HALF + i)
    sin = tl.load(sin_ptr + token * HALF + i)
    tl.store(base + i, x1 * cos - x2 * sin)
    tl.store(base + HALF + i, x2 * cos + x1 * sin)


def applies(qk: torch.Tensor, cos: torch.Tensor) -> bool:
    """qk [T, H, D] with heads contiguous (tokens any stride), cos [T, D/2], D/2 a power of two."""
    half = cos.shape[-1]
    return (qk.dim() == 3 and half * 2 == qk.shape[-1] and half & (half - 1) == 0 and qk.stride(-1) == 1
            and qk.stride(-2) == qk.shape[-1])


def norm_rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
               k_weight: torch.Tensor | None, q_heads: int, eps: float) -> None:
    tokens, heads, dim = qk.shape
    if not tokens:
        return
    norm = q_weight is not None
    stat = tl.float64 if qk.dtype == torch.float64 else tl.float32
    _norm_rope_kernel[(tokens, heads)](qk, cos.contiguous(), sin.contiguous(), q_weight if norm else qk,
                                       k_weight if norm else qk, qk.stride(0), q_heads, eps, HALF=dim // 2,
                                       NORM=norm, STAT=stat)
