"""Rollout server weight sync and sleep: update_weights_from_distributed against a plain gloo broadcast, one run.

    .venv/bin/python bench/rollout_server.py [--updates 5]
    .venv/bin/python bench/rollout_server.py --quick   # tiny random Llama, 2 updates: a smoke test

Ours: `unified recipe=rollout` as a subprocess on a free loopback port; this script is the external trainer
(tests/serve/external_trainer.py): it joins the server's update group over gloo as rank 0 and pushes the HF
model's state_dict (SmolLM2-135M-Instruct, fp32), one broadcast per tensor, while the POST
/update_weights_from_distributed runs in a thread. An update lasts from just before the POST is sent to its
answer, so the server's checks and writes into its weights count. The peer: the same tensors, same order,
one broadcast each, from this process to a second plain process over gloo that receives into preallocated
buffers; a repetition lasts from a barrier before the first broadcast to a barrier after the last.
Ours and the peer alternate, each with one untimed warm-up first; medians are reported. GB/s is bytes of
the state_dict (tied tensors counted each time they are sent) over seconds. Then --sleep-cycles of POST
/sleep?level=1 and /wake_up, each timed to its answer.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

from train import tiny_model

ROOT = Path(__file__).resolve().parent.parent
GROUP = "weight_update_group"
TIMEOUT = datetime.timedelta(seconds=600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url, json.dumps(body or {}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


def post_in_background(url: str, body: dict) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(post(url, body)))
    thread.start()
    return thread, result


def start_server(path: Path, folder: Path) -> tuple[subprocess.Popen, str]:
    port, log = free_port(), folder / "server.log"
    command = [sys.executable, "-m", "unified", "recipe=rollout", f"model={path}", f"port={port}",
               "serve.warm_up=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UNIFIED_API_KEY": ""}
    proc = subprocess.Popen(command, env=env, cwd=folder, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise TimeoutError(f"the server was not healthy within 600 s:\n{log.read_text()[-3000:]}")


def join_update_group(url: str):
    port = free_port()
    thread, result = post_in_background(url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": GROUP, "backend": "gloo"})
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=TIMEOUT))
    group, _ = _new_process_group_helper(2, 0, [], "gloo", PrefixStore(GROUP, store), group_name=GROUP,
                                         timeout=TIMEOUT)
    _world.pg_group_ranks[group] = {0: 0, 1: 1}
    thread.join()
    assert result and result[0]["success"], result
    return group


def timed_update(url: str, state: dict[str, torch.Tensor], group) -> float:
    names = list(state)
    body = {"names": names, "dtypes": [str(state[n].dtype) for n in names],
            "shapes": [list(state[n].shape) for n in names], "group_name": GROUP, "flush_cache": True}
    start = time.perf_counter()
    thread, result = post_in_background(url + "/update_weights_from_distributed", body)
    for name in names:
        dist.broadcast(state[name], group_src=0, group=group)
    thread.join()
    seconds = time.perf_counter() - start
    assert result and result[0]["success"], result
    return seconds


def peer_receiver(port: int, shapes: list[list[int]], dtypes: list[torch.dtype], repetitions: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=TIMEOUT)
    buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
    for _ in range(repetitions):
        dist.barrier()
        for buffer in buffers:
            dist.broadcast(buffer, src=0)
        dist.barrier()
    dist.destroy_process_group()


def timed_broadcast(tensors: list[torch.Tensor]) -> float:
    dist.barrier()
    start = time.perf_counter()
    for tensor in tensors:
        dist.broadcast(tensor, src=0)
    dist.barrier()
    return time.perf_counter() - start


def start_peer(state: dict[str, torch.Tensor], repetitions: int) -> mp.Process:
    port = free_port()
    receiver = mp.get_context("spawn").Process(target=peer_receiver, args=(
        port, [list(t.shape) for t in state.values()], [t.dtype for t in state.values()], repetitions))
    receiver.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=TIMEOUT)
    return receiver


def sleep_cycles(url: str, cycles: int) -> tuple[list[float], list[float], dict]:
    asleep, awake, freed = [], [], {}
    for _ in range(cycles):
        start = time.perf_counter()
        answer = post(url + "/sleep?level=1")
        asleep.append(time.perf_counter() - start)
        assert answer["success"] and "freed" in answer, answer
        freed = answer["freed"]
        start = time.perf_counter()
        answer = post(url + "/wake_up")
        awake.append(time.perf_counter() - start)
        assert answer["success"], answer
    return asleep, awake, freed


def table(size: int, ours: list[float], peer: list[float], asleep: list[float], awake: list[float]) -> str:
    ours_s, peer_s = statistics.median(ours), statistics.median(peer)
    rows = ["| | seconds (median) | GB/s | runs (s) |", "| --- | ---: | ---: | --- |"]
    for label, median, runs in (("ours: update_weights_from_distributed", ours_s, ours),
                                ("peer: plain gloo broadcast, 2 processes", peer_s, peer)):
        rows.append(f"| {label} | {median:.3f} | {size / median / 1e9:.2f} | {', '.join(f'{r:.3f}' for r in runs)} |")
    rows.append(f"| ours / peer (GB/s; target >= 80%) | | {peer_s / ours_s:.0%} | |")
    for label, runs in (("POST /sleep?level=1", asleep), ("POST /wake_up", awake)):
        rows.append(f"| {label} | {statistics.median(runs):.3f} | | {', '.join(f'{r:.3f}' for r in runs)} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=5, help="timed updates (and peer repetitions) after a warm-up")
    parser.add_argument("--sleep-cycles", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny random Llama, 2 updates: a smoke test")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from unified.checkpoint.builtin import resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.quick:
            args.updates, path, name = 2, tiny_model(folder / "tiny"), "a tiny random Llama"
        else:
            path, name = resolve_model("smollm2"), "SmolLM2-135M-Instruct"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        state = {n: t.contiguous() for n, t in model.state_dict().items()}
        size = sum(t.numel() * t.element_size() for t in state.values())
        server, url = start_server(path, folder)
        try:
            group = join_update_group(url)
            receiver = start_peer(state, args.updates + 1)
            ours, peer = [], []
            for _ in range(args.updates + 1):
                ours.append(timed_update(url, state, group))
                peer.append(timed_broadcast(list(state.values())))
            receiver.join()
            dist.destroy_process_group()
            asleep, awake, freed = sleep_cycles(url, args.sleep_cycles)
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"\nRollout server weight sync on {name}: {len(state)} tensors, {size / 1e6:.1f} MB fp32 state_dict, gloo "
          f"on CPU, {torch.get_num_threads()} threads; medians of {args.updates} timed updates after a warm-up, "
          f"{args.sleep_cycles} sleep cycles; {datetime.date.today()}\n")
    print(table(size, ours[1:], peer[1:], asleep, awake))
    print(f"\nfreed by /sleep?level=1: {freed} ({sum(freed.values()) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
