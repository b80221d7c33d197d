"""A bfloat16 engine step computes in bfloat16: every op that takes bfloat16 tensors and returns float32 is
recorded with the line of ours that asked for it, and only the declared places may: the norms' statistics,
MoE routing, and the logits the sampler reads (softmax inside attention happens within its op)."""
from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unified.checkpoint import load_model
from unified.config.schema import EngineConfig
from unified.engine.llm_engine import LLMEngine
from unified.engine.sampling_params import SamplingParams

DECLARED = {  # where float32 is meant, by file
    "unified/kernels/rms_norm.py": "RMSNorm statistics (as transformers)",
    "unified/model/moe.py": "router logits and top-k weights",
    "unified/engine/model_runner.py": "logits handed to the sampler",
}


class Upcasts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found: dict[str, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outputs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if any(t.dtype == torch.bfloat16 for t in inputs) and any(o.dtype == torch.float32 for o in outputs):
            ours = [f for f in traceback.extract_stack() if "/unified/" in f.filename and "/tests/" not in f.filename]
            where = ours[-1].filename.split("/unified/", 1)[1] if ours else "?"
            self.found.setdefault("unified/" + where, f"{func} at line {ours[-1].lineno if ours else '?'}")
        return out


def test_a_bf16_step_upcasts_only_where_declared(runtime, tiny_checkpoint):
    for family in ("llama", "qwen3_moe", "deepseek_v3"):
        loaded = load_model(tiny_checkpoint(family), "cpu", torch.bfloat16)
        # Eager, so that each op is seen with the line of ours that asked for it: traced decode steps
        # (engine/traced_steps.py) replay the very ops recorded from this forward.
        engine = LLMEngine(loaded.model, None, EngineConfig(num_blocks=32, block_size=16, enforce_eager=True),
                           torch.device("cpu"), torch.bfloat16, accelerator=None, eos_token_ids=set())
        engine.add_request([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
        audit = Upcasts()
        with audit:
            while engine.has_unfinished():
                engine.step()
        undeclared = {where: what for where, what in audit.found.items() if where not in DECLARED}
        assert not undeclared, f"{family}: float32 computed from bfloat16 at {undeclared}"
