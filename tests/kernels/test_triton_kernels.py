"""The Triton kernels (kernels/triton) against the plain-PyTorch references, in float64 (quantised caches: the
references dequantise in float32), on small shapes over a pairwise grid of head sizes, GQA ratios, block
sizes, partial blocks, decode / prefill / mixed / single-token / empty batches, sliding windows and int8 /
int4 KV caches. On a GPU they run natively (bench/gpu_check.sh), here in Triton's interpreter."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from unified import kernels
from unified.kernels import registry
from unified.kernels.sources import triton_module
from unified.kernels.rotary import apply_rotary

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def backend():
    """Yields a function that runs the ops on a named backend: 'triton' (interpreted on CPU) or 'reference'."""

    def use(name: str) -> None:
        registry.set_backend(name)

    yield use
    registry.set_backend("auto")


def test_rms_norm_and_its_residual_fusion(backend):
    g = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(*shape, dtype=torch.float64, generator=g).to(DEVICE)
                           for shape in ((5, 48), (5, 48), (48,)))
    backend("triton")
    with torch.no_grad():
        normed = kernels.rms_norm(x, weight, 1e-6)
        fused, summed = kernels.add_rms_norm(x, residual, weight, 1e-6)
    # The reference normalises in float32, as transformers does.
    torch.testing.assert_close(normed, kernels.rms_norm_reference(x, weight, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(fused, kernels.rms_norm_reference(x + residual, weight, 1e-6), rtol=1e-6, atol=1e-6)
    assert kernels.rms_norm(x[:0], weight, 1e-6).shape == (0, 48)


def test_silu_and_mul(backend):
    x = torch.randn(3, 7, 2 * 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    backend("triton")
    with torch.no_grad():
        out = kernels.gated_activation(x, F.silu)
    torch.testing.assert_close(out, kernels.gated_activation_reference(x, F.silu), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", [False, True])
def test_norm_rope_on_q_and_k_heads_in_one_pass(backend, norm):
    g = torch.Generator().manual_seed(2)
    q_heads, kv_heads, dim, tokens = 4, 2, 32, 6
    qkv = torch.randn(1, tokens, q_heads + 2 * kv_heads, dim, dtype=torch.float64, generator=g).to(DEVICE)
    qk = qkv[:, :, :q_heads + kv_heads]  # heads contiguous, tokens strided as in the model
    angles = torch.rand(1, tokens, dim // 2, dtype=torch.float64, generator=g).to(DEVICE) * 6
    cos, sin = angles.cos() * 1.1, angles.sin() * 1.1  # YaRN-style attention scaling rides on cos and sin
    weights = tuple(torch.randn(dim, dtype=torch.float64, generator=g).to(DEVICE) for _ in range(2)) if norm else ()
    expected = qk.clone()
    if norm:
        q, k = expected.split([q_heads, kv_heads], dim=2)
        expected = torch.cat((kernels.rms_norm_reference(q, weights[0], 1e-6),
                              kernels.rms_norm_reference(k, weights[1], 1e-6)), dim=2)
    expected = apply_rotary(expected, cos, sin, interleaved=False)
    backend("triton")
    with torch.no_grad():
        assert kernels.norm_rope_applies(qk, cos, False, *weights)
        kernels.norm_rope_(qk, cos, sin, *(weights or (None, None)), q_heads, 1e-6)
    torch.testing.assert_close(qk, expected, rtol=1e-6, atol=1e-6)  # the norm's statistics in float32


# Pairwise over (head size, GQA ratio, block size, KV bits, window, batch): every pair of values appears.
CASES = [
    # dk, dv (None: values are the keys' first channels, MLA), q/kv heads, block, bits, window, batch
    (64, 64, (4, 4), 16, None, None, "decode"),
    (128, 128, (8, 2), 32, None, 5, "mixed"),
    (576, None, (4, 1), 16, None, None, "mixed"),
    (64, 64, (4, 2), 32, 8, None, "mixed"),
    (128, 128, (2, 2), 16, 8, 7, "decode"),
    (64, 64, (8, 2), 16, 4, None, "single"),
    (576, None, (2, 1), 32, 8, 9, "decode"),
    (128, 128, (4, 2), 16, 4, 6, "prefill"),
    (64, 64, (8, 2), 32, 4, 11, "mixed"),
    (64, 64, (4, 4), 32, None, None, "single"),
    (64, 64, (4, 2), 16, None, None, "empty"),
]
BATCHES = {  # (context length, query length) per sequence; partial last blocks throughout
    "decode": [(37, 1), (5, 1), (20, 1)],
    "mixed": [(37, 1), (29, 12), (9, 9), (3, 1)],
    "prefill": [(21, 21), (40, 7)],
    "single": [(1, 1)],
    "empty": [],
}


def _batch(dk, dv, heads, block, bits, batch, seed=0):
    """A scattered paged cache written through the reference write_kv, and queries."""
    g = torch.Generator().manual_seed(seed)
    q_heads, kv_heads = heads
    spans = BATCHES[batch]
    num_blocks = 2 + sum(-(-ctx // block) for ctx, _ in spans)
    packed = kernels.packed_dim(dk, bits)
    dtype = torch.float64 if bits is None else torch.int8 if bits == 8 else torch.uint8
    k_cache = torch.zeros(num_blocks, block, kv_heads, packed, dtype=dtype)
    v_cache = None if dv is None else torch.zeros(num_blocks, block, kv_heads, kernels.packed_dim(dv, bits), dtype=dtype)
    k_scale = v_scale = centre = None
    if bits is not None:
        k_tail, k_dtype = kernels.scale_layout(dk, bits, zero_point=bits == 4)
        k_scale = torch.zeros(num_blocks, block, kv_heads, *k_tail, dtype=k_dtype)
        if dv is not None:
            v_tail, v_dtype = kernels.scale_layout(dv, bits)
            v_scale = torch.zeros(num_blocks, block, kv_heads, *v_tail, dtype=v_dtype)
        centre = torch.randn(kv_heads, dk, generator=g) if bits == 4 else None
    free = torch.randperm(num_blocks, generator=g).tolist()
    width = max([-(-ctx // block) for ctx, _ in spans], default=1)
    tables = torch.zeros(len(spans), width, dtype=torch.long)
    for s, (ctx, _) in enumerate(spans):
        table = [free.pop() for _ in range(-(-ctx // block))]
        tables[s, :len(table)] = torch.tensor(table)
        slots = torch.tensor([table[p // block] * block + p % block for p in range(ctx)])
        keys = torch.randn(ctx, kv_heads, dk, dtype=torch.float64, generator=g)
        kernels.write_kv(k_cache, k_scale, keys if bits is None else keys.float(), slots, bits, centre)
        if dv is not None:
            values = torch.randn(ctx, kv_heads, dv, dtype=torch.float64, generator=g)
            kernels.write_kv(v_cache, v_scale, values if bits is None else values.float(), slots, bits)
    query_start = [0]
    for _, q_len in spans:
        query_start.append(query_start[-1] + q_len)
    q = torch.randn(query_start[-1], q_heads, dk, dtype=torch.float64, generator=g)
    on_device = [t if t is None else t.to(DEVICE) for t in (q, k_cache, v_cache, k_scale, v_scale, tables)]
    return *on_device, query_start, [ctx for ctx, _ in spans]


def _spy(monkeypatch, module_name: str, function: str) -> list:
    """Records each call of a Triton module's function, so a test knows the kernel ran, not a fallback."""
    module, calls = triton_module(module_name), []
    original = getattr(module, function)
    monkeypatch.setattr(module, function, lambda *args, **kwargs: calls.append(function) or original(*args, **kwargs))
    return calls


