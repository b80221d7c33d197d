"""The plan: for a model, hardware and number of cards, which layouts fit, how fast each would run, and
what is missing when none does.

`plan_for(cfg, hardware)` evaluates the run's own layout (parallel.*, engine.kv_cache_dtype) and searches the
others: tensor, pipeline and expert parallel sizes that divide the cards and pass unified/runtime/layout.py's
rules, and, serving, every KV-cache dtype. Serving uses every rank for distinct weights (data parallel =
expert parallel: the engine runs one batch on all ranks, so further data-parallel ranks would only repeat
it); training runs tensor and data parallel only (the trainer has no pipeline or expert parallelism yet). A
layout fits when every rank's bytes fit its card and, serving, the KV cache holds at least one sequence of the
full context. Feasible layouts are ranked by unified/plan/throughput.py's model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from unified.errors import UserError
from unified.model.config import ModelConfig
from unified.plan.hardware import HardwareConfig, load_hardware
from unified.plan.rank_memory import (DTYPES, Setting, kv_bytes_per_token, serve_breakdowns, stage_tensors,
                                      train_breakdown)
from unified.plan.throughput import decode_tokens_per_s, train_tokens_per_s
from unified.plan.weight_bytes import packed_rows_multiple, stored_bytes
from unified.runtime.layout import Layout, divisors, layout_problems
from unified.train.engine import check_train_config

KV_DTYPES = ("auto", "int8", "int4")
MODES = ("serve", "train")
MAX_CARDS = 16384


@dataclass
class LayoutPlan:
    layout: Layout
    kv_cache_dtype: str  # serving; "-" when training
    ranks: list[dict[str, int]]  # bytes per component of one rank of each pipeline stage
    host: dict[str, int]  # training: what offload keeps in host memory per rank
    budget: int  # bytes a rank may hold
    kv_tokens: int  # tokens the KV cache holds (serving)
    sequences: int  # sequences of the full context that run at once (serving), or rows per micro-batch
    tokens_per_s: float
    problems: list[str] = field(default_factory=list)  # broken layout rules: the layout cannot run at all

    @property
    def peak(self) -> int:
        return max(sum(parts.values()) for parts in self.ranks) if self.ranks else 0

    @property
    def short(self) -> int:
        """Bytes the fullest rank lacks (0: it fits)."""
        return max(0, self.peak - self.budget)

    @property
    def fits(self) -> bool:
        return not self.problems and self.short == 0 and self.sequences >= 1

    @property
    def breakdown(self) -> dict[str, int]:
        """The fullest rank's bytes per component."""
        return max(self.ranks, key=lambda parts: sum(parts.values())) if self.ranks else {}

    @property
    def overrides(self) -> str:
        text = (f"parallel.tensor={self.layout.tensor} parallel.pipeline={self.layout.pipeline} "
                f"parallel.expert={self.layout.expert}")
        return text + (f" engine.kv_cache_dtype={self.kv_cache_dtype}" if self.kv_cache_dtype != "-" else "")


@dataclass
class Plan:
    model: str
    config: ModelConfig
    hardware: HardwareConfig
    cards: int
    mode: str
    context: int
    setting: Setting
    requested: LayoutPlan  # the run's own layout
    feasible: list[LayoutPlan]  # best first
    fixes: list[str] = field(default_factory=list)  # paste-ready overrides, nearest first (when nothing fits)

    @property
    def fits(self) -> bool:
        return self.requested.fits or bool(self.feasible)

    @property
    def breakdown(self) -> dict[str, int]:
        """Per-rank bytes of the layout the run asked for."""
        return self.requested.breakdown


def setting_for(cfg, hardware: HardwareConfig, context: int | None = None) -> Setting:
    p = cfg.plan
    if p.mode not in MODES:
        raise UserError(f"plan.mode={p.mode!r}; choose serve or train")
    if not 1 <= p.cards <= MAX_CARDS:
        raise UserError(f"plan.cards={p.cards}: plan for 1 to {MAX_CARDS} cards")
    dtype_name = cfg.device.dtype if cfg.device.dtype != "auto" else (
        "float32" if hardware.kind == "cpu" else "bfloat16")
    if dtype_name not in DTYPES:
        raise UserError(f"device.dtype={dtype_name!r}; choose auto, {', '.join(DTYPES)}")
    if p.mode == "train":
        check_train_config(cfg.train)
    if p.mode == "train" and p.weights != "auto":
        raise UserError(f"plan.weights={p.weights} plans quantized weights for serving; training holds them in the "
                        f"compute dtype: use plan.weights=auto with plan.mode=train")
    cpu = hardware.kind == "cpu"
    budget = hardware.memory_bytes // p.cards if cpu else hardware.memory_bytes
    head_chunk, panel = 0, 1
    if cpu:
        from unified.kernels.linear import head_chunk_size

        head_chunk, panel = head_chunk_size(), packed_rows_multiple()
    return Setting(p.mode, DTYPES[dtype_name], p.weights, context or 0, budget, hardware.reserve_bytes, cpu,
                   p.expert_load, cfg.engine, cfg.train, head_chunk, panel)


