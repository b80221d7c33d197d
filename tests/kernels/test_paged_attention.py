"""kernels.paged_attention against attention computed directly on each sequence's own K/V (float64), on
both CPU decode paths: the C++ kernel that reads the cache in place and the plain-PyTorch gather + SDPA."""
import importlib
import os

import pytest
import torch

from unified import kernels
from unified.kernels import cpu_ops

# The module, not the function of the same name that unified.kernels exports.
paged_attention_module = importlib.import_module("unified.kernels.paged_attention")
cascade_module = importlib.import_module("unified.kernels.cascade")

BLOCK, BLOCKS, KV_HEADS, Q_HEADS, DIM = 4, 48, 2, 6, 8


def _cached_batch(context_lens: list[int], query_lens: list[int], dim_v: int | None, seed: int = 0):
    """Random K/V for every context token, written through write_kv into scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM)
    v_cache = None if dim_v is None else torch.zeros(BLOCKS, BLOCK, KV_HEADS, dim_v)
    free = torch.randperm(BLOCKS, generator=g).tolist()
    width = max(-(-n // BLOCK) for n in context_lens)
    tables = torch.zeros(len(context_lens), width, dtype=torch.long)
    keys, values = [], []
    for s, n in enumerate(context_lens):
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        tables[s, :len(table)] = torch.tensor(table)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        keys.append(torch.randn(n, KV_HEADS, DIM, generator=g))
        kernels.write_kv(k_cache, None, keys[-1], slots, None)
        if v_cache is not None:
            values.append(torch.randn(n, KV_HEADS, dim_v, generator=g))
            kernels.write_kv(v_cache, None, values[-1], slots, None)
        else:
            values.append(keys[-1])
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    q = torch.randn(query_start[-1], Q_HEADS, DIM, generator=g)
    return q, k_cache, v_cache, tables, query_start, keys, values


def _direct(q, keys, values, query_start, context_lens, scale, window, dim_v):
    out = []
    group = Q_HEADS // KV_HEADS
    for s, n in enumerate(context_lens):
        k = keys[s].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = values[s][..., :dim_v].double().repeat_interleave(group, dim=1)
        for row in range(query_start[s], query_start[s + 1]):
            pos = n - (query_start[s + 1] - row)
            seen = torch.arange(n)
            visible = (seen <= pos) & ((seen > pos - window) if window else True)
            scores = torch.einsum("hd,khd->hk", q[row].double(), k) * scale
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out.append(torch.einsum("hk,khd->hd", weights, v))
    return torch.stack(out).float()


CASES = {
    "decode": ([5, 1, 9, 16, 13], [1, 1, 1, 1, 1]),
    "prefill": ([7, 12], [7, 5]),
    "mixed": ([5, 1, 9, 13, 6], [1, 1, 4, 13, 1]),
}


@pytest.fixture(params=["cpu-kernel", "pytorch"], autouse=True)
def decode_path(request, monkeypatch):
    if request.param == "pytorch":
        monkeypatch.setattr(paged_attention_module, "_cpu_decode_kernel_applies", lambda *args: False)
    elif os.environ.get("UNIFIED_CPU_KERNELS") == "0":
        pytest.skip("UNIFIED_CPU_KERNELS=0")
    else:
        assert cpu_ops.available(), "the C++ CPU kernels failed to build; see the warning logged above"
    return request.param


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_direct_attention(case, window):
    context_lens, query_lens = CASES[case]
    q, k_cache, v_cache, tables, query_start, keys, values = _cached_batch(context_lens, query_lens, DIM)
    scale = DIM ** -0.5
    out = kernels.paged_attention(q, k_cache, v_cache, tables, query_start, context_lens, scale,
                                  sliding_window=window)
    expected = _direct(q, keys, values, query_start, context_lens, scale, window, DIM)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_latent_cache_reads_values_from_the_keys(case):
    """MLA: no value cache; the values are the first v_head_dim channels of the cached latent."""
    context_lens, query_lens = CASES[case]
    q, k_cache, _, tables, query_start, keys, values = _cached_batch(context_lens, query_lens, None)
    out = kernels.paged_attention(q, k_cache, None, tables, query_start, context_lens, 0.3, v_head_dim=5)
    torch.testing.assert_close(out, _direct(q, keys, values, query_start, context_lens, 0.3, None, 5),
                               atol=1e-5, rtol=1e-5)


def test_a_plan_built_once_serves_every_layer():
    context_lens, query_lens = CASES["mixed"]
    q, k_cache, v_cache, tables, query_start, _, _ = _cached_batch(context_lens, query_lens, DIM)
    plan = kernels.plan_paged_attention(tables, query_start, context_lens, BLOCK, sliding_window=3)
    assert plan.decode_seqs == [0, 1, 4] and [s for s, *_ in plan.prefills] == [2, 3]
    for layer_seed in range(3):  # other layers: other caches, same tables
        q, k_cache, v_cache, *_ = _cached_batch(context_lens, query_lens, DIM, seed=layer_seed)
        planned = kernels.paged_attention(q, k_cache, v_cache, tables, query_start, context_lens, 0.5,
                                          sliding_window=3, plan=plan)
        fresh = kernels.paged_attention(q, k_cache, v_cache, tables, query_start, context_lens, 0.5, sliding_window=3)
        assert torch.equal(planned, fresh)


@pytest.mark.parametrize("decode_path", ["cpu-kernel"], indirect=True)
@pytest.mark.parametrize("q_heads,kv_heads,dim", [(9, 3, 64), (8, 2, 44), (8, 4, 128)])
@pytest.mark.parametrize("lens", [[1, 17, 200, 63, 128], [33, 1, 90, 5, 64, 31, 16, 7, 120, 48, 2, 77], [70],
                                  [700, 3], [1]])
def test_decode_kernel_at_model_sizes_matches_the_reference(decode_path, q_heads, kv_heads, dim, lens):
    """SmolLM2-like heads (9 query heads on 3 KV heads, dim 64), Qwen3-like (8 on 4, dim 128) and a head size
    that is no whole number of vectors; 16-token blocks, lengths not block-aligned; batches of 1, 2, 5 and 12
    sequences (with few sequences the kernel splits each one's positions into parts, merged at the end)."""
    g = torch.Generator().manual_seed(1)
    block = 16
    width = -(-max(lens) // block)
    blocks = len(lens) * width + 10
    k_cache, v_cache = torch.randn(2, blocks, block, kv_heads, dim, generator=g).unbind(0)
    tables = torch.randperm(blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), q_heads, dim, generator=g)
    query_start = list(range(len(lens) + 1))
    assert paged_attention_module._cpu_decode_kernel_applies(q, k_cache, v_cache, None)
    for window in (None, 50, 300):
        kernel = kernels.paged_attention(q, k_cache, v_cache, tables, query_start, lens, 0.125, sliding_window=window)
        plan = kernels.plan_paged_attention(tables, query_start, lens, block, window)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(paged_attention_module, "_cpu_decode_kernel_applies", lambda *args: False)
            reference = kernels.paged_attention(q, k_cache, v_cache, tables, query_start, lens, 0.125, plan=plan)
        torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("decode_path", ["cpu-kernel"], indirect=True)
def test_decode_kernel_takes_an_empty_batch(decode_path):
    k_cache, v_cache = torch.randn(2, 4, 16, 2, 64).unbind(0)
    no_tables, no_lens = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    out = torch.ops.unified_cpu.paged_decode(torch.randn(0, 4, 64), k_cache, v_cache, no_tables, no_lens, 0.125, 0, 64)
    assert out.shape == (0, 4, 64)


def test_engine_caches_start_zeroed_without_committing_their_pages():
    """Decodes read whole blocks (masked past each sequence's end), so never-written slots must be finite."""
    from unified.engine.kv_cache import zeroed

    def rss_mb():
        return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024

    before = rss_mb()
    cache = zeroed((2048, 16, 8, 1024), torch.float32, torch.device("cpu"))  # 1 GiB
    assert rss_mb() - before < 64  # committed as written, like torch.empty
    assert cache.data_ptr() % 64 == 0 and cache.is_contiguous()
    assert not cache[::97].any() and not cache[-1].any()
    for dtype in (torch.bfloat16, torch.uint8, torch.int8, torch.float16):
        assert not zeroed((3, 16, 2, 5), dtype, torch.device("cpu")).any()


@pytest.mark.parametrize("decode_path", ["cpu-kernel"], indirect=True)
@pytest.mark.parametrize("q_heads,kv_heads,dim,dim_v,window", [
    (8, 2, 64, 64, None),  # Llama-like GQA
    (8, 4, 128, 128, 40),  # Qwen3-like, sliding window
    (10, 2, 48, 48, None),  # a group of 5 (tiles of 60 rows)
    (4, 1, 80, 64, None),  # MLA-like: no value cache, values the first 64 channels of the keys
])
def test_prefill_kernel_at_model_sizes_matches_the_reference(decode_path, q_heads, kv_heads, dim, dim_v, window):
    """Chunks from scratch and over a cached prefix, lengths not tile- or block-aligned, beside decodes; the C++
    prefill kernel against the plain-PyTorch gather + SDPA."""
    if not hasattr(torch.ops.unified_cpu, "paged_prefill_"):
        pytest.skip("the prefill kernel is built for AVX-512 machines")
    g = torch.Generator().manual_seed(2)
    block, lens, query_lens = 16, [150, 1, 300, 77, 40], [150, 1, 97, 1, 33]
    width = -(-max(lens) // block)
    k_cache = torch.randn(120, block, kv_heads, dim, generator=g)
    v_cache = None if dim_v != dim else torch.randn(120, block, kv_heads, dim_v, generator=g)
    tables = torch.randperm(120, generator=g)[:len(lens) * width].view(len(lens), width)
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    q = torch.randn(query_start[-1], q_heads, dim, generator=g)
    assert paged_attention_module._cpu_prefill_kernel_applies(q, k_cache, v_cache, None, dim_v)
    kernel = kernels.paged_attention(q, k_cache, v_cache, tables, query_start, lens, 0.1, sliding_window=window,
                                     v_head_dim=dim_v)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_attention_module, "_cpu_decode_kernel_applies", lambda *args: False)
        reference = kernels.paged_attention(q, k_cache, v_cache, tables, query_start, lens, 0.1,
                                            sliding_window=window, v_head_dim=dim_v)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("decode_path", ["cpu-kernel"], indirect=True)
@pytest.mark.parametrize("q_heads,kv_heads,dim,dim_v", [(8, 2, 64, 64), (8, 4, 128, 128), (4, 1, 80, 64)])
def test_decodes_sharing_prefix_blocks_attend_to_them_together(decode_path, q_heads, kv_heads, dim, dim_v):
    """Two groups behind shared prefixes (one shared in part: its members' tables part after 6 blocks), a
    sequence on its own and a prefill chunk: the cascade plan groups the first two, and the output matches the
    plain-PyTorch path."""
    if not hasattr(torch.ops.unified_cpu, "paged_decode_cascade"):
        pytest.skip("the cascade kernels are built for AVX-512 machines")
    g = torch.Generator().manual_seed(3)
    block = 16
    lens = [150, 201, 160, 333, 130, 128, 120, 60]
    query_lens = [1, 1, 1, 1, 1, 1, 1, 30]
    width = -(-max(lens) // block)
    k_cache = torch.randn(200, block, kv_heads, dim, generator=g)
    v_cache = None if dim_v != dim else torch.randn(200, block, kv_heads, dim_v, generator=g)
    tables = torch.randperm(200, generator=g)[:len(lens) * width].view(len(lens), width).clone()
    tables[1:4, :9] = tables[0, :9]  # sequences 0-3 share 9 blocks (144 tokens)
    tables[5, :6] = tables[4, :6]  # 4-6 share 6 blocks; 6 shares 7 with 4
    tables[6, :7] = tables[4, :7]
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    q = torch.randn(query_start[-1], q_heads, dim, generator=g)
    with pytest.MonkeyPatch.context() as patch:  # group 4-6 saves fewer reads than worth it at model sizes
        patch.setattr(cascade_module, "MIN_SAVED_TOKENS", 128)
        plan = kernels.plan_paged_attention(tables, query_start, lens, block)
    assert plan.cascade is not None
    assert plan.cascade.skips.tolist() == [144, 144, 144, 144, 96, 96, 96]
    kernel = kernels.paged_attention(q, k_cache, v_cache, tables, query_start, lens, 0.1, v_head_dim=dim_v, plan=plan)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_attention_module, "_cpu_decode_kernel_applies", lambda *args: False)
        reference = kernels.paged_attention(q, k_cache, v_cache, tables, query_start, lens, 0.1, v_head_dim=dim_v)
    torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=1e-5)
