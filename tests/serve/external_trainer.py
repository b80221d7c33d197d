"""An RL trainer of the kind teams write against SGLang, driving a rollout server (`unified recipe=rollout`).

It uses torch.distributed, transformers and urllib only: nothing of unified is imported. Each step it
generates from the server with logprobs and token ids, checks them against its own forward of the same
tokens, takes an optimizer step and pushes the new weights (over an update group, or through a
checkpoint on disk), then checks that the server now samples the updated policy. It prints one JSON line
per step and exits 0 when every check held.

    python external_trainer.py --url http://127.0.0.1:8000 --model <hf dir> --model-name <served name>
                               --mode distributed|disk --steps 2 [--scratch <dir>] [--server-ranks N]
"""
from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import threading
import urllib.error
import urllib.request

import torch
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous
from transformers import AutoModelForCausalLM

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7]
GROUP = "weight_update_group"


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def post_in_background(url: str, body: dict) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(post(url, body)))
    thread.start()
    return thread, result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_update_group(url: str, world_size: int) -> object:
    """SGLang's custom group: a TCP store this trainer hosts as rank 0, the group's keys under its name."""
    port = free_port()
    thread, result = post_in_background(url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size,
        "group_name": GROUP, "backend": "gloo"})
    timeout = datetime.timedelta(seconds=60)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout))
    group, _ = _new_process_group_helper(world_size, 0, [], "gloo", PrefixStore(GROUP, store), group_name=GROUP,
                                         timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group ranks are this group's own
    thread.join()
    status, body = result[0]
    assert status == 200 and body["success"], body
    return group


def push_distributed(url: str, model, group, version: str) -> dict:
    state = model.state_dict()
    names = list(state)
    thread, result = post_in_background(url + "/update_weights_from_distributed", {
        "names": names, "dtypes": [str(state[n].dtype) for n in names], "shapes": [list(state[n].shape) for n in names],
        "group_name": GROUP, "flush_cache": True, "weight_version": version})
    for name in names:
        torch.distributed.broadcast(state[name].contiguous(), group_src=0, group=group)
    thread.join()
    return result[0][1]


def generate(url: str, model_name: str) -> tuple[list[int], list[float], str]:
    status, body = post(url + "/v1/completions", {
        "model": model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT, choice
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], body


def own_logprobs(model, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + tokens])
    logits = model(input_ids=ids).logits[0, len(PROMPT) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--mode", choices=["distributed", "disk"], required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--scratch", help="where --mode disk writes its checkpoints")
    parser.add_argument("--server-ranks", type=int, default=1, help="the server's ranks (its tensor parallel size)")
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    group = join_update_group(args.url, 1 + args.server_ranks) if args.mode == "distributed" else None

    def push(step: int) -> dict:
        version = f"policy-{step}"
        if group is not None:
            return push_distributed(args.url, model, group, version)
        model.save_pretrained(f"{args.scratch}/step-{step}")
        return post(args.url + "/update_weights_from_disk",
                    {"model_path": f"{args.scratch}/step-{step}", "weight_version": version})[1]

    answer = push(0)  # the server starts from the trainer's weights, whatever it served before
    assert answer["success"], answer
    tokens, served, _ = generate(args.url, args.model_name)
    with torch.no_grad():
        gap = (own_logprobs(model, tokens) - torch.tensor(served)).abs().max().item()
    assert gap <= 1e-5, f"before training the server's logprobs differ from the trainer's by {gap}"
    for step in range(1, args.steps + 1):
        loss = -own_logprobs(model, tokens).mean()  # make the sampled answer likelier: a policy-gradient step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        answer = push(step)
        assert answer["success"], answer
        before = served
        tokens, served, _ = generate(args.url, args.model_name)
        with torch.no_grad():
            gap = (own_logprobs(model, tokens) - torch.tensor(served)).abs().max().item()
        moved = abs(served[0] - before[0])
        print(json.dumps({"step": step, "max_gap": gap, "first_logprob_moved": moved,
                          "weight_version": answer.get("weight_version")}), flush=True)
        assert gap <= 1e-5, f"step {step}: the server's logprobs differ from the updated trainer's by {gap}"
        assert moved > 1e-4, f"step {step}: the server's logprobs did not change with the update"
    if group is not None:
        status, answer = post(args.url + "/destroy_weights_update_group", {"group_name": GROUP})
        assert status == 200 and answer["success"], answer


if __name__ == "__main__":
    sys.exit(main())
