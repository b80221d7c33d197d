"""Activation and workspace bytes per rank: the engine's largest step, or the trainer's micro-batch.

Both walk one decoder layer of this model the way our forward runs it and count the tensors alive at its peak,
in the compute dtype d unless said otherwise (T tokens, H hidden, tp tensor-parallel ranks, `_l` = this rank's
share of heads or widths):

Serving (no autograd: a layer's intermediates die as it goes): the residual and its normed copy, 2 T H, plus the
larger of the attention and MLP blocks' live tensors:
  GQA  qkv T qkv_l, attention output T heads_l D, o_proj output T H
  MLA  (the engine's latent path) q_a T q_lora, q T heads_l (nope + rope), q in latent space T heads_l kv_lora,
       q cat T heads_l (kv_lora + rope), kv_a T (kv_lora + rope), latent output T heads_l kv_lora, output T
       heads_l v, o_proj output T H
  MLP  T (3 I_l + H)
  MoE  router scores in float32 3 T E 4; with expert parallel ep every rank sees all ep T tokens (the
       all-gather exchange, unified/model/moe.py): gathered and summed [ep T, H] twice; the routed rows of this
       rank's experts R = ep T k (local / E) x plan.expert_load (1: balanced routing) take R (2 H + 3 Ie); plus
       the shared expert's MLP
then the step's logits: this rank's vocabulary slice and the gathered whole for every sampling row (up to
engine.max_num_seqs), and the sampler's float32 copy: rows (V_l + V) d + 2 rows V 4. A vision-language model
adds the engine's image cache (engine.image_cache_bytes).

Training keeps what backward needs. Per layer: the layer's input (T H, or T H / tp with sequence parallel), the
two norms' inputs and outputs, every linear's input (T H gathered under sequence parallel), the projections'
outputs that activation functions, rotary and attention save, the attention output and its log-sum-exp; MoE
layers the routed rows as above. Attention itself runs through flash or memory-efficient kernels and stores
no [S, S] scores, only the packed rows' boolean mask B S^2 once. With train.activation_checkpointing each layer
keeps only its input, and one layer's whole set lives again while it is recomputed. The loss adds the target
rows' logits: T V_l (d + 4 + 8) (the logits, their float32 copy unless already float32, the log-softmax
cross-entropy saves and the logits' gradient).
"""
from __future__ import annotations

from dataclasses import dataclass

from unified.model.config import ModelConfig


@dataclass(frozen=True)
class Shards:
    tp: int = 1
    ep: int = 1


def _attention_serve(c: ModelConfig, t: int, s: Shards) -> int:
    h = c.hidden_size
    if c.mla is None:
        qkv = (c.num_heads + 2 * max(c.num_kv_heads, s.tp)) * c.head_dim // s.tp
        return t * (qkv + c.num_heads // s.tp * c.head_dim + h)
    m, heads = c.mla, c.num_heads // s.tp
    latent = m.kv_lora_rank + m.qk_rope_head_dim
    return t * ((m.q_lora_rank or 0) + heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) + heads * m.kv_lora_rank
                + heads * latent + latent + heads * m.kv_lora_rank + heads * m.v_head_dim + h)


def _attention_train(c: ModelConfig, t: int, s: Shards) -> int:
    h = c.hidden_size
    if c.mla is None:
        qkv = (c.num_heads + 2 * max(c.num_kv_heads, s.tp)) * c.head_dim // s.tp
        return t * (h + 2 * qkv + c.num_heads // s.tp * c.head_dim)  # input, qkv, rotated q k with v, output
    m, heads = c.mla, c.num_heads // s.tp
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    return t * (h + 2 * (m.q_lora_rank or 0) + 2 * heads * qk + (m.kv_lora_rank + m.qk_rope_head_dim)
                + 2 * m.kv_lora_rank + heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * qk
                + heads * m.v_head_dim)


def _mlp(c: ModelConfig, layer: int, t: int, s: Shards, dtype_bytes: int, expert_load: float,
         training: bool) -> int:
    """Bytes of the MLP block's live (serving) or saved (training) tensors."""
    h, d = c.hidden_size, dtype_bytes
    if not c.is_moe_layer(layer):
        return t * (3 * c.intermediate_size // s.tp + h) * d
    moe = c.moe
    local = moe.num_experts // s.ep
    seen = s.ep * t  # tokens this rank's experts look at
    routed = int(seen * moe.top_k * local / moe.num_experts * expert_load)
    total = (2 if training else 3) * t * moe.num_experts * 4 + t * moe.top_k * 12  # scores; weights and ids
    if s.ep > 1:
        total += 2 * seen * h * d
    total += routed * (2 * h + 3 * moe.expert_intermediate_size) * d
    if moe.shared_intermediate_size:
        total += t * (3 * moe.shared_intermediate_size // s.tp + h) * d
    return total


def serve_step_bytes(c: ModelConfig, layers: range, tokens: int, rows: int, s: Shards, dtype_bytes: int,
                     expert_load: float, last_stage: bool, image_cache_bytes: int) -> int:
    d, h = dtype_bytes, c.hidden_size
    peak = 0
    for layer in _distinct(c, layers):
        block = max(_attention_serve(c, tokens, s) * d, _mlp(c, layer, tokens, s, d, expert_load, False))
        peak = max(peak, 2 * tokens * h * d + block)
    if last_stage:
        vocab_l = c.vocab_size // s.tp
        peak += rows * (vocab_l + c.vocab_size) * d + 2 * rows * c.vocab_size * 4
    return peak + (image_cache_bytes if c.vision is not None else 0)


def train_step_bytes(c: ModelConfig, layers: range, batch: int, seq_len: int, s: Shards, dtype_bytes: int,
                     expert_load: float, last_stage: bool, checkpointing: bool, sequence_parallel: bool) -> int:
    d, h, t = dtype_bytes, c.hidden_size, batch * seq_len
    h_sp = h // s.tp if sequence_parallel else h

    def layer_saved(layer: int) -> int:
        norms = 3 * t * h_sp  # the layer's input and the two norms' outputs (their inputs are those, or kept sums)
        return (norms + _attention_train(c, t, s)) * d + _mlp(c, layer, t, s, d, expert_load, True)

    distinct = _distinct(c, layers)
    if checkpointing:
        total = len(layers) * t * h_sp * d + max(layer_saved(layer) for layer in distinct)
    else:
        total = sum(layer_saved(layer) for layer in layers)
    total += batch * seq_len * seq_len  # the packed rows' attention mask (bool)
    if last_stage:
        total += t * (c.vocab_size // s.tp) * (d + (0 if d == 4 else 4) + 8)
    return total


def _distinct(c: ModelConfig, layers: range) -> list[int]:
    """One dense and one MoE layer of `layers` stand for all: layers of a kind are alike."""
    picked: dict[bool, int] = {}
    for layer in layers:
        picked.setdefault(c.is_moe_layer(layer), layer)
    return list(picked.values()) or [0]