@pytest.mark.parametrize("dk, dv, heads, block, bits, window, batch", CASES)
def test_paged_attention_matches_the_reference(backend, monkeypatch, dk, dv, heads, block, bits, window, batch):
    q, k_cache, v_cache, k_scale, v_scale, tables, query_start, context_lens = _batch(dk, dv, heads, block, bits, batch)
    v_head_dim = dv or 512

    def run():
        with torch.no_grad():
            return kernels.paged_attention(q, k_cache, v_cache, tables, query_start, context_lens, dk ** -0.5,
                                           sliding_window=window, k_scale=k_scale, v_scale=v_scale, kv_bits=bits,
                                           v_head_dim=v_head_dim)

    backend("reference")
    expected = run()
    backend("triton")
    calls = _spy(monkeypatch, "paged_attention", "paged_attention")
    out = run()
    assert calls or len(q) == 0
    assert out.shape == expected.shape == (len(q), heads[0], v_head_dim)
    tolerance = 1e-10 if bits is None else 1e-5  # quantised: the reference dequantises in float32
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dk, dv, heads, block, bits, window, batch",
                         [case for case in CASES if case[-1] in ("decode", "single")])
def test_decode_with_device_metadata_matches_the_ragged_step(backend, monkeypatch, dk, dv, heads, block, bits, window,
                                                             batch):
    """paged_decode (what decode graphs replay: tables and lengths on the device only, table rows padded)
    against paged_attention's reference, on the Triton kernel and on the reference path."""
    q, k_cache, v_cache, k_scale, v_scale, tables, query_start, context_lens = _batch(dk, dv, heads, block, bits, batch)
    v_head_dim = dv or 512
    options = dict(sliding_window=window, k_scale=k_scale, v_scale=v_scale, kv_bits=bits, v_head_dim=v_head_dim)
    padded = torch.cat((tables, torch.zeros_like(tables)), dim=1)  # graphs' tables are as wide as the longest context
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    backend("reference")
    with torch.no_grad():
        expected = kernels.paged_attention(q, k_cache, v_cache, tables, query_start, context_lens, dk ** -0.5,
                                           **options)
        reference = kernels.paged_decode(q, k_cache, v_cache, padded, lens, dk ** -0.5, **options)
        backend("triton")
        calls = _spy(monkeypatch, "paged_attention", "paged_attention")
        out = kernels.paged_decode(q, k_cache, v_cache, padded, lens, dk ** -0.5, **options)
    assert calls
    tolerance = 1e-10 if bits is None else 1e-5
    torch.testing.assert_close(reference, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("bits, dim, centred", [(None, 64, False), (8, 64, False), (8, 128, False), (4, 64, True),
                                                (4, 128, False), (8, 48, False)])
def test_kv_cache_write_quantises_like_the_reference(backend, monkeypatch, bits, dim, centred):
    g = torch.Generator().manual_seed(3)
    blocks, block, heads, tokens = 6, 16, 2, 19
    x = (torch.randn(tokens, heads, dim, generator=g) * 3).to(DEVICE)
    slots = torch.randperm(blocks * block, generator=g)[:tokens].to(DEVICE)
    centre = torch.randn(heads, dim, generator=g).to(DEVICE) if centred else None

    def write():
        dtype = torch.float32 if bits is None else torch.int8 if bits == 8 else torch.uint8
        cache = torch.zeros(blocks, block, heads, kernels.packed_dim(dim, bits), dtype=dtype, device=DEVICE)
        scales = None
        if bits is not None:
            tail, scale_dtype = kernels.scale_layout(dim, bits, zero_point=centred)
            scales = torch.zeros(blocks, block, heads, *tail, dtype=scale_dtype, device=DEVICE)
        with torch.no_grad():
            kernels.write_kv(cache, scales, x, slots, bits, centre)
        return cache, scales

    backend("reference")
    ref_cache, ref_scales = write()
    backend("triton")
    calls = _spy(monkeypatch, "kv_cache", "write_rows" if bits is None else "quantize_rows")
    cache, scales = write()
    assert calls or (bits and dim & (dim - 1))  # quantised head sizes other than powers of two: the reference
    if bits is None:
        torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
        return
    torch.testing.assert_close(scales.float(), ref_scales.float(), rtol=1e-5, atol=1e-6)
    codes, ref_codes = (c.view(-1, c.shape[-1]) for c in (cache, ref_cache))
    # The rotation sums in another order than the reference's matmul: a value on a rounding boundary may
    # land one code away, never more, and rarely.
    if bits == 4:
        codes, ref_codes = (torch.stack((c & 0xF, c >> 4), -1).flatten(-2) for c in (codes, ref_codes))
    gap = (codes.int() - ref_codes.int()).abs()
    assert gap.max() <= 1 and (gap > 0).float().mean() < 0.01


@pytest.mark.parametrize("scoring, experts, groups, topk_groups, top_k, bias, renormalize", [
    ("softmax", 8, 1, 1, 2, False, True),  # Mixtral / Qwen-MoE
    ("softmax", 12, 1, 1, 3, False, False),  # not a power of two
    ("sigmoid", 16, 4, 2, 4, True, True),  # DeepSeek-V3: bias for choosing, group-limited
    ("sigmoid", 16, 1, 1, 8, True, True),  # Kimi-K2: one group
])
def test_moe_routing(backend, monkeypatch, scoring, experts, groups, topk_groups, top_k, bias, renormalize):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, experts, generator=g).to(DEVICE)
    score_bias = (torch.randn(experts, generator=g) * 0.1).to(DEVICE) if bias else None
    args = (logits, top_k, scoring, score_bias, groups, topk_groups, renormalize, 2.5)
    backend("triton")
    calls = _spy(monkeypatch, "moe", "route_topk")
    with torch.no_grad():
        weights, ids = kernels.route_topk(*args)
    assert calls
    ref_weights, ref_ids = importlib.import_module("unified.kernels.moe").route_topk_reference(*args)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(weights.gather(1, ids.argsort(-1)), ref_weights.gather(1, ref_ids.argsort(-1)))


