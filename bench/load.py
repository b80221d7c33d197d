"""Loading a checkpoint of over 1 GB: pre-sharded files against the HF folder against `transformers`.

Builds a Llama-shaped checkpoint with random float32 weights in a temporary folder (about 1.2 GB by default,
sharded with an index as HF ships them), pre-shards it for tensor parallel N (`recipe=convert`'s function,
in a child process whose peak anonymous memory is sampled), then starts N ranks (gloo, one process each) that load it
one rank at a time (so that each rank's bytes and seconds are its own), each way with the page cache cold
(posix_fadvise(POSIX_FADV_DONTNEED) on every file first) and warm:
- `hf`: load_model on the HF folder (each rank reads its slices through lazy safetensors views),
- `presharded` (with and without checksums): load_model on the pre-sharded folder (each rank maps its file),
- `sequential read`: each rank reads its own pre-sharded file start to end in 16 MiB reads into one reused
  buffer (the storage's ceiling);
- `sequential read into new memory`: the same reads into one freshly allocated tensor the size of the file, whose
  pages fault in as they are written, as a load's parameters do (the ceiling for a load; the percentages).
Each (way, cache, rank) runs `--repeats` times; the table shows the median. The ranks run with glibc's mmap
threshold fixed at 128 KiB, so that every run's parameters are fresh pages, as in a process's first load.
Per rank: bytes read from storage (/proc/self/io read_bytes, cold runs only: warm reads come from the page
cache), the bytes its slices hold, seconds, and GB/s over its file's bytes. Then `transformers`'
from_pretrained of the whole model in one process. Prints a markdown table.

    .venv/bin/python bench/load.py [--ranks 2] [--hidden 1536] [--layers 8] [--repeats 3] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def build_checkpoint(path: Path, hidden: int, layers: int, vocab: int = 32000) -> int:
    from transformers import LlamaConfig

    from unified.checkpoint.safetensors_io import save_safetensors

    inter, heads = hidden * 8 // 3 // 256 * 256, hidden // 128
    kv_heads = 4 if heads % 4 == 0 else 2
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False)
    config.save_pretrained(path)
    kv = kv_heads * 128
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
    tensors = {name: torch.randn(shape) * 0.02 for name, shape in shapes.items()}
    save_safetensors(tensors, path, max_shard_bytes=512 * 2 ** 20)
    return sum(t.numel() * 4 for t in tensors.values())


def drop_cache(folders: list[Path]) -> None:
    os.sync()
    for folder in folders:
        for path in folder.iterdir():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


CHUNK = 16 * 2 ** 20


def sequential_read(path: Path) -> None:
    buffer = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


def sequential_read_into_new_memory(path: Path) -> torch.Tensor:
    size = path.stat().st_size
    destination = torch.empty(size, dtype=torch.uint8)
    view = memoryview(destination.numpy())
    with open(path, "rb", buffering=0) as f:
        for start in range(0, size, CHUNK):
            f.readinto(view[start:start + CHUNK])
    return destination


def slice_bytes(hf: Path) -> int:
    """The bytes of this rank's slices of the HF tensors (what it has to read at the least)."""
    from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from unified.checkpoint.hf_names import parameter_map
    from unified.checkpoint.loader import current_shard, param_sources
    from unified.checkpoint.safetensors_io import SafetensorsCheckpoint

    ckpt, shard = SafetensorsCheckpoint(hf), current_shard()
    total = 0
    for param in parameter_map(model_config_from_hf(read_hf_config(hf))):
        for row in param_sources(ckpt, param, shard):
            for part in row:
                shape = list(ckpt.shape(part.name))
                if part.dim is not None:
                    shape[part.dim] = part.length
                total += torch.Size(shape).numel() * 4
    return total


