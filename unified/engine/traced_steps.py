"""Small decode steps on CPU replayed from TorchScript traces: the CPU's counterpart of decode graphs.

At a few sequences a CPU decode step is largely host time: each layer makes a dozen calls through Python
(module calls, dispatch checks, views), which for small weights cost as much as the kernels they launch. So, as
decode graphs do on accelerators, the engine records the forward of a step of one-token decodes over static
buffers once per batch size, here with `torch.jit.trace`, whose interpreter then runs the same kernels with no
Python in between. Sizes 1 to MAX_TRACED_SEQS are traced exactly (padding would cost real compute on a CPU),
each once it has run RECORD_AFTER_STEPS steps. Bigger steps (their kernels outweigh the host's part, and
cascade decoding of shared prefixes runs eagerly) and steps with prefill chunks or speculative drafts run
eagerly, as everything does with engine.enforce_eager=true. The server records none (serve/async_engine.py):
a recording would stall every stream.

A trace replays the calls the Python made when it was recorded, so it holds only while nothing they depended on
changes:
- the step's metadata lives in the buffers (decode_graphs.py), which attention reads on the device alone;
- which copy of each weight the linears read: a repack, a copy gone stale against its weight, an adapter
  attached or switched, or a change of kernel backend drops the traces, which are recorded again (weights
  updated in place are read where they lie, as by decode graphs);
- the KV cache's tensors: their reallocation (sleep mode) changes the cache's generation, with the same effect.
A forward that reads a tensor's value on the host (MoE routing sizes each expert's batch so) or runs Python
hooks would be replayed with what it read or did when recorded: such models are not traced. Each trace is also
checked when recorded: recorded on one input and replayed on another, it must give the eager forward's hidden
states exactly, or that size stays eager; the check catches a host read that its input changes, which is why it
backs up the rules above rather than replacing them. Traces run unoptimised: the buffers, the cache and the
packed copies are constants of the trace, and the optimiser's constant propagation would fold every read of
them into the values they held at the first runs. What it may fold, the sizes the trace recorded (its one batch
size's), trace_specialization.py folds before the first replay.

`torch.jit.trace` is deprecated in favour of torch.compile, whose inductor backend compiles the decode forward
far more slowly and ran it no faster on CPU (bench/RESULTS.md); a torch without it decodes eagerly.
"""
from __future__ import annotations

import collections
import logging
import warnings

import torch

from unified.engine.decode_graphs import DecodeGraphs
from unified.engine.kv_cache import KVCache
from unified.engine.scheduler import ScheduledSeq
from unified.engine.trace_specialization import specialize
from unified.kernels import registry
from unified.model.forward_context import forward_context
from unified.model.parallel_layers import PackableLinear

log = logging.getLogger(__name__)

MAX_TRACED_SEQS = 32
# Steps of a size run eagerly before its trace is recorded (since the weights' copies last changed): recording
# costs as much as many steps, which a size seen in passing, as a batch drains, would never pay back.
RECORD_AFTER_STEPS = 16


def untraceable_reason(model) -> str | None:
    """Why this model's decode steps cannot be traced, or None."""
    config = model.config
    if any(config.is_moe_layer(i) for i in range(config.num_layers)):
        return "MoE routing sizes each expert's batch on the host"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "ZeRO-3 gathers the partitioned weights around each forward"
    return None


def _decision(linear: PackableLinear) -> tuple:
    """What a trace assumed of this linear: which packed copy it reads, whether that copy stands for the weight
    (and adapter) as they are now, which adapter it has and whether that is on. Read every step, so the weight
    comes from `_parameters` rather than through nn.Module's __getattr__, which costs more than the rest."""
    packed, lora = linear.packed, linear.lora
    if packed is None:
        current = False
    else:
        weight = linear._parameters.get("weight")
        try:
            current = packed.version == (linear.weight if weight is None else weight)._version
        except RuntimeError:  # an inference tensor keeps no version counter: it cannot have changed in place
            current = True
        if current and packed.adapter is not None and lora is not None:
            current = packed.adapter == linear._adapter_versions()
    return id(packed), current, id(lora), lora is not None and lora.active


