"""Parallel layouts and the rules that make one possible for a given world and model.

megatron-core's rules: world = TP x PP x DP (context parallel is 1 here), and expert parallel is carved
out of the data-parallel ranks, so EP divides DP. The model adds its own: TP divides the attention
heads (KV heads fewer than TP are replicated, so TP must be a multiple of them), the MLP widths and the
vocabulary; EP divides the experts; PP is at most the number of layers. `check_layout` runs before any
weight is read and names every broken rule together with the nearest layouts that would work.
"""
from __future__ import annotations

from dataclasses import dataclass

from unified.errors import UserError


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1

    def data(self, world: int) -> int:
        return world // (self.tensor * self.pipeline)

    def __str__(self) -> str:
        return f"tensor={self.tensor} pipeline={self.pipeline} expert={self.expert}"


class LayoutError(UserError, ValueError):
    pass


def layout_problems(layout: Layout, world: int, config=None) -> list[str]:
    """Every rule `layout` breaks on `world` ranks for a model of `config` (None: world rules only)."""
    tp, pp, ep = layout.tensor, layout.pipeline, layout.expert
    problems = []
    if min(tp, pp, ep) < 1:
        return [f"parallel sizes must be >= 1 (got {layout})"]
    if world % (tp * pp):
        problems.append(f"world size {world} is not a multiple of tensor x pipeline = {tp} x {pp}")
    elif layout.data(world) % ep:
        problems.append(f"expert parallel {ep} does not divide the {layout.data(world)} data-parallel ranks "
                        f"(world {world} / (tensor {tp} x pipeline {pp}))")
    if config is None:
        return problems
    attention_heads = config.num_heads
    if attention_heads % tp:
        problems.append(f"tensor parallel {tp} does not divide the {attention_heads} attention heads")
    kv = config.num_kv_heads
    if config.mla is None and kv % tp and tp % kv:
        problems.append(f"tensor parallel {tp} neither divides the {kv} KV heads nor is a multiple of them "
                        f"(fewer KV heads than ranks are replicated)")
    for name, size in (("vocabulary", config.vocab_size), ("MLP width", config.intermediate_size)):
        if size % tp:
            problems.append(f"tensor parallel {tp} does not divide the {name} ({size})")
    if config.moe is not None:
        if config.moe.num_experts % ep:
            problems.append(f"expert parallel {ep} does not divide the {config.moe.num_experts} experts")
        if config.moe.expert_intermediate_size % tp:
            problems.append(f"tensor parallel {tp} does not divide the expert MLP width "
                            f"({config.moe.expert_intermediate_size})")
    elif ep > 1:
        problems.append(f"expert parallel {ep} needs a mixture-of-experts model; this one is dense")
    if pp > config.num_layers:
        problems.append(f"pipeline parallel {pp} is more stages than the {config.num_layers} layers")
    return problems


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def valid_layouts(world: int, config=None) -> list[Layout]:
    sizes = divisors(world)
    return [Layout(tp, pp, ep) for tp in sizes for pp in sizes for ep in sizes
            if not layout_problems(Layout(tp, pp, ep), world, config)]


def check_layout(layout: Layout, world: int, config=None) -> None:
    problems = layout_problems(layout, world, config)
    if not problems:
        return
    def distance(other: Layout) -> tuple:
        return (abs(other.tensor - layout.tensor) + abs(other.pipeline - layout.pipeline)
                + abs(other.expert - layout.expert), -other.tensor * other.pipeline * other.expert)

    nearest = sorted(valid_layouts(world, config), key=distance)[:3]
    hint = ("; nearest valid layouts on these ranks: " + ", ".join(f"[{n}]" for n in nearest) if nearest
            else "; no layout fits these ranks, change the number of processes")
    raise LayoutError(f"impossible parallel layout [{layout}] on {world} ranks: " + "; ".join(problems) + hint
                      + " (set parallel.tensor=, parallel.pipeline=, parallel.expert= or parallel=<name>)")
