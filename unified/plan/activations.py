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
then the step's logits: this rank's vocabulary slice and, under tensor parallel, the gathered whole for every
sampling row (up to engine.max_num_seqs), and the sampler's float32 copy: rows (V_l + V [tp > 1]) d + 2 rows V 4. A vision-language model
adds the engine's image cache (engine.image_cache_bytes).

Training keeps what backward needs, as autograd saves it in our forward (counted tensor by tensor with
torch.autograd.graph.saved_tensors_hooks on SmolLM2: 12,138 values per token and layer, this count to the value).
Per layer: the layer's input, the residual between its blocks and the two norms' outputs, 4 T H (under sequence
parallel 4 T H / tp, plus the column-parallel linears' gathered inputs 2 T H); GQA attention the projection's
output T qkv_l (v is a view of it), q and k rotated together T (heads_l + kv_l) D, the attention kernel's own
copy of q, its output and o_proj's input, 3 T heads_l D, and the float32 log-sum-exp T heads_l 4; the dense MLP
the gate/up output, the activation and the product, 4 T I_l; MoE layers the routed rows as above. Attention
runs through flash or memory-efficient kernels and stores no [S, S] scores; packed rows (train.packing, where a
row may hold several examples) add their boolean mask B S^2 once and, per layer, the additive mask that
scaled_dot_product_attention makes of it in the compute dtype, B S^2 d (on its CPU kernel). With
train.activation_checkpointing each layer keeps only its input, and one layer's whole set lives again while it
is recomputed. The last stage adds the final norm's input and output 2 T H, and the loss the target rows'
logits: T V_l (d + 4 + 8) (the logits, their float32 copy unless already float32, and in backward the
log-softmax's saved output with its gradient and the logits' gradient); every token is counted as a target
(rows full of targets: the plan cannot know how much of other data is prompt or padding). MLA training is
counted from its projections as the docstring of `_attention_train` says, not yet checked tensor by tensor.
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
    """Values per layer that attention saves for backward, besides its input (counted with the norms)."""
    if c.mla is None:
        kv = max(c.num_kv_heads, s.tp) // s.tp
        heads = c.num_heads // s.tp
        qkv = (heads + 2 * kv) * c.head_dim
        return t * (qkv + (heads + kv) * c.head_dim + 3 * heads * c.head_dim + heads)  # + log-sum-exp (float32)
    m, heads = c.mla, c.num_heads // s.tp
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    return t * (2 * (m.q_lora_rank or 0) + 2 * heads * qk + (m.kv_lora_rank + m.qk_rope_head_dim)
                + 2 * m.kv_lora_rank + heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * qk
                + heads * m.v_head_dim)


def _mlp(c: ModelConfig, layer: int, t: int, s: Shards, dtype_bytes: int, expert_load: float,
         training: bool) -> int:
    """Bytes of the MLP block's live (serving) or saved (training) tensors."""
    h, d = c.hidden_size, dtype_bytes
    if not c.is_moe_layer(layer):  # training: gate/up, activation, product; serving: gate/up, product, output
        return t * (4 * c.intermediate_size // s.tp if training else 3 * c.intermediate_size // s.tp + h) * d
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
        gathered = c.vocab_size if s.tp > 1 else 0
        peak += rows * (vocab_l + gathered) * d + 2 * rows * c.vocab_size * 4
    return peak + (image_cache_bytes if c.vision is not None else 0)


def train_step_bytes(c: ModelConfig, layers: range, batch: int, seq_len: int, s: Shards, dtype_bytes: int,
                     expert_load: float, last_stage: bool, checkpointing: bool, sequence_parallel: bool,
                     packed: bool = True) -> int:
    d, h, t = dtype_bytes, c.hidden_size, batch * seq_len
    h_sp = h // s.tp if sequence_parallel else h
    masks = batch * seq_len * seq_len * d if packed else 0  # the additive mask each layer's attention keeps

    def layer_saved(layer: int) -> int:
        residuals = 4 * t * h_sp + (2 * t * h if sequence_parallel else 0)
        return (residuals + _attention_train(c, t, s)) * d + masks + _mlp(c, layer, t, s, d, expert_load, True)

    distinct = _distinct(c, layers)
    if checkpointing:
        total = len(layers) * t * h_sp * d + max(layer_saved(layer) for layer in distinct)
    else:
        total = sum(layer_saved(layer) for layer in layers)
    total += batch * seq_len * seq_len if packed else 0  # the packed rows' boolean mask
    if last_stage:
        total += 2 * t * h * d + t * (c.vocab_size // s.tp) * (d + (0 if d == 4 else 4) + 8)
    return total


def _distinct(c: ModelConfig, layers: range) -> list[int]:
    """One dense and one MoE layer of `layers` stand for all: layers of a kind are alike."""
    picked: dict[bool, int] = {}
    for layer in layers:
        picked.setdefault(c.is_moe_layer(layer), layer)
    return list(picked.values()) or [0]