def _hooked(model) -> bool:
    """Whether a module runs Python hooks around its forward, which a trace would run only once."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class _Body(torch.nn.Module):
    """The model's forward over a size's buffers, as the tracer records it (parameters as attributes)."""

    def __init__(self, model, steps: "TracedDecodeSteps", size: int):
        super().__init__()
        self.model, self.steps, self.size = model, steps, size
        # oneDNN's packed copies are opaque tensors, which a trace holds as a module's buffers, not as constants
        for i, linear in enumerate(steps.packables):
            if linear.packed is not None:
                self.register_buffer(f"packed{i}", linear.packed.tensor, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with forward_context(self.steps.context(self.size)):
            return self.model(ids, self.steps.positions[:, :self.size])


class TracedDecodeSteps(DecodeGraphs):
    def __init__(self, model, cache: KVCache, max_num_seqs: int, max_model_len: int, device: torch.device):
        super().__init__(model, cache, min(max_num_seqs, MAX_TRACED_SEQS), max_model_len, device, None)
        self.sizes = list(range(1, min(max_num_seqs, MAX_TRACED_SEQS) + 1))
        self.packables = [m for m in model.modules() if isinstance(m, PackableLinear)]
        self.traces: dict[int, torch.jit.ScriptModule] = {}
        self.eager_sizes: set[int] = set()  # sizes whose trace failed its check
        self.steps_seen: collections.Counter[int] = collections.Counter()
        self.record_after: int | None = RECORD_AFTER_STEPS  # None: record none (steps run eagerly)
        self.decisions = self._decisions()

    def takes(self, batch: list[ScheduledSeq]) -> bool:
        size = len(batch)
        return (size not in self.eager_sizes and (self.record_after is not None or size in self.traces)
                and super().takes(batch))

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], greedy: bool = False) -> torch.Tensor:
        """float32 logits [len(batch), V] (greedy: each row's most likely token), one row per sequence in
        batch order."""
        size = len(batch)
        decisions = self._decisions()
        if decisions != self.decisions or self.generation != self.cache.generation:
            self.clear()
            self.decisions, self.generation = decisions, self.cache.generation
        self.steps_seen[size] += 1
        if size not in self.traces and self.record_after is not None and self.steps_seen[size] >= self.record_after:
            self._record(size)
        self._fill(batch, size)
        trace = self.traces.get(size)
        if trace is None:
            hidden = self._hidden(size)
        else:
            with torch.jit.optimized_execution(False):
                hidden = trace(self.ids[:, :size])
        rows = hidden[0]
        return self.model.greedy_tokens(rows) if greedy else self.model.logits(rows).float()

    def _decisions(self) -> tuple:
        """What the forward decided in Python beside the step's buffers, which must still hold for a trace to
        replay it: which copy each linear reads (its packed copy, while current against the weight's and the
        adapter's versions, else the weight), its adapter and whether it is on; the kernel backend. The weights
        themselves a trace reads where they lie, so updates in place need no new trace."""
        return [_decision(m) for m in self.packables], registry.backend()

    def clear(self) -> None:
        self.traces.clear()
        self.eager_sizes.clear()
        self.steps_seen.clear()

    def _fill_check(self, size: int, salt: int) -> None:
        """A check input: rows that decode distinct tokens at distinct positions of the scratch block (which no
        sequence owns), varied by `salt`."""
        block_size, scratch, vocab = self.cache.block_size, self.cache.scratch_block, self.model.config.vocab_size
        for row in range(size):
            position = (row + 1 + salt) % block_size
            self.ids[0, row] = (7 * row + 3 + salt) % vocab
            self.positions[0, row] = position
            self.slots[row] = scratch * block_size + position
            self.lens[row] = position + 1
            self.tables[row].fill_(scratch)

    def _record(self, size: int) -> None:
        if _hooked(self.model):
            return self._stay_eager(size, "the model has forward hooks")
        body = _Body(self.model, self, size)
        self._fill_check(size, salt=0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                trace = torch.jit.trace(body, (self.ids[:, :size],), check_trace=False)
            specialize(trace)
        except Exception as error:  # noqa: BLE001 - any forward the tracer cannot record runs eagerly
            return self._stay_eager(size, f"the trace failed ({error})")
        self._fill_check(size, salt=1)
        want = self._hidden(size)
        with torch.jit.optimized_execution(False):
            got = trace(self.ids[:, :size])
        if not torch.equal(got, want):
            return self._stay_eager(size, "their trace does not replay the forward")
        self.traces[size] = trace

    def _stay_eager(self, size: int, why: str) -> None:
        log.info("decode steps of %d sequences run eagerly: %s", size, why)
        self.eager_sizes.add(size)