@pytest.mark.parametrize("tokens, experts, first, local, top_k", [(7, 4, 0, 4, 2), (19, 8, 2, 3, 3), (1, 4, 0, 4, 1),
                                                                 (0, 4, 0, 4, 2)])
def test_moe_experts_grouped_matmuls(backend, monkeypatch, tokens, experts, first, local, top_k):
    """Routed experts over expert-sorted rows; `first`/`local`: this rank's slice under expert parallelism."""
    g = torch.Generator().manual_seed(5)
    hidden, inter = 24, 40
    x = torch.randn(tokens, hidden, dtype=torch.float64, generator=g)
    gate_up = torch.randn(local, 2 * inter, hidden, dtype=torch.float64, generator=g) * 0.2
    down = torch.randn(local, hidden, inter, dtype=torch.float64, generator=g) * 0.2
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens \
        else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.rand(tokens, top_k, dtype=torch.float64, generator=g)
    x, gate_up, down, ids, weights = (t.to(DEVICE) for t in (x, gate_up, down, ids, weights))
    backend("triton")
    calls = _spy(monkeypatch, "moe", "experts")
    with torch.no_grad():
        out = kernels.moe_experts(x, gate_up, down, weights, ids, first, F.silu)
    assert calls
    expected = importlib.import_module("unified.kernels.moe").experts_reference(x, gate_up, down, weights, ids, first,
                                                                               F.silu)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
