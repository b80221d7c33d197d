"""`unified recipe=check_parity model=<dir>`: prints per-layer and final-logit cosine similarity between
our model and `transformers` on the same checkpoint and exits non-zero below the thresholds.

A vision-language checkpoint is compared twice: on the text alone, and on the text with two sample photos
from scikit-image, of different sizes (prepared by the checkpoint's own image processor), in the middle of it.

With `engine.quantization=int8|int4` our side runs the quantized copies the engine would serve (the inference
path), so the report is the quantized model's cosine against its full-precision source; set `check.min_cosine`
and `check.max_abs_diff` to the bar that quantization is held to."""
from __future__ import annotations

import contextlib

import torch

from unified.checkpoint import load_model
from unified.checkpoint.builtin import resolve_model
from unified.engine.llm_engine import LLMEngine
from unified.jobs.parity import compare, reference_model
from unified.model.calibration import calibrate_for_serving
from unified.runtime import current_layout, start_runtime


def _tokenizer(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None


def _input_ids(tokenizer, prompt: str | None, num_tokens: int, vocab_size: int) -> torch.Tensor:
    ids = tokenizer(prompt)["input_ids"] if tokenizer is not None and prompt else []
    if ids:
        return torch.tensor([ids], dtype=torch.long)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))


def run(cfg) -> None:
    runtime = start_runtime(cfg.device, cfg.parallel, cfg.seed)
    path = resolve_model(cfg.model)
    ours = load_model(path, runtime.device, runtime.dtype)
    quantized = LLMEngine.served_quantization(cfg.engine)
    tokenizer = _tokenizer(path)
    if quantized:
        ours.model.weight_quantization, ours.model.quantize_head = quantized, cfg.engine.quantize_lm_head
        ours.model.head_rescore = cfg.engine.quantized_head_rescore
        calibrate_for_serving(ours.model, tokenizer, cfg.engine.quantization_calibration)
        ours.model.pack_weights()
    reference = reference_model(path, runtime.dtype).to(runtime.device)
    ids = _input_ids(tokenizer, cfg.prompt, cfg.check.num_tokens, ours.config.vocab_size).to(runtime.device)
    if ours.config.vision is not None:  # random text must not hold image or video placeholders
        for placeholder in (ours.config.image_token_id, getattr(ours.hf_config, "video_token_id", None)):
            ids = ids.masked_fill(ids == placeholder, 0)
    with torch.inference_mode() if quantized else contextlib.nullcontext():
        reports = {"text": _gathered(compare(ours.model, reference, ids))}
    if ours.config.vision is not None:
        images = _sample_images(path)
        with_images = _with_placeholders(ids, ours.config.image_token_id, images.num_tokens)
        title = f"text + {len(images.num_tokens)} images ({sum(images.num_tokens)} image tokens)"
        reports[title] = _gathered(compare(ours.model, reference, with_images.to(runtime.device), images))
    passed = all(r.passes(cfg.check.min_cosine, cfg.check.max_abs_diff) for r in reports.values())
    if torch.distributed.get_rank() == 0:
        layout = current_layout()
        family = ours.config.family
        if ours.config.vision is not None:
            family = f"{ours.config.vision.kind}, {family} text"
        if quantized:
            family += f", served as {quantized}{' with the LM head' if cfg.engine.quantize_lm_head else ''}"
        print(f"parity of {path} ({family}, {ids.shape[1]} tokens, {runtime.dtype}, [{layout}] on "
              f"{torch.distributed.get_world_size()} ranks) against transformers:")
        for title, report in reports.items():
            print(f"{title}:\n{report.table()}" if len(reports) > 1 else report.table())
        print(f"PASSED (cosine >= {cfg.check.min_cosine}, max |diff| <= {cfg.check.max_abs_diff})" if passed else
              f"FAILED: need cosine >= {cfg.check.min_cosine} everywhere and max |diff| <= {cfg.check.max_abs_diff}")
    if not passed:
        raise SystemExit(1)


def _gathered(report):
    if torch.distributed.get_world_size() > 1:  # pipeline stages each hold some layers: merge their rows
        reports = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(reports, report)
        report.layer_cosine = dict(sorted({i: c for r in reports for i, c in r.layer_cosine.items()}.items()))
    return report


def _sample_images(path):
    """Two photos that ship with scikit-image (the astronaut, a cup of coffee), scaled to small sizes of
    different aspect ratios so that tiny test models see few image tokens, through the checkpoint's processor."""
    from PIL import Image
    from skimage import data

    from unified.vision import processor_for

    photos = [Image.fromarray(data.astronaut()).resize((168, 112), Image.Resampling.BICUBIC),
              Image.fromarray(data.coffee()).resize((84, 140), Image.Resampling.BICUBIC)]
    return processor_for(path)(photos)


def _with_placeholders(ids: torch.Tensor, image_token_id: int, counts: list[int]) -> torch.Tensor:
    """[1, S] text -> the text with each image's run of placeholder tokens after its first and second third."""
    text = ids[0].cpu()
    cuts = [len(text) * (i + 1) // (len(counts) + 1) for i in range(len(counts))]
    pieces, start = [], 0
    for cut, count in zip(cuts, counts):
        pieces += [text[start:cut], torch.full((count,), image_token_id, dtype=text.dtype)]
        start = cut
    return torch.cat(pieces + [text[start:]]).unsqueeze(0)
