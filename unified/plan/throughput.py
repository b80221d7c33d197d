"""The throughput model the planner ranks layouts by. Deliberately simple, and stated so it can be checked:

Serving, a decode step of b sequences at the full context c (b: engine.max_num_seqs, or fewer if the KV cache
holds fewer), the pipeline stages one after another (the engine runs one batch at a time):
  stage time = max(bytes read / bandwidth, 2 x active parameters x b / peak FLOP/s) + communication
  bytes read = the rank's weights other than routed experts + the routed experts the step touches (each local
               expert is hit with probability 1 - (1 - k/E)^b) + the KV cache of b sequences at c tokens
  communication, per layer: tensor parallel 2 all-reduces of b H d bytes (ring: 2 (tp-1)/tp of it over the
               link); expert parallel the all-gather and the all-reduce of ep b H d bytes (tokens exchanged as
               unified/model/moe.py does); pipeline one send of b H d per stage boundary. The link is the
               cards' interconnect while the group fits in a node (tensor x expert, and for the pipeline's
               sends all the ranks, <= cards per node), the network otherwise. Latencies are left out.
  tokens/s = b / (sum of the stages' times)
Training, one micro-batch of T = micro_batch_size x seq_len tokens per data-parallel rank:
  time = 6 (8 with activation checkpointing) x trainable-or-frozen parameters on the rank x T / peak FLOP/s
         + tensor parallel 4 all-reduces per layer of T H d + the gradient all-reduce 2 T_params d / link
  tokens/s = data-parallel ranks x T / time
"""
from __future__ import annotations

from unified.model.config import ModelConfig
from unified.plan.hardware import HardwareConfig
from unified.plan.inventory import PROJECTION, RankTensor
from unified.runtime.layout import Layout


def _link(hw: HardwareConfig, group: int) -> float:
    return hw.interconnect_bytes_s if group <= hw.cards_per_node else hw.network_bytes_s


def _all_reduce_s(nbytes: float, ranks: int, link: float) -> float:
    return 0.0 if ranks < 2 else 2 * (ranks - 1) / ranks * nbytes / link


def _split(tensors: tuple[RankTensor, ...], bytes_of) -> tuple[int, int, int]:
    """(bytes of everything but routed experts, bytes of one layer's local routed experts, active parameters)."""
    dense = experts = active = 0
    for t in tensors:
        if t.kind == PROJECTION and len(t.shape) == 3:
            experts += bytes_of(t)
        else:
            dense += bytes_of(t)
            active += t.numel
    return dense, experts, active


def decode_tokens_per_s(config: ModelConfig, layout: Layout, stages: list[tuple[RankTensor, ...]], bytes_of,
                        kv_bytes_per_token: list[int], batch: int, context: int, dtype_bytes: int,
                        hw: HardwareConfig, fp8: bool) -> float:
    h, moe = config.hidden_size, config.moe
    link = _link(hw, layout.tensor * layout.expert)
    total = 0.0
    for stage, tensors in enumerate(stages):
        dense, experts, active = _split(tensors, bytes_of)
        moe_layers = sum(1 for t in tensors if t.name.endswith("experts.gate_up"))
        touched = 0.0
        if moe is not None and moe_layers:
            hit = 1 - (1 - moe.top_k / moe.num_experts) ** batch
            touched = experts * hit
            local = moe.num_experts // layout.expert
            active += moe_layers * min(local, moe.top_k) * 3 * h * moe.expert_intermediate_size
        read = dense + touched + batch * context * kv_bytes_per_token[stage]
        compute = 2 * active * batch / hw.flops(dtype_bytes, fp8)
        layers = sum(1 for t in tensors if t.name.endswith("input_norm.weight"))
        step = batch * h * dtype_bytes
        comm = layers * 2 * _all_reduce_s(step, layout.tensor, link)
        if layout.expert > 1:
            exchanged = layout.expert * step
            comm += moe_layers * ((layout.expert - 1) / layout.expert * exchanged / link
                                  + _all_reduce_s(exchanged, layout.expert, link))
        if stage < len(stages) - 1:
            comm += step / _link(hw, layout.tensor * layout.expert * layout.pipeline)
        total += max(read / hw.bandwidth_bytes_s, compute) + comm
    return batch / total if total > 0 else 0.0


def train_tokens_per_s(config: ModelConfig, layout: Layout, tensors: tuple[RankTensor, ...], cards: int,
                       tokens: int, dtype_bytes: int, checkpointing: bool, hw: HardwareConfig) -> float:
    params = sum(t.numel for t in tensors if not t.buffer)
    compute = (8 if checkpointing else 6) * params * tokens / hw.flops(dtype_bytes)
    link = _link(hw, layout.tensor)
    comm = config.num_layers * 4 * _all_reduce_s(tokens * config.hidden_size * dtype_bytes, layout.tensor, link)
    dp = layout.data(cards)
    comm += _all_reduce_s(params * dtype_bytes, dp, _link(hw, cards))
    return dp * tokens / (compute + comm)
