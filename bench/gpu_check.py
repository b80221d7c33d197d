"""Checks of the accelerator path on a borrowed CUDA machine, in one run: what works, what fails, how fast.

    python3 bench/gpu_check.py --out DIR [--dry-run] [--only SECTION,...]

Run through bench/gpu_check.sh, which installs the carried wheels first. Every section runs even when an
earlier one failed; each records its figures or its error in DIR/gpu_check.json, and a summary table ends
the log. Models are built on the spot with random weights (nothing can be downloaded there); the chat
models borrow the SmolLM2 tokenizer that bench/gpu_wheels.sh carries. `--dry-run` runs every section on
this CPU with tiny sizes, so the script itself is checked before device minutes are spent on it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

FAMILIES = ("llama", "qwen2", "mixtral", "qwen3_moe", "deepseek_v3")


class Check:
    def __init__(self, args):
        self.dry = args.dry_run
        self.quick = args.quick
        self.device = "cpu" if self.dry else "cuda"
        self.out = Path(args.out)
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.tokenizer = Path(args.tokenizer)
        if self.dry and not self.tokenizer.is_dir():  # here the built-in model's folder has the same files
            from unified.checkpoint.builtin import resolve_model

            self.tokenizer = resolve_model("smollm2")
        self.results: dict[str, dict] = {}

    def save(self, partial: dict | None = None) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps({**self.results, **(partial or {})}, indent=1, default=str))

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, repeats: int = 20) -> float:
        """Median seconds of `fn` after two warm-up calls."""
        for _ in range(2):
            fn()
        times = []
        for _ in range(3 if self.dry else repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def chat_checkpoint(self, name: str, **shape) -> Path:
        from tests.conftest import build_tiny_chat_checkpoint

        path = self.work / name
        if not (path / "config.json").is_file():
            build_tiny_chat_checkpoint(path, self.tokenizer, **shape)
        return path


# ---------------------------------------------------------------------------------------------- sections

def env(check: Check) -> dict:
    import transformers

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}
    if check.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2 ** 30, 1), sms=props.multi_processor_count)
    for module in ("triton", "deepspeed", "megatron.core", "hydra"):
        try:
            info[module] = getattr(__import__(module, fromlist=["__version__"]), "__version__", "?")
        except Exception as error:  # noqa: BLE001 - report what is missing and go on
            info[module] = f"missing: {error}"
    from unified.runtime import select_accelerator

    accelerator = select_accelerator(check.device)
    info["accelerator"] = accelerator._name
    info["bf16"] = accelerator.is_bf16_supported()
    return info


def kernels(check: Check) -> dict:
    """Each op against its reference (max |diff|) and the nearest torch built-in (median times)."""
    from unified.kernels import (dequantize_kv, gated_activation, gated_activation_reference, paged_attention,
                                 quantize_kv, rms_norm, rms_norm_reference)

    dev, res = check.device, {}
    rows, hidden = (64, 256) if check.dry else (8192, 4096)
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).split(".")[-1]
        x = torch.randn(rows, hidden, device=dev, dtype=dtype)
        w = torch.randn(hidden, device=dev, dtype=dtype)
        ours, ref = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
        res[f"rms_norm/{tag}/max_diff"] = (ours.float() - ref.float()).abs().max().item()
        res[f"rms_norm/{tag}/ours_us"] = check.timed(lambda: rms_norm(x, w, 1e-6)) * 1e6
        res[f"rms_norm/{tag}/torch_us"] = check.timed(lambda: F.rms_norm(x, (hidden,), w, 1e-6)) * 1e6
        gate_up = torch.randn(rows, 2 * hidden, device=dev, dtype=dtype)
        res[f"silu_mul/{tag}/max_diff"] = (gated_activation(gate_up, F.silu).float()
                                           - gated_activation_reference(gate_up, F.silu).float()).abs().max().item()
        res[f"silu_mul/{tag}/ours_us"] = check.timed(lambda: gated_activation(gate_up, F.silu)) * 1e6

    # Paged decode attention against dense SDPA on the same keys (bf16, GQA 32/8, head_dim 128).
    seqs, ctx, hq, hkv, d, block = (4, 40, 4, 2, 16, 16) if check.dry else (64, 1024, 32, 8, 128, 16)
    dtype = torch.bfloat16
    blocks_per_seq = -(-ctx // block)
    k_cache = torch.randn(seqs * blocks_per_seq + 1, block, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(seqs * blocks_per_seq, device=dev).view(seqs, blocks_per_seq).int()
    q = torch.randn(seqs, hq, d, device=dev, dtype=dtype)
    starts, lens = list(range(seqs + 1)), [ctx] * seqs
    out = paged_attention(q, k_cache, v_cache, tables, starts, lens, d ** -0.5)
    k = k_cache[tables.long()].reshape(seqs, -1, hkv, d)[:, :ctx].transpose(1, 2)
    v = v_cache[tables.long()].reshape(seqs, -1, hkv, d)[:, :ctx].transpose(1, 2)
    dense = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=d ** -0.5, enable_gqa=True)[:, :, 0]
    res["paged_decode/bf16/max_diff"] = (out.float() - dense.float()).abs().max().item()
    res["paged_decode/bf16/ours_us"] = check.timed(
        lambda: paged_attention(q, k_cache, v_cache, tables, starts, lens, d ** -0.5)) * 1e6
    res["paged_decode/bf16/sdpa_dense_us"] = check.timed(
        lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=d ** -0.5, enable_gqa=True)) * 1e6

    for bits in (8, 4):
        x = torch.randn(seqs * ctx, hkv, d, device=dev, dtype=dtype)
        values, scale = quantize_kv(x, bits)
        back = dequantize_kv(values, scale, bits, dtype)
        res[f"kv_quant/int{bits}/cosine"] = F.cosine_similarity(back.float().flatten(), x.float().flatten(), 0).item()
        res[f"kv_quant/int{bits}/quantize_us"] = check.timed(lambda: quantize_kv(x, bits)) * 1e6
    return res


def triton_kernels(check: Check) -> dict:
    """The Triton kernels natively: the kernel test files on the device, then each op on the default backend
    (Triton on the GPU; C++ or the references in a dry run) against its reference: max |diff| and times."""
    from unified import kernels
    from unified.kernels import registry

    res = {}
    tests = ["tests/kernels/test_triton_kernels.py", "tests/engine/test_kernel_backends.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    res["pytest"] = (run.stdout.strip().splitlines() or ["no output"])[-1]
    dev, dtype, g = check.device, torch.bfloat16, torch.Generator().manual_seed(0)
    small = check.dry or check.quick
    tokens, hidden, heads, kv_heads, dim, experts, inter = (
        (32, 128, 4, 2, 64, 8, 64) if small else (4096, 4096, 32, 8, 128, 64, 1408))

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    x, w = rand(tokens, hidden), rand(hidden)
    qk = rand(1, tokens, heads + kv_heads, dim)
    angles = torch.rand(1, tokens, dim // 2, generator=g).to(dev)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    blocks, block = tokens // 16 + 2, 16
    slots = torch.randperm(blocks * block, generator=g)[:tokens].to(dev)
    logits = torch.randn(tokens, experts, generator=g).to(dev)
    ids = torch.stack([torch.randperm(experts, generator=g)[:4] for _ in range(tokens)]).to(dev)
    weights = torch.rand(tokens, 4, generator=g).to(dev, dtype)
    gate_up, down = rand(experts, 2 * inter, hidden, scale=0.05), rand(experts, hidden, inter, scale=0.05)

    def write_int8():
        cache = torch.zeros(blocks, block, kv_heads, dim, dtype=torch.int8, device=dev)
        scales = torch.zeros(blocks, block, kv_heads, device=dev)
        kernels.write_kv(cache, scales, qk[0, :, heads:], slots, 8)
        return kernels.dequantize_kv(cache, scales, 8, dtype)

    gate_up_rows = rand(tokens, 2 * hidden)

    def rope():
        out = qk.clone()
        norm = (w[:dim], w[:dim])
        if kernels.norm_rope_applies(out, cos, False, *norm):
            kernels.norm_rope_(out, cos, sin, *norm, heads, 1e-6)
            return out
        q, k = out.split([heads, kv_heads], dim=2)
        normed = torch.cat([kernels.rms_norm_reference(part, w[:dim], 1e-6) for part in (q, k)], dim=2)
        return kernels.apply_rotary(normed, cos, sin, interleaved=False)

    ops = {
        "rms_norm": (lambda: kernels.rms_norm(x, w, 1e-6), lambda: F.rms_norm(x, (hidden,), w, 1e-6)),
        "add_rms_norm": (lambda: kernels.add_rms_norm(x, x, w, 1e-6)[0], None),
        "silu_and_mul": (lambda: kernels.gated_activation(gate_up_rows, F.silu), None),
        "norm_rope": (rope, None),
        "write_kv_int8": (write_int8, None),
        "route_topk": (lambda: kernels.route_topk(logits, 4, "sigmoid", None, 4, 2, True, 1.0)[1].float(), None),
        "moe_experts": (lambda: kernels.moe_experts(x, gate_up, down, weights, ids, 0, F.silu), None),
    }
    with torch.inference_mode():
        for name, (ours, builtin) in ops.items():
            try:
                got = ours().float()
                res[f"{name}/ours_us"] = check.timed(ours) * 1e6
                registry.set_backend("reference")
                want = ours().float()
                res[f"{name}/reference_us"] = check.timed(ours) * 1e6
                res[f"{name}/max_diff"] = (got - want).abs().max().item()
                if builtin is not None:
                    res[f"{name}/torch_us"] = check.timed(builtin) * 1e6
            except Exception as error:  # noqa: BLE001 - one op failing must not hide the others
                res[f"{name}/error"] = _short(error)
            finally:
                registry.set_backend("auto")
    return res


def parity(check: Check) -> dict:
    """Our model against `transformers` on the device, every family, fp32 and bf16 (final-logit cosine)."""
    from tests.conftest import build_tiny_hf_model
    from unified.checkpoint import load_model
    from unified.jobs.parity import compare, reference_model
    from unified.runtime import Layout, init_distributed, select_accelerator

    init_distributed(select_accelerator(check.device), Layout())
    res = {}
    for family in FAMILIES:
        path = check.work / f"tiny-{family}"
        build_tiny_hf_model(family).save_pretrained(path)
        for dtype in (torch.float32, torch.bfloat16):
            tag = f"{family}/{str(dtype).split('.')[-1]}"
            try:
                ours = load_model(path, check.device, dtype).model.eval()
                ref = reference_model(path, dtype).to(check.device)
                ids = torch.randint(0, 160, (2, 48), generator=torch.Generator().manual_seed(0)).to(check.device)
                report = compare(ours, ref, ids)
                res[f"{tag}/logits_cosine"] = report.logits_cosine
                res[f"{tag}/max_abs_diff"] = report.logits_max_abs_diff
                res[f"{tag}/min_layer_cosine"] = min(report.layer_cosine.values())
            except Exception as error:  # noqa: BLE001 - one family failing must not hide the others
                res[f"{tag}/error"] = _short(error)
    return res


def engine(check: Check) -> dict:
    """Greedy engine output against `transformers` generate (fp32), then a bf16 run counting host syncs."""
    from transformers import AutoModelForCausalLM

    from unified.engine.llm import LLM
    from unified.engine.sampling_params import SamplingParams

    path = check.chat_checkpoint("tiny-chat")
    prompts = [[1 + (7 * i + 3 * j) % 4000 for j in range(5 + 3 * i)] for i in range(8)]
    new = 24
    res = {}
    llm = LLM(str(path), device=check.device, dtype="float32")
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(check.device).eval()
    agree = total = 0
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt], device=check.device)
        want = hf.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)[0, len(prompt):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        agree, total = agree + same, total + len(want)
    res["fp32_greedy_prefix_agreement"] = agree / total
    del llm

    llm = LLM(str(path), device=check.device, dtype="bfloat16")
    llm.generate(prompts[:2], greedy)  # warm
    step = llm.engine.step
    counts = {"steps": 0, "syncs": 0}

    def counted_step():
        counts["steps"] += 1
        if check.device != "cuda":
            return step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                counts["syncs"] += sum("synchroniz" in str(w.message) for w in caught)
                counts.setdefault("first_sync", next((_where(w) for w in caught if "synchroniz" in str(w.message)), None))

    llm.engine.step = counted_step
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.8, seed=1))
    llm.engine.step = step
    res["bf16_finished"] = sum(o.finished for o in outs)
    res["bf16_syncs_per_step"] = counts["syncs"] / max(counts["steps"], 1)
    res["bf16_first_sync"] = counts.get("first_sync")
    graphs = llm.engine.runner.graphs
    res["decode_graphs"] = sorted(graphs.graphs) if graphs is not None else "off (see the log for why)"
    with_graphs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    del llm
    eager = LLM(str(path), device=check.device, dtype="bfloat16", enforce_eager=True)
    without = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy)]
    res["bf16_greedy_same_with_and_without_graphs"] = with_graphs == without
    return res


def throughput(check: Check) -> dict:
    """SmolLM2-shaped random weights, bf16: our engine vs `transformers` generate, same requests."""
    from transformers import AutoModelForCausalLM

    from unified.engine.llm import LLM
    from unified.engine.sampling_params import SamplingParams

    path = check.chat_checkpoint("tiny-chat") if check.dry else _smollm2_shaped(check)
    n, prompt_len, new = (4, 16, 8) if check.dry else (64, 128, 128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (prompt_len,), generator=g).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), device=check.device, dtype="bfloat16")
    llm.generate(prompts[:4], params)
    res = {}
    check.sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    check.sync()
    seconds = time.perf_counter() - start
    res["ours_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
    res["ours_batch1_decode_ms_per_token"] = _ms_per_token(llm, prompts[:1], params)
    del llm
    eager = LLM(str(path), device=check.device, dtype="bfloat16", enforce_eager=True)
    eager.generate(prompts[:1], params)
    res["ours_eager_batch1_decode_ms_per_token"] = _ms_per_token(eager, prompts[:1], params)
    del eager
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(check.device).eval()
    ids = torch.tensor(prompts, device=check.device)
    mask = torch.ones_like(ids)  # equal lengths: nothing is padded
    hf.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=4, do_sample=False)
    check.sync()
    start = time.perf_counter()
    hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    check.sync()
    res["transformers_tok_s"] = n * new / (time.perf_counter() - start)
    return res


def _ms_per_token(llm, prompts, params) -> float:
    start = time.perf_counter()
    one = llm.generate(prompts, params)
    return (time.perf_counter() - start) / len(one[0].outputs[0].token_ids) * 1e3


def cli(check: Check) -> dict:
    """The recipes end to end on the device, as a user runs them (each a subprocess, its exit code and tail)."""
    chat = check.chat_checkpoint("tiny-chat")
    sft_data = check.work / "sft.jsonl"
    sft_data.write_text("\n".join(json.dumps({"prompt": f"{a} + {a} =", "completion": f" {2 * a}"})
                                  for a in range(40)) + "\n")
    words = check.work / "words.jsonl"
    words.write_text("\n".join(json.dumps({"prompt": f"Say {w}.", "word": w}) for w in ("yes", "no", "maybe")))
    grpo = ["recipe=grpo", f"model={chat}", f"data={words}", "rlhf.reward=tests.rlhf.rewards_for_tests:says_the_word",
            "steps=2", "rlhf.prompts_per_step=2", "rlhf.max_tokens=8", "train.wandb=disabled"]
    runs = {
        "check_parity": ["recipe=check_parity", f"model={check.work / 'tiny-llama'}"],
        "demo": ["recipe=demo", f"model={chat}", "generation.max_new_tokens=16"],
        "sft": ["recipe=sft", f"model={chat}", f"data={sft_data}", f"output={check.work / 'sft'}", "steps=3",
                "train.micro_batch_size=4", "train.wandb=disabled"],
        "grpo_fp32": [*grpo, f"output={check.work / 'grpo_fp32'}", "device.dtype=float32"],
        "grpo_bf16": [*grpo, f"output={check.work / 'grpo_bf16'}", "device.dtype=bfloat16"],
    }
    res = {}
    for name, args in runs.items():
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "unified", f"device={check.device}", *args], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            res[f"{name}/rc"] = "timeout"
            continue
        res[f"{name}/rc"] = proc.returncode
        res[f"{name}/s"] = round(time.perf_counter() - start, 1)
        if proc.returncode:
            res[f"{name}/stderr"] = proc.stderr[-1500:]
        metrics = check.work / name / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        if name.startswith("grpo") and lines:
            last = json.loads(lines[-1])
            res[f"{name}/logp_diff_mean"] = last.get("sampling/sampling_logp_difference/mean")
            res[f"{name}/logp_diff_max"] = last.get("sampling/sampling_logp_difference/max")
        check.save({"cli": res})  # so far: a run cut short still tells what finished
    return res


QUICK = ("env", "triton", "engine")
SECTIONS = {"env": env, "kernels": kernels, "triton": triton_kernels, "parity": parity, "engine": engine, "throughput": throughput, "cli": cli}


# ---------------------------------------------------------------------------------------------- helpers

def _smollm2_shaped(check: Check) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = check.work / "smollm2-shaped"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                             rope_theta=100000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
        LlamaForCausalLM(config).save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(check.tokenizer / name, path / name)
    return path


def _where(warning) -> str:
    return f"{Path(warning.filename).name}:{warning.lineno}"


def _short(error: BaseException) -> str:
    tb = traceback.extract_tb(error.__traceback__)
    frames = [f"{Path(f.filename).name}:{f.lineno}" for f in tb if "unified" in f.filename or "bench" in f.filename]
    return f"{type(error).__name__}: {str(error)[:400]} @ {' <- '.join(reversed(frames[-4:]))}"


@contextlib.contextmanager
def _time_limit(seconds: int):
    def expire(*_):
        raise TimeoutError(f"section over its {seconds} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"))
    parser.add_argument("--dry-run", action="store_true", help="every section on this CPU, tiny sizes")
    parser.add_argument("--quick", action="store_true", help=f"only {','.join(QUICK)}, small sizes (~2 minutes)")
    parser.add_argument("--only", default=None, help="comma-separated sections (default: all)")
    parser.add_argument("--tokenizer", default=str(ROOT / ".whl" / "tokenizer"))
    parser.add_argument("--section-limit", type=int, default=150, help="seconds per section")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.dry_run else "cuda")
    check = Check(args)
    check.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in (args.only or ",".join(QUICK if args.quick else SECTIONS)).split(","):
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            with _time_limit(args.section_limit):
                check.results[name] = SECTIONS[name](check)
            if check.device == "cuda":
                check.results[name]["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        except Exception as error:  # noqa: BLE001 - record and go on to the next section
            traceback.print_exc()
            check.results[name] = {"error": _short(error)}
            failed += 1
        check.results[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(check.results[name], indent=1, default=str), flush=True)
        check.save()
    print("\n== summary")
    for name, result in check.results.items():
        print(f"{name:<12} {'FAILED' if 'error' in result else 'ok':<8} {result['seconds']:>7} s")
    shutil.rmtree(check.work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
