"""LoRA on the built-in SmolLM2-135M learns a fixed-format task: the held-out score rises from the base
model's (it explains instead of answering with the number alone) to most answers exactly right."""
from __future__ import annotations

import json
import random

from tests.conftest import run_cli


def _problems(count: int, rng: random.Random) -> list[tuple[list[dict], str]]:
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        out.append(([{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}], str(a + b)))
    return out


def _answers(model: str, problems, **engine_options) -> list[str]:
    from unified.engine.llm import LLM
    from unified.engine.sampling_params import SamplingParams

    with LLM(model, device="cpu", num_blocks=256, **engine_options) as llm:
        outputs = llm.chat([m for m, _ in problems], SamplingParams(temperature=0, max_tokens=8))
    return [o.outputs[0].text.strip() for o in outputs]


def _score(answers: list[str], problems) -> float:
    return sum(got == answer for got, (_, answer) in zip(answers, problems)) / len(problems)


def test_lora_fine_tuning_improves_the_held_out_score(smollm2_checkpoint, tmp_path):
    rng = random.Random(0)
    train, held_out = _problems(256, rng), _problems(40, rng)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": m + [{"role": "assistant", "content": a}]}) + "\n"
                            for m, a in train))
    output = tmp_path / "tuned"
    result = run_cli("recipe=lora", f"model={smollm2_checkpoint}", f"data={data}", f"output={output}", "steps=30",
                     "train.lr=1e-3", "train.micro_batch_size=8", "train.seq_len=256", "train.warmup_steps=3",
                     "train.packing=false", "train.wandb=disabled")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (output / "adapter" / "adapter_model.safetensors").is_file()

    merged = _answers(str(output), held_out)
    base, tuned = _score(_answers(str(smollm2_checkpoint), held_out), held_out), _score(merged, held_out)
    print(f"held-out exact-match: base {base:.2f}, LoRA-tuned {tuned:.2f}")
    assert tuned >= 0.5 and tuned >= base + 0.4
    # The adapter served unmerged on the base model answers like the merged checkpoint.
    unmerged = _answers(str(smollm2_checkpoint), held_out, lora_adapter=str(output / "adapter"))
    assert _score(unmerged, held_out) >= tuned - 0.05 and sum(a == b for a, b in zip(unmerged, merged)) >= 0.9 * len(merged)
