"""The decoder-only language model used by every path: training, serving, rollouts, parity checks.

forward(input_ids [B, S], positions [B, S] or [S]; M-RoPE models also [3, B, S]) -> final hidden states [B, S, H]; `logits()` maps
hidden states to vocabulary scores (a sequence classifier's `scores()` to one score vector per row instead).
`inputs_embeds` lets a vision front end hand in token embeddings with image features already merged at
the placeholder positions.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from torch import nn

from unified import kernels
from unified.errors import UserError
from unified.model.attention import GQAttention
from unified.model.config import ModelConfig
from unified.model.forward_context import recompute_contexts
from unified.model.mla import MLAttention
from unified.model.mlp import GatedMLP
from unified.model.moe import MoE
from unified.model.norm import RMSNorm
from unified.model.parallel_layers import ColumnLinear, PackableLinear, VocabEmbedding, gather_vocab, megatron_config
from unified.model.rope import RotaryEmbedding
from unified.model.score_head import ScoreHead
from unified.model import sequence_parallel
from unified.runtime import placement
from unified.runtime.comm import collective


@contextlib.contextmanager
def _entered(*managers: contextlib.AbstractContextManager):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = MLAttention(config, layer, dtype) if config.mla else GQAttention(config, layer, dtype)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = (MoE(config, dtype) if config.is_moe_layer(layer)
                    else GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, dtype))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        norm = self.post_attn_norm  # fused with the residual add before it (one kernel on accelerators)
        normed, x = kernels.add_rms_norm(self.attn(self.input_norm(x), rope, cos, sin), x, norm.weight, norm.eps)
        return x + self.mlp(normed)


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The contiguous run of layers pipeline stage `stage` of `stages` holds."""
    return range(stage * num_layers // stages, (stage + 1) * num_layers // stages)


def stage_holds(name: str, config: ModelConfig, rank: int, size: int) -> bool:
    """Whether pipeline stage `rank` of `size` builds our parameter `name`: the rule CausalLM and
    VisionLanguageModel follow below, for code that must know it without building the model (the
    pre-sharding converter)."""
    first, last = rank == 0, rank == size - 1
    top = name.split(".", 1)[0]
    if top == "layers":
        return int(name.split(".")[1]) in stage_layers(config.num_layers, size, rank)
    if top == "embed":
        return first or (last and config.tie_word_embeddings)
    if top == "vision":
        return first
    assert top in ("norm", "lm_head", "score"), f"no pipeline stage rule for {name}"
    return last


class PipelineStage:
    """This rank's place in the pipeline: its contiguous run of layers and its neighbours."""

    def __init__(self, num_layers: int):
        from megatron.core import parallel_state as ps

        group = placement.pipeline_group()
        self.size, self.rank = group.size(), group.rank()
        if self.size < 2:
            self.layers, self.first, self.last = range(num_layers), True, True
            return
        self.layers = stage_layers(num_layers, self.size, self.rank)
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        if placement.placed():  # built for inspection: no neighbours to talk to
            return
        self.group = group
        self.prev, self.next = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
        self.last_rank = ps.get_pipeline_model_parallel_last_rank()


class CausalLM(nn.Module):
    """Under pipeline parallelism a rank builds only its stage: its layers, the embedding on the first
    stage, the final norm and head on the last (and the embedding there too when the head is tied; a
    sequence classifier's head is its `score`, with no LM head).
    Forward passes the hidden states stage to stage; only the last stage returns the final hidden
    states (the others return their own stage's output), and `logits()` hands the last stage's logits to
    every stage, so callers of `logits(forward(...))` see the same result on every rank."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.stage = stage = PipelineStage(config.num_layers)
        mp = megatron_config(dtype)
        tied = config.tie_word_embeddings
        self.embed = VocabEmbedding(config.vocab_size, config.hidden_size, mp) if stage.first or (stage.last and tied) else None
        # A dict keyed by the global layer index keeps parameter names (layers.<i>.) the same on every stage.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i, dtype) for i in stage.layers})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if stage.last else None
        classifier = config.num_labels is not None
        self.lm_head = (ColumnLinear(config.hidden_size, config.vocab_size, mp)
                        if stage.last and not tied and not classifier else None)
        self.score = ScoreHead(config.hidden_size, config.num_labels, dtype) if stage.last and classifier else None
        self.tied_head_packed: kernels.PackedHead | None = None
        # What `pack_weights` makes for inference: weight-only "int8" or "int4" copies of the linears
        # (engine.quantization), the LM head's too with `quantize_head` (engine.quantize_lm_head)
        self.weight_quantization: str | None = None
        self.quantize_head = False
        # A quantized head's k best logits per row computed again from its full-precision weight (kernels.rescore_top;
        # engine.quantized_head_rescore); 0: off
        self.head_rescore = 0
        self.head_smoothing: torch.Tensor | None = None  # a tied head's PackableLinear.input_smoothing
        # Inputs per scale of the int4 checkpoint these weights were loaded from: int4 copies keep its groups,
        # and so its very values (kernels.quantize_int4). None: not from one.
        self.int4_group: int | None = None
        # The weights were loaded from a quantized checkpoint (dequantized): copies of them are plain, since
        # activation-aware factors would round them a second time (unified/model/calibration.py)
        self.quantized_source = False
        self.checkpoint_layers = False  # training: recompute each layer's activations in backward
        self.sequence_parallel = False  # training under tensor parallel: split the sequence between linears
        self.rope = RotaryEmbedding(config.rope_parameters, config.rope_head_dim, config.max_position_embeddings,
                                    interleaved=bool(config.mla and config.mla.rope_interleave),
                                    mrope_section=config.mrope_section)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                layer_outputs: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Returns final-norm hidden states; records this stage's layer outputs in `layer_outputs` if given."""
        stage = self.stage
        if stage.first:
            x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [B, S, H]
        else:
            shape = (*(input_ids.shape if inputs_embeds is None else inputs_embeds.shape[:2]), self.config.hidden_size)
            x = torch.empty(shape, dtype=self.dtype, device=positions.device)
            with collective("pp_send_recv", x):
                torch.distributed.recv(x, stage.prev)
        positions = self.rope.batched(positions, x.shape[0])
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        split = self.sequence_parallel and torch.is_grad_enabled() and self.embed.tp_group.size() > 1
        if split:
            x = sequence_parallel.scatter(x, self.embed.tp_group)  # [B, S/tp, H] until the final norm
        with sequence_parallel.region() if split else contextlib.nullcontext():
            x = self._layers(x, cos, sin, layer_outputs, split)
            if not stage.last:
                with collective("pp_send_recv", x):
                    torch.distributed.send(x.contiguous(), stage.next)
                return x
            x = self.norm(x)
        return sequence_parallel.gather(x, self.embed.tp_group, grad_is_partial=False) if split else x

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layer_outputs: dict[int, torch.Tensor] | None, split: bool) -> torch.Tensor:
        def recompute_in_the_same_contexts():
            forward, recompute = recompute_contexts()
            return forward, _entered(recompute, sequence_parallel.region() if split else contextlib.nullcontext())

        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for index, layer in self.layers.items():
            if recompute:
                x = torch.utils.checkpoint.checkpoint(layer, x, self.rope, cos, sin, use_reentrant=False,
                                                      context_fn=recompute_in_the_same_contexts)
            else:
                x = layer(x, self.rope, cos, sin)
            if layer_outputs is not None:
                layer_outputs[int(index)] = x
        return x

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def vocab_parallel_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V/tp]: this rank's slice of the vocabulary (for vocab-parallel cross-entropy)."""
        if self.lm_head is None:
            if self.embed.tp_group.size() > 1:  # backward: sum the ranks' gradients of `hidden`, as ColumnLinear does
                hidden = copy_to_tensor_model_parallel_region(hidden, group=self.embed.tp_group)
            if self.tied_head_packed is not None and self.tied_head_packed.serves(hidden, self.embed.weight):
                return kernels.head_logits(hidden, self.tied_head_packed, self.embed.weight, self.head_rescore)
            return kernels.linear(hidden, self.embed.weight)
        logits = self.lm_head(hidden)
        if self.head_rescore > 0 and self.lm_head.serves_quantized():
            logits = kernels.rescore_top(logits, hidden, self.lm_head.weight, self.head_rescore, self.lm_head.bias)
        return logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]: every rank (every tensor and pipeline stage) gets the whole vocabulary's logits."""
        out = gather_vocab(self.vocab_parallel_logits(hidden)) if self.stage.last else None
        return self._from_last_stage(out, (*hidden.shape[:-1], self.config.vocab_size), hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, H] -> each row's most likely token (the first maximum of `logits`), int64 [R] on every rank. With
        the tied head packed in vocabulary chunks (CPU inference) the whole logits are never written out."""
        head = self.tied_head_packed
        if (head is not None and self.stage.size == 1 and self.embed.tp_group.size() == 1
                and head.serves(hidden, self.embed.weight)):
            return kernels.head_argmax(hidden, head, self.embed.weight, self.head_rescore)
        return kernels.argmax_rows(self.logits(hidden))  # exact in any dtype: no upcast

    def scores(self, hidden: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's scores, on every rank: hidden [B, S, H], last [B] (the position each row
        is scored at: score_head.last_token_index) -> [B, num_labels]."""
        out = self.score(hidden, last) if self.stage.last else None
        return self._from_last_stage(out, (hidden.shape[0], self.config.num_labels), hidden)

    def _from_last_stage(self, out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's `out` on every stage; the other stages pass None and receive it."""
        stage = self.stage
        if not stage.last:
            out = like.new_empty(shape)
        if stage.size > 1:
            with collective("pp_logits_broadcast", out):
                torch.distributed.broadcast(out, stage.last_rank, group=stage.group)
        return out

    def pack_weights(self) -> None:
        """Attaches packed copies of the matmul weights for inference (kernels.pack_weight); a copy that
        the weights outgrow is ignored, so call again after changing them to get the speed back."""
        self.check_weight_quantization()
        for module in self.modules():
            if isinstance(module, PackableLinear):
                module.pack(self.weight_quantization if module is not self.lm_head or self.quantize_head else None,
                            self.int4_group)
        if self.config.tie_word_embeddings and self.stage.last:
            quantization = self.weight_quantization if self.quantize_head else None
            self.tied_head_packed = kernels.pack_head(self.embed.weight, quantization=quantization,
                                                      int4_group=self.int4_group,
                                                      smoothing=self.head_smoothing if quantization else None)

    def quantized_linears(self) -> list[tuple[str, PackableLinear]]:
        """The linears `pack_weights` quantizes (with `weight_quantization`): all, the LM head with `quantize_head`."""
        return [(name, module) for name, module in self.named_modules()
                if isinstance(module, PackableLinear) and (module is not self.lm_head or self.quantize_head)]

    def check_weight_quantization(self) -> None:
        """A clear error where `weight_quantization` cannot take this model: int4 packs two inputs to a byte, so
        every linear it quantizes needs an even number of inputs."""
        if self.weight_quantization != "int4":
            return
        packed = {name: module.weight for name, module in self.quantized_linears()}
        if self.config.tie_word_embeddings and self.stage.last and self.quantize_head:
            packed["lm_head (tied to embed)"] = self.embed.weight
        odd = next(((name, w.shape[-1]) for name, w in packed.items() if w.shape[-1] % 2), None)
        if odd is not None:
            raise UserError(f"engine.quantization=int4 packs two inputs to a byte, but {odd[0]} has {odd[1]} inputs; "
                            f"serve this model with engine.quantization=int8")

    def inference_tensors(self) -> list[torch.Tensor]:
        """Every tensor a forward reads: the parameters, the buffers and the copies `pack_weights` made."""
        packed = [m.packed for m in self.modules() if isinstance(m, PackableLinear) and m.packed is not None]
        if self.tied_head_packed is not None:
            packed.append(self.tied_head_packed)
        return [*self.parameters(), *self.buffers(), *(t for p in packed for t in p.tensors)]

    def unpack_weights(self) -> int:
        """Drops the packed copies `pack_weights` made; returns their bytes."""
        freed = 0
        for module in self.modules():
            if isinstance(module, PackableLinear) and module.packed is not None:
                freed += module.packed.nbytes
                module.packed = None
        if self.tied_head_packed is not None:
            freed += self.tied_head_packed.nbytes
            self.tied_head_packed = None
        return freed
