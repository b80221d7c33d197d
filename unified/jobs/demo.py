"""The main job: answer one chat prompt with the shared model definition, through the engine."""
from __future__ import annotations

from unified.engine.llm import LLM
from unified.engine.sampling_params import SamplingParams
from unified.errors import UserError


def run(cfg) -> None:
    if not cfg.prompt:
        raise UserError("the demo needs a prompt: unified recipe=demo 'prompt=\"What is the capital of France?\"'")
    messages = ([{"role": "system", "content": cfg.generation.system_prompt}] if cfg.generation.system_prompt else [])
    messages.append({"role": "user", "content": cfg.prompt})
    with LLM.from_run_config(cfg) as llm:
        output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=cfg.generation.max_new_tokens))
    print(output[0].outputs[0].text.strip())