def default_context(cfg, config: ModelConfig) -> int:
    """plan.context, else the run's own: train.seq_len (train), engine.max_model_len or the model's maximum."""
    for key, value in (("plan.context", cfg.plan.context), ("engine.max_model_len", cfg.engine.max_model_len)):
        if value is not None and value < 1:
            raise UserError(f"{key}={value}: give a positive number of tokens, or leave it unset (null)")
    if cfg.plan.context:
        return cfg.plan.context
    if cfg.plan.mode == "train":
        return cfg.train.seq_len
    return cfg.engine.max_model_len or config.max_position_embeddings


def evaluate(config: ModelConfig, layout: Layout, kv_dtype: str, cards: int, s: Setting,
             hw: HardwareConfig) -> LayoutPlan:
    problems = layout_problems(layout, cards, config)
    if s.mode == "train":
        if layout.pipeline > 1 or layout.expert > 1:
            problems.append("the trainer has no pipeline or expert parallelism yet")
        if problems:
            return LayoutPlan(layout, "-", [], {}, s.budget, 0, 0, 0.0, problems)
        device, host = train_breakdown(config, layout, cards, s)
        t = s.train
        tensors = stage_tensors(config, layout, 0)
        speed = train_tokens_per_s(config, layout, tensors, cards, t.micro_batch_size * s.context, s.dtype.itemsize,
                                   t.activation_checkpointing, hw)
        return LayoutPlan(layout, "-", [device], host, s.budget, 0, t.micro_batch_size, speed, problems)
    if problems:
        return LayoutPlan(layout, kv_dtype, [], {}, s.budget, 0, 0, 0.0, problems)
    ranks, blocks = serve_breakdowns(config, layout, kv_dtype, s)
    kv_tokens = blocks * s.engine.block_size
    sequences = min(kv_tokens // s.context, s.engine.max_num_seqs) if s.context else 0
    speed = 0.0
    if sequences:
        stages = [stage_tensors(config, layout, st) for st in range(layout.pipeline)]
        per_token = [kv_bytes_per_token(config, layout, st, s.dtype, kv_dtype) for st in range(layout.pipeline)]
        speed = decode_tokens_per_s(config, layout, stages, _bytes_of(s), per_token, sequences, s.context,
                                    s.dtype.itemsize, hw, s.weights == "fp8")
    return LayoutPlan(layout, kv_dtype, ranks, {}, s.budget, kv_tokens, sequences, speed, problems)


def _bytes_of(s: Setting):
    def bytes_of(t) -> int:
        if s.weights != "auto" and t.kind == "projection":
            return sum(stored_bytes(t, s.weights))
        return t.numel * (4 if t.float32 else s.dtype.itemsize)
    return bytes_of


def candidates(cards: int, mode: str, kv_dtype: str, moe: bool) -> list[tuple[Layout, str]]:
    sizes = divisors(cards)
    out = []
    for tp in sizes:
        for pp in sizes:
            if cards % (tp * pp):
                continue
            dp = cards // (tp * pp)
            if mode == "train":
                if pp == 1:
                    out.append((Layout(tp, 1, 1), "-"))
                continue
            # a dense model's data-parallel ranks repeat its weights; a MoE's may split the experts, or some of them
            for ep in (divisors(dp) if moe else [1]):
                out += [(Layout(tp, pp, ep), kv) for kv in KV_DTYPES]
    if mode == "serve":
        out = sorted(out, key=lambda c: c[1] != kv_dtype)  # the requested KV dtype first among equals
    return out


def search(config: ModelConfig, cards: int, s: Setting, hw: HardwareConfig, kv_dtype: str,
           skip: LayoutPlan | None = None) -> list[LayoutPlan]:
    plans = [evaluate(config, layout, kv, cards, s, hw)
             for layout, kv in candidates(cards, s.mode, kv_dtype, config.moe is not None)
             if skip is None or (layout, kv) != (skip.layout, skip.kv_cache_dtype)]
    feasible = [p for p in plans if p.fits]
    return sorted(feasible, key=lambda p: (-p.tokens_per_s, p.peak))


def plan_for(cfg, hardware: HardwareConfig | None = None, config: ModelConfig | None = None) -> Plan:
    """The plan for run config `cfg` (its model=, plan.*, parallel.*, engine.*, train.*, device.dtype) on
    `hardware` (default: plan.hardware's file) and `config` (default: model='s configuration, read without
    weights)."""
    from unified.checkpoint.shipped import model_config_of

    hw = hardware or load_hardware(cfg.plan.hardware)
    config = config or model_config_of(cfg.model)
    context = default_context(cfg, config)
    s = setting_for(cfg, hw, context)
    cards = cfg.plan.cards
    kv = "-" if s.mode == "train" else cfg.engine.kv_cache_dtype
    layout = Layout(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.expert)
    requested = evaluate(config, layout, kv, cards, s, hw)
    feasible = search(config, cards, s, hw, kv)
    plan = Plan(cfg.model, config, hw, cards, s.mode, context, s, requested, feasible[:max(cfg.plan.top, 1)])
    if not requested.fits:
        from unified.plan.fixes import nearest_fixes

        plan.fixes = nearest_fixes(cfg, plan)
    return plan

