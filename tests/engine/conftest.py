from __future__ import annotations

import pytest
import torch

from unified.checkpoint import load_model
from unified.config.schema import EngineConfig
from unified.engine.llm_engine import LLMEngine


def make_engine(loaded, tokenizer=None, eos=(), **options) -> LLMEngine:
    options.setdefault("num_blocks", 64)
    options.setdefault("block_size", 4)
    return LLMEngine(loaded.model, tokenizer, EngineConfig(**options), torch.device("cpu"), torch.float32,
                     accelerator=None, eos_token_ids=set(eos))


class Compare:
    """Wraps the runner's execute: each step its decode graphs (or traced steps) take also runs eagerly, and both
    logits are kept."""

    def __init__(self, engine):
        self.runner, self.pairs, self.sizes = engine.runner, [], []
        self.execute = self.runner.execute
        self.runner.execute = self

    def __call__(self, batch, greedy=False):
        graphs = self.runner.graphs
        if graphs.takes(batch):  # each writes the same K/V at the same slots
            self.pairs.append((graphs.run(batch), self.runner._run(*self.runner.prepare(batch))))
            self.sizes.append(len(batch))
        return self.execute(batch, greedy)


class TeacherForcing:
    """A `choose` for LLMEngine.step that feeds given continuations and records the engine's logits."""

    def __init__(self, continuations: dict[str, list[int]]):
        self.continuations = continuations
        self.logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in continuations}

    def __call__(self, logits, seqs):
        tokens = []
        for row, seq in zip(logits, seqs):
            recorded = self.logits[seq.request_id]
            recorded.append(row.clone())
            tokens.append(self.continuations[seq.request_id][len(recorded) - 1])
        return tokens, [None] * len(seqs)


def generate_all(engine: LLMEngine, prompts, params):
    """Runs prompts to completion (`params` one SamplingParams for all, or one each); outputs in prompt order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    return [done[i] for i in ids]


def greedy_answer(path, prompt: str | list[int], max_tokens: int) -> str:
    """What the engine on one rank, in this process, answers greedily on the checkpoint at `path`."""
    from transformers import AutoTokenizer

    from unified.engine.sampling_params import SamplingParams

    engine = make_engine(load_model(path), AutoTokenizer.from_pretrained(path), block_size=16)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return generate_all(engine, [prompt], params)[0].outputs[0].text


def run_teacher_forced(engine: LLMEngine, prompts: list[list[int]], continuations: list[list[int]]):
    from unified.engine.sampling_params import SamplingParams

    ids = [engine.add_request(p, SamplingParams(max_tokens=len(c), ignore_eos=True))
           for p, c in zip(prompts, continuations)]
    forcing = TeacherForcing(dict(zip(ids, continuations)))
    while engine.has_unfinished():
        engine.step(forcing)
    return [torch.stack(forcing.logits[i]) for i in ids]


@torch.inference_mode()
def reference_logits(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Plain forward over prompt + continuation: the logits that predict each continuation token."""
    ids = torch.tensor([prompt + continuation])
    logits = model.logits(model(ids, torch.arange(ids.shape[1])))[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(continuation)]


def assert_no_block_leaks(engine: LLMEngine) -> None:
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(b.ref_count == 0 for b in engine.blocks.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.fixture(scope="module")
def tiny_models(runtime, tiny_checkpoint):
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = load_model(tiny_checkpoint(family))
        return cache[family]

    return get
