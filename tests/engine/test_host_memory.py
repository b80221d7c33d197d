"""The CPU engine keeps freed host memory (unified/runtime/host_memory.py): steady-state prefill steps of
SmolLM2 stop page-faulting their activations in. Each configuration runs in a fresh process, since
malloc's tuning cannot be undone within one. The processes run the plain-PyTorch ops (UNIFIED_CPU_KERNELS=0),
whose temporaries are what glibc's defaults keep unmapping and mapping again; the fused C++ kernels
allocate fewer of them, and with those glibc's adaptive threshold alone gets close (a few thousand
faults in the second round, ~100 in the third).

Both processes start with glibc's mmap threshold pinned at its default 128 KiB (GLIBC_TUNABLES), which
turns off its adaptive rise: how far that rise gets on its own depends on the order in which the step's
buffers happen to be freed, and it sometimes spared the untuned run most of its faults (one CI run saw
[122226, 2049]), so the baseline was not a baseline. The tuned process overrides the pin like any other
setting, so the difference measured is the engine's tuning alone."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROUNDS = """
import json, random, resource, sys, torch
import unified.engine.llm_engine as llm_engine
from unified.checkpoint import load_model
from unified.config.schema import EngineConfig
from unified.engine.sampling_params import SamplingParams
from unified.runtime import init_distributed, select_accelerator

if sys.argv[1] == "untuned":
    llm_engine.retain_freed_host_memory = lambda: False
init_distributed(select_accelerator("cpu"))
engine = llm_engine.LLMEngine(load_model(sys.argv[2]).model, None, EngineConfig(num_blocks=512),
                              torch.device("cpu"), torch.float32, None)
rng, faults = random.Random(0), []
for round in range(3):  # each: one 2048-token prefill step (16 fresh prompts of 128 tokens, one new token each)
    for _ in range(16):
        engine.add_request([rng.randrange(100, 30000) for _ in range(128)], SamplingParams(max_tokens=1))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    while engine.has_unfinished():
        engine.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults[1:]))  # the first round faults its buffers in either way
"""


def _prefill_faults(mode: str, checkpoint) -> list[int]:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(ROUNDS), mode, str(checkpoint)], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "UNIFIED_CPU_KERNELS": "0",
                                                 "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_steady_state_prefill_steps_stop_faulting_in_their_activations(smollm2_checkpoint):
    untuned, tuned = _prefill_faults("untuned", smollm2_checkpoint), _prefill_faults("tuned", smollm2_checkpoint)
    assert min(untuned) > 20_000, untuned  # a fixed 128 KiB threshold: the step's buffers are mapped afresh every step
    assert max(tuned) < min(untuned) / 10, (tuned, untuned)


def test_the_kv_cache_pages_are_committed_at_the_lowest_priority(monkeypatch):
    """The background commit of a CPU cache's pages runs at nice 19 (at normal priority it took a core from the
    steps' parallel kernels), in its own thread only; the cache can wait for it."""
    import threading

    import torch

    from unified.engine.kv_cache import KVCache
    from unified.model.config import ModelConfig

    config = ModelConfig(family="llama", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, intermediate_size=128)
    calls = []
    monkeypatch.setattr(os, "setpriority", lambda which, who, value: calls.append((which, who, value)))
    cache = KVCache(config, num_blocks=64, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    thread = cache.prefaulting
    cache.wait_prefaulted()
    assert cache.prefaulting is None and (thread is None or not thread.is_alive())
    if thread is not None:
        assert calls == [(os.PRIO_PROCESS, thread.native_id, 19)] and thread.native_id != threading.get_native_id()


def _huge_page_support() -> bool:
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    return "[never]" not in mode and tuple(map(int, os.uname().release.split(".")[:2])) >= (6, 1)


def _anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not _huge_page_support(), reason="transparent huge pages off, or a kernel before MADV_COLLAPSE")
def test_weights_move_onto_huge_pages_unchanged():
    import torch

    from unified.runtime.host_memory import back_with_huge_pages

    weight = torch.randn(3 << 20)  # 12 MiB, written on 4 KiB pages
    want = weight.clone()
    moved = back_with_huge_pages([weight, weight[1:], torch.randn(10)])  # a view and a small tensor: nothing more
    assert moved >= 8 << 20 and _anon_huge_bytes(weight.data_ptr() + (6 << 20)) >= 2 << 20
    assert torch.equal(weight, want)
    assert back_with_huge_pages([weight]) == moved  # already there: nothing to copy
