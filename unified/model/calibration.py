"""Activation-aware weight-only quantization: AWQ's scale search (Lin et al., "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration", 2023), run at load on a short calibration text.

One step per output feature rounds every weight of a row alike, and the output suffers most where a few input
channels carry large activations. A copy that quantizes the weight's columns multiplied by s and divides x by s
(exact before rounding; kernels.quantize) gives those channels finer steps: s = m ** alpha, m being each input's
mean magnitude over the calibration tokens, with alpha chosen per linear from a grid as the one whose quantized
output comes closest to the full-precision output on those tokens. alpha = 0 is the plain copy, so no linear
does worse than plain by the search's own measure.

`calibrate` runs one causal forward of the model (no KV cache) over the tokens, searching each quantized linear
as its input goes by, and leaves the factors where `pack_weights` uses them: `PackableLinear.input_smoothing`,
and the tied LM head's on the model. Every rank of a tensor- or pipeline-parallel model takes part, each
searching the shards it holds (a row-parallel linear sees its own slice of the input). The routed experts of
MoE layers, which stay as loaded, take no part.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from unified import kernels
from unified.errors import UserError
from unified.runtime.comm import collective

log = logging.getLogger(__name__)

BUILTIN = "builtin"  # engine.quantization_calibration's default: calibration.txt beside this module
MAX_TOKENS = 512
ALPHAS = tuple(i / 20 for i in range(21))  # AWQ's grid
# alpha is chosen on an even sample of this many outputs of a linear, so that the search costs as much for a large
# model's 11008 outputs as for 1024
SEARCH_ROWS = 1024
LEAST_FACTOR = 1e-4  # inputs that stay near zero on the calibration text keep factors of at least this


def calibration_text(source: str) -> str:
    """The text `source` names: BUILTIN (prose, dialogue, code, SQL, arithmetic and lists of a few hundred
    tokens, none of it from the benchmarks or tests), or a text file of the user's own domain."""
    path = Path(__file__).with_name("calibration.txt") if source == BUILTIN else Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"engine.quantization_calibration={source!r}: cannot read it as a UTF-8 text file "
                        f"({error}); give a text file, {BUILTIN!r}, or null for plain quantization") from None
    if not text.strip():
        raise UserError(f"engine.quantization_calibration={source!r} is empty; give a text file with a few "
                        f"hundred tokens of the text the model will see")
    return text


def calibration_ids(tokenizer, source: str) -> list[int]:
    """The first MAX_TOKENS tokens of `source`'s text (`calibration_text`)."""
    return tokenizer(calibration_text(source))["input_ids"][:MAX_TOKENS]


def smoothing_factors(weight: torch.Tensor, x: torch.Tensor, quantization: str, int4_group: int | None = None,
                      group=None) -> torch.Tensor | None:
    """The factors s [in] for quantizing `weight` [out, in] whose input rows `x` [rows, in] were seen on the
    calibration text; None where the plain copy is at least as close. `group`: the tensor-parallel ranks that
    hold the other shards of this linear, which then agree on alpha by their summed error (for a column-parallel
    linear, the error of the whole output, so the choice one rank would make alone)."""
    w, x = weight.detach().float(), x.detach().float().reshape(-1, weight.shape[1])
    w = w[::max(1, w.shape[0] // SEARCH_ROWS)]
    want = x @ w.T
    magnitude = x.abs().mean(0)
    candidates = [None]
    for alpha in ALPHAS[1:]:
        factors = magnitude.pow(alpha).clamp(min=LEAST_FACTOR)
        candidates.append(factors / (factors.max() * factors.min()).sqrt())
    # version=0: these trial copies stand for no weight (and a float copy made under inference mode keeps no
    # version counter to read)
    errors = torch.stack([(x @ kernels.dequantize(kernels.quantize(w, quantization, int4_group, factors, version=0)).T
                           - want).square().sum() for factors in candidates])
    if group is not None and group.size() > 1:
        with collective("calibration_errors", errors):
            torch.distributed.all_reduce(errors, group=group)
    return candidates[int(errors.argmin())]  # the first of equals: plain where nothing does better


def calibrate_for_serving(model, tokenizer, source: str | None) -> None:
    """`calibrate` on the text `source` names (engine.quantization_calibration: BUILTIN, a text file, or None for
    plain copies), where the model is about to be quantized and a tokenizer is there to read the text."""
    if source is None or model.weight_quantization is None:
        return
    model.check_weight_quantization()  # before a forward that quantizes each linear to search its factors
    if tokenizer is None:
        log.info("no tokenizer: %s copies are plain, not activation-aware", model.weight_quantization)
        return
    calibrate(model, calibration_ids(tokenizer, source))


@torch.inference_mode()
def calibrate(model, token_ids: list[int]) -> None:
    """Searches the factors of every linear `model.pack_weights()` quantizes (`model.weight_quantization`; the LM
    head with `model.quantize_head`), from one forward over `token_ids`. Every rank running the model calls it."""
    quantization, int4_group = model.weight_quantization, model.int4_group
    if quantization is None or not token_ids or model.quantized_source:
        return  # copies of a quantized checkpoint's weights keep the values it stored (kernels.quantize_int4)
    start = time.perf_counter()
    head = model.lm_head
    linears = [module for _, module in model.quantized_linears()]

    def search(module, args) -> None:
        if module.weight.dim() == 2 and module.weight.shape[1] == args[0].shape[-1]:  # not a ZeRO-3 partition
            module.input_smoothing = smoothing_factors(module.weight, args[0], quantization, int4_group,
                                                       module.tp_group)

    hooks = [m.register_forward_pre_hook(search) for m in linears if m is not head]
    device = next(model.parameters()).device
    try:
        hidden = model(torch.tensor([token_ids], device=device), torch.arange(len(token_ids), device=device)[None])
    finally:
        for hook in hooks:
            hook.remove()
    if model.quantize_head and model.stage.last:
        if head is not None:
            head.input_smoothing = smoothing_factors(head.weight, hidden, quantization, int4_group, head.tp_group)
        elif model.config.tie_word_embeddings:
            model.head_smoothing = smoothing_factors(model.embed.weight, hidden, quantization, int4_group,
                                                     model.embed.tp_group)
    smoothed = sum(m.input_smoothing is not None for m in linears)
    log.info("activation-aware %s: %d of %d linears smoothed, calibrated on %d tokens in %.1f s", quantization,
             smoothed, len(linears), len(token_ids), time.perf_counter() - start)
