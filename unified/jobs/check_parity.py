"""`unified recipe=check_parity model=<dir>`: prints per-layer and final-logit cosine similarity between
our model and `transformers` on the same checkpoint and exits non-zero below the thresholds."""
from __future__ import annotations

import torch

from unified.checkpoint import load_model
from unified.checkpoint.builtin import resolve_model
from unified.jobs.parity import compare, reference_model
from unified.runtime import current_layout, start_runtime


def _input_ids(path, prompt: str | None, num_tokens: int, vocab_size: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    ids = tokenizer(prompt)["input_ids"] if tokenizer is not None and prompt else []
    if ids:
        return torch.tensor([ids], dtype=torch.long)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))


def run(cfg) -> None:
    runtime = start_runtime(cfg.device, cfg.parallel, cfg.seed)
    path = resolve_model(cfg.model)
    ours = load_model(path, runtime.device, runtime.dtype)
    reference = reference_model(path, runtime.dtype).to(runtime.device)
    ids = _input_ids(path, cfg.prompt, cfg.check.num_tokens, ours.config.vocab_size).to(runtime.device)
    report = compare(ours.model, reference, ids)
    if torch.distributed.get_world_size() > 1:  # pipeline stages each hold some layers: merge their rows
        reports = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(reports, report)
        report.layer_cosine = dict(sorted({i: c for r in reports for i, c in r.layer_cosine.items()}.items()))
    passed = report.passes(cfg.check.min_cosine, cfg.check.max_abs_diff)
    if torch.distributed.get_rank() == 0:
        layout = current_layout()
        print(f"parity of {path} ({ours.config.family}, {ids.shape[1]} tokens, {runtime.dtype}, [{layout}] on "
              f"{torch.distributed.get_world_size()} ranks) against transformers:")
        print(report.table())
        print(f"PASSED (cosine >= {cfg.check.min_cosine}, max |diff| <= {cfg.check.max_abs_diff})" if passed else
              f"FAILED: need cosine >= {cfg.check.min_cosine} everywhere and max |diff| <= {cfg.check.max_abs_diff}")
    if not passed:
        raise SystemExit(1)
