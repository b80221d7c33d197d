"""`recipe=vision_demo output=<dir>`: a vision-language model that tells faces from non-faces, trained on CPU.

No real vision weights exist offline, so the model is composed: the text model (`model=`, SmolLM2 by
default) with a fresh CLIP tower and projector (unified.checkpoint.compose_vlm). The fine-tuning code then
trains, on scikit-image's bundled faces and non-faces (unified.train.face_data), first the tower and
projector, then the projector alone, the language model frozen throughout. The result, <output>/model, is
evaluated on the held-out images through the engine that serves it (`LLM.chat` with the image, greedy);
the accuracy goes to stdout and <output>/eval.json.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from unified.errors import UserError

log = logging.getLogger(__name__)


def evaluate(model: str, heldout: Path, cfg) -> dict:
    """Accuracy of `model`'s greedy answers on the held-out lines (each a conversation and its answer)."""
    from omegaconf import OmegaConf

    from unified.engine.llm import LLM
    from unified.engine.sampling_params import SamplingParams
    from unified.train.face_data import parse_answer

    lines = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
    conversations, expected = [], []
    for line in lines:
        user, answer = line["messages"]
        content = [{**part, "image": str(heldout.parent / part["image"])} if part["type"] == "image" else part
                   for part in user["content"]]
        conversations.append([{**user, "content": content}])
        expected.append(answer["content"])
    with LLM.from_run_config(OmegaConf.merge(cfg, {"model": model})) as llm:
        outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=8))
    replies = [o.outputs[0].text.strip() for o in outputs]
    correct = [parse_answer(reply) == want for reply, want in zip(replies, expected)]
    return {"accuracy": sum(correct) / len(correct), "correct": sum(correct), "total": len(correct),
            "unparsed": sum(parse_answer(reply) is None for reply in replies),
            "answers": [{"image": c[0]["content"][0]["image"], "expected": want, "reply": reply}
                        for c, want, reply in zip(conversations, expected, replies)]}


def run(cfg) -> None:
    import torch
    from omegaconf import OmegaConf

    from unified.checkpoint.builtin import resolve_model
    from unified.checkpoint.compose_vlm import compose_llava
    from unified.runtime import start_runtime
    from unified.train.face_data import write_face_data
    from unified.train.trainer import train

    if not cfg.output:
        raise UserError("recipe=vision_demo needs output=<dir> for the data, the checkpoints and the model")
    if cfg.steps is not None:
        raise UserError("recipe=vision_demo trains in two phases: set vision_demo.tower_steps and "
                        "vision_demo.projector_steps instead of steps")
    start_runtime(cfg.device, cfg.parallel, cfg.seed)
    if torch.distributed.get_world_size() > 1:
        raise UserError("recipe=vision_demo runs as one process; start it without a launcher")
    demo, out = cfg.vision_demo, Path(cfg.output)
    began = time.perf_counter()
    train_file, heldout_file = write_face_data(out / "data", demo.heldout_per_class, cfg.seed)
    composed = out / "composed"
    if not (composed / "config.json").is_file():
        compose_llava(resolve_model(cfg.model), composed, demo.tower, cfg.seed)
    timings = {"data_and_compose_s": time.perf_counter() - began}
    phases = (("tower", composed, demo.tower_steps, "vision", cfg.train.lr),
              ("model", out / "tower", demo.projector_steps, "projector", demo.projector_lr))
    losses = {}
    for name, source, steps, trainable, lr in phases:
        began = time.perf_counter()
        result = train(OmegaConf.merge(cfg, {"model": str(source), "data": str(train_file), "output": str(out / name),
                                             "steps": steps, "train": {"trainable": trainable, "lr": lr}}))
        timings[f"train_{trainable}_s"] = time.perf_counter() - began
        if result.history:
            losses[trainable] = [result.history[0].loss, result.history[-1].loss]
    began = time.perf_counter()
    report = evaluate(str(out / "model"), heldout_file, cfg)
    timings["eval_s"] = time.perf_counter() - began
    report = {"model": str(out / "model"), "losses_first_last": losses, "timings": timings, **report}
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"held-out accuracy {report['accuracy']:.3f} ({report['correct']}/{report['total']} images, "
          f"{report['unparsed']} replies neither answer) through the engine; model in {out / 'model'}, "
          f"details in {out / 'eval.json'}")
