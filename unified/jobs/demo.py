"""The main job: answer one chat prompt with the shared model definition, through the engine."""
from __future__ import annotations

from unified.engine.llm import build_engine, chat_prompt
from unified.engine.sampling_params import SamplingParams
from unified.errors import UserError


def run(cfg) -> None:
    if not cfg.prompt:
        raise UserError("the demo needs a prompt: unified recipe=demo 'prompt=\"What is the capital of France?\"'")
    bundle = build_engine(cfg.model, cfg.device, cfg.parallel, cfg.engine, cfg.seed)
    messages = ([{"role": "system", "content": cfg.generation.system_prompt}] if cfg.generation.system_prompt else [])
    messages.append({"role": "user", "content": cfg.prompt})
    engine = bundle.engine
    engine.add_request(chat_prompt(bundle.tokenizer, messages),
                       SamplingParams(temperature=0, max_tokens=cfg.generation.max_new_tokens))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    print(outputs[0].outputs[0].text.strip())