def rank_main(rank: int, ranks: int, port: int, hf: Path, presharded: Path, out: Path, repeats: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from unified.checkpoint import load_model
    from unified.checkpoint.manifest import shard_file
    from unified.runtime import Layout, init_distributed, select_accelerator

    init_distributed(select_accelerator("cpu"), Layout(tensor=ranks))
    dist = torch.distributed
    own = presharded / shard_file(0, ps.get_tensor_model_parallel_rank(), 0)
    runs = {"hf": lambda: load_model(hf), "presharded": lambda: load_model(presharded),
            "presharded, no checksums": lambda: load_model(presharded, verify_checksums=False),
            "sequential read": lambda: sequential_read(own),
            "sequential read into new memory": lambda: sequential_read_into_new_memory(own)}
    runs["presharded, no checksums"]()  # first-call costs (imports, kernels), not measured
    rows = []
    for cache in ("cold", "warm"):
        for name, run in runs.items():
            for turn in range(ranks):  # one rank at a time: its own bytes from storage and its own time
                times, stored = [], []
                for _ in range(repeats):
                    if cache == "cold" and rank == 0:
                        drop_cache([hf, presharded])
                    dist.barrier()
                    if rank == turn:
                        before, start = read_bytes(), time.perf_counter()
                        result = run()
                        times.append(time.perf_counter() - start)
                        del result
                        stored.append(read_bytes() - before)
                    dist.barrier()
                if rank == turn:
                    rows.append({"way": name, "cache": cache, "rank": rank, "seconds": statistics.median(times),
                                 "storage_bytes": statistics.median(stored) if cache == "cold" else None})
    rows.append({"rank": rank, "slice_bytes": slice_bytes(hf), "own_file": own.stat().st_size})
    gathered = [None] * ranks
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        out.write_text(json.dumps(gathered))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def convert_child(hf: Path, presharded: Path, ranks: int, queue) -> None:
    from unified.checkpoint.presharded import convert_to_presharded
    from unified.runtime.layout import Layout

    import threading

    before, peak, done = status_kib("RssAnon"), [0], threading.Event()

    def sample() -> None:  # anonymous memory (what the process allocates; mapped file pages are the page cache's)
        while not done.wait(0.005):
            peak[0] = max(peak[0], status_kib("RssAnon"))

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    convert_to_presharded(hf, presharded, Layout(tensor=ranks), log=lambda *_: None)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    queue.put((seconds, before, peak[0], status_kib("VmHWM")))


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def transformers_load(hf: Path) -> list[tuple[str, float]]:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)  # first-call costs, not measured
    out = []
    for cache in ("cold", "warm"):
        if cache == "cold":
            drop_cache([hf])
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        out.append((cache, time.perf_counter() - start))
        del model
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way per cache state and rank (median)")
    parser.add_argument("--dir", default=None, help="where the temporary checkpoints go (default: the temp folder)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="unified-load-bench-", dir=args.dir))
    try:
        hf, presharded = work / "hf", work / "presharded"
        whole = build_checkpoint(hf, args.hidden, args.layers)
        context = mp.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=convert_child, args=(hf, presharded, args.ranks, queue))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"the conversion failed (exit status {child.exitcode}); see above")
        convert_s, rss_before, rss_peak, hwm = queue.get()
        out = work / "ranks.json"
        # Every destination page fresh in every way and run: glibc would otherwise serve a load's parameters
        # (under its adaptive threshold, up to 32 MiB each) from the heap the previous run's model freed.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 2 ** 10)
        mp.start_processes(rank_main, args=(args.ranks, 29400 + os.getpid() % 500, hf, presharded, out, args.repeats),
                           nprocs=args.ranks, start_method="spawn")
        ranks = json.loads(out.read_text())
        hf_transformers = transformers_load(hf)
        report(args, whole, hf, presharded, convert_s, rss_before, rss_peak, hwm, ranks, hf_transformers)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(args, whole, hf, presharded, convert_s, rss_before, rss_peak, hwm, ranks, hf_transformers) -> None:
    gb = 1e9
    hf_files = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    print(f"checkpoint: Llama-shaped, hidden {args.hidden}, {args.layers} layers, float32: {whole / gb:.2f} GB of "
          f"tensors in {len(list(hf.glob('*.safetensors')))} HF files; pre-sharded for tensor parallel {args.ranks}: "
          f"{sum(p.stat().st_size for p in presharded.glob('shard-*')) / gb:.2f} GB in {args.ranks} files")
    print(f"conversion (one process): {convert_s:.1f} s; peak anonymous memory {(rss_peak - rss_before) / 2 ** 10:.0f} "
          f"MiB above the process before converting (sampled every 5 ms); peak resident {hwm / 2 ** 10:.0f} MiB "
          f"including the source's memory-mapped pages")
    print(f"page cache: cold = posix_fadvise(POSIX_FADV_DONTNEED) on every file before the run; warm = right after it\n")
    print("| way | cache | rank | seconds | read from storage (GB) | its slices (GB) | own file (GB) | GB/s over own file |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    sequential = {}
    for per_rank in ranks:
        info = per_rank[-1]
        for row in per_rank[:-1]:
            if row["way"] == "sequential read into new memory":
                sequential[row["cache"], row["rank"]] = row["seconds"]
    for per_rank in ranks:
        info = per_rank[-1]
        for row in per_rank[:-1]:
            stored = "" if row["storage_bytes"] is None else f"{row['storage_bytes'] / gb:.3f}"
            rate = info["own_file"] / row["seconds"] / gb
            share = ""
            if row["way"].startswith("presharded"):
                share = f" ({sequential[row['cache'], row['rank']] / row['seconds']:.0%} of sequential into new memory)"
            print(f"| {row['way']} | {row['cache']} | {row['rank']} | {row['seconds']:.2f} | {stored} | "
                  f"{info['slice_bytes'] / gb:.3f} | {info['own_file'] / gb:.3f} | {rate:.2f}{share} |")
    for cache, seconds in hf_transformers:
        print(f"| transformers from_pretrained (whole model, 1 process) | {cache} | - | {seconds:.2f} | | | "
              f"{hf_files / gb:.3f} (all HF files) | {hf_files / seconds / gb:.2f} |")


if __name__ == "__main__":
    main()
