"""MoE routing and grouped expert matmuls (Triton; references: unified/kernels/moe.py).

Routing: one program per token over all its experts' logits: softmax or sigmoid scores, the correction bias
for choosing only, group-limited choice (groups ranked by their top-2 sum), top-k by repeated argmax,
renormalisation and scaling. Experts: the (token, pick) pairs that fall on this rank's experts are sorted by
expert with torch (on the device, no host sync) into segments padded to BLOCK_M rows, so that every tile of
rows belongs to one expert; the gate-up matmul gathers each row's token as it loads, SiLU-and-mul runs on
the sorted rows, and the down matmul adds weight * result into the token's float32 output row atomically.
"""
import torch
import triton
import triton.language as tl

from unified.kernels.sources import triton_module

BLOCK_M = 16


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, scaling,
                  E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, SOFTMAX: tl.constexpr,
                  HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                  RENORMALIZE: tl.constexpr):
    token = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    valid = e < num_experts
    logit = tl.load(logits_ptr + token * num_experts + e, mask=valid, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        p = tl.exp(logit - tl.max(logit, axis=0))
        scores = p / tl.sum(p, axis=0)
    else:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-logit)), 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPS > 1:
        grouped = tl.reshape(choice, (GROUPS, E_PAD // GROUPS))
        column = tl.arange(0, E_PAD // GROUPS)
        best = tl.argmax(grouped, axis=1)
        second = tl.max(tl.where(column[None, :] == best[:, None], float("-inf"), grouped), axis=1)
        group_score = tl.max(grouped, axis=1) + second
        g = tl.arange(0, GROUPS)
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUPS):
            pick = tl.argmax(tl.where(keep, float("-inf"), group_score), axis=0)
            keep = keep | (g == pick)
        choice = tl.reshape(tl.where(keep[:, None], grouped, float("-inf")), (E_PAD,))
    k = tl.arange(0, K_PAD)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.argmax(choice, axis=0)
        ids = tl.where(k == j, best, ids)
        weights = tl.where(k == j, tl.sum(tl.where(e == best, scores, 0.0), axis=0), weights)
        choice = tl.where(e == best, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(ids_ptr + token * K + k, ids, mask=k < K)
    tl.store(weights_ptr + token * K + k, weights * scaling, mask=k < K)


def routing_applies(logits: torch.Tensor, scoring: str, num_groups: int) -> bool:
    experts = logits.shape[-1]
    return scoring in ("softmax", "sigmoid") and (num_groups == 1 or (
        experts & (experts - 1) == 0 and num_groups & (num_groups - 1) == 0 and experts // num_groups >= 2))


def route_topk(logits, top_k, scoring, bias, num_groups, topk_groups, renormalize, scaling):
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits.contiguous(), bias if bias is not None else logits, weights, ids, experts,
                                 float(scaling), E_PAD=triton.next_power_of_2(experts), K=top_k,
                                 K_PAD=triton.next_power_of_2(top_k), SOFTMAX=scoring == "softmax",
                                 HAS_BIAS=bias is not None, GROUPS=num_groups, TOPK_GROUPS=topk_groups,
                                 RENORMALIZE=renormalize)
    return weights, ids


@triton.jit
def _grouped_matmul_kernel(a_ptr, b_ptr, out_ptr, slot_token_ptr, slot_weight_ptr, tile_expert_ptr, num_experts,
                           n, k, GATHERED: tl.constexpr, SCATTER: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr):
    """out[rows] = A[rows] @ B[e].T for one tile of rows (all expert e's), or with SCATTER
    out[token(row)] += weight(row) * (A[row] @ B[e].T). A's rows are tokens when gathered, else slots."""
    tile, col = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= num_experts:
        return
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = tl.load(slot_token_ptr + slots)
    used = token >= 0
    a_rows = token if GATHERED else slots
    cols = col * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * k + kk[None, :], mask=used[:, None] & (kk[None, :] < k), other=0.0)
        b = tl.load(b_ptr + expert * n * k + cols[None, :] * k + kk[:, None],
                    mask=(cols[None, :] < n) & (kk[:, None] < k), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee").to(acc.dtype)
    if SCATTER:
        weight = tl.load(slot_weight_ptr + slots, mask=used, other=0.0)
        tl.atomic_add(out_ptr + token[:, None] * n + cols[None, :], acc * weight[:, None],
                      mask=used[:, None] & (cols[None, :] < n))
    else:
        tl.store(out_ptr + slots[:, None] * n + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=used[:, None] & (cols[None, :] < n))


def _sort_by_expert(ids: torch.Tensor, weights: torch.Tensor, first: int, num_local: int):
    """Slots: this rank's (token, pick) pairs in expert order, each expert's run padded to BLOCK_M; returns the
    token of each slot (-1: padding), its weight, and the expert of each tile (num_local: an empty tile)."""
    tokens, top_k = ids.shape
    device = ids.device
    local = ids.flatten() - first
    mine = (local >= 0) & (local < num_local)
    key = torch.where(mine, local, num_local)  # others' picks sort last and are dropped
    order = key.argsort(stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_local] + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts[:num_local], 0) - counts[:num_local]
    capacity = tokens * top_k + num_local * (BLOCK_M - 1)  # the most slots any routing needs
    capacity = (capacity + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    sorted_key = key[order]
    kept = sorted_key < num_local
    expert_of = sorted_key.clamp(max=num_local - 1)
    position = padded_start[expert_of] + torch.arange(order.numel(), device=device) - start[expert_of]
    position = torch.where(kept, position, capacity)  # dropped pairs go to a spill slot past the end
    slot_token = torch.full((capacity + 1,), -1, dtype=torch.int64, device=device)
    slot_weight = torch.zeros(capacity + 1, dtype=weights.dtype, device=device)
    slot_token.scatter_(0, position, torch.where(kept, order // top_k, -1))
    slot_weight.scatter_(0, position, weights.flatten()[order])
    tile_start = torch.arange(0, capacity, BLOCK_M, device=device)
    tile_expert = torch.searchsorted(torch.cumsum(padded, 0), tile_start, right=True)
    return slot_token[:capacity], slot_weight[:capacity], tile_expert, capacity


def experts_applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    return x.dim() == 2 and gate_up.is_contiguous() and down.is_contiguous()


def experts(x, gate_up, down, weights, ids, first):
    num_local, two_inter, hidden = gate_up.shape
    # Summed in float32 (float64 for float64 inputs): atomic adds of bf16 are not portable.
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
                      device=x.device)
    if x.shape[0] == 0:
        return out.to(x.dtype)
    slot_token, slot_weight, tile_expert, capacity = _sort_by_expert(ids, weights, first, num_local)
    x = x.contiguous()
    tiles = capacity // BLOCK_M
    block_k = 32

    def matmul(a, b, result, n, k, gathered, scatter):
        block_n = min(64, triton.next_power_of_2(n))
        _grouped_matmul_kernel[(tiles, triton.cdiv(n, block_n))](
            a, b, result, slot_token, slot_weight, tile_expert, num_local, n, k, GATHERED=gathered,
            SCATTER=scatter, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
            ACC=tl.float64 if x.dtype == torch.float64 else tl.float32)

    up = x.new_zeros(capacity, two_inter)  # padding rows stay finite through the activation
    matmul(x, gate_up, up, two_inter, hidden, True, False)
    hidden_rows = triton_module("activation").silu_and_mul(up)  # [capacity, I]
    matmul(hidden_rows, down, out, hidden, two_inter // 2, False, True)
    return out.to(x.dtype)
