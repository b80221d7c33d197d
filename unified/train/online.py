"""`recipe=online`: learn from served traffic, check, and hot-swap into the running server.

1. Read the server's conversation log (`data=`); the conversations users accepted become training
   examples (each accepted reply as the assistant turn).
2. Fine-tune the served model (`model=`) on them with LoRA (the `train` config), into `<output>/candidate`
   (merged, servable; the adapter beside it).
3. Gate the candidate against the current model, by teacher-forced logits on both sets:
   - untouched behaviour: on a held-back set (`online.heldout`, or else the logged conversations nobody
     rated) the mean cosine of the candidate's logits with the current model's must stay at or above
     `online.min_parity_cosine`;
   - improvement: on the accepted replies, the candidate's negative log-likelihood per token must be lower
     by at least `online.min_improvement` nats.
4. If both hold and `online.server` is set, ask the server to load the candidate
   (`POST /v1/admin/reload_weights`); it swaps between engine steps without dropping requests. If the
   gate fails, nothing is swapped and the report says which check failed and by how much.
The report goes to `<output>/gate.json`.
"""
from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from unified.errors import UserError
from unified.jsonl import jsonl_lines

log = logging.getLogger(__name__)


@dataclass
class GateReport:
    parity_cosine: float  # mean over held-back positions, candidate vs current
    current_nll: float  # nats per accepted-reply token
    candidate_nll: float
    min_parity_cosine: float
    min_improvement: float
    held_back: int  # conversations in each set
    accepted: int

    @property
    def failures(self) -> list[str]:
        out = []
        if self.parity_cosine < self.min_parity_cosine:
            out.append(f"untouched behaviour moved: logits cosine {self.parity_cosine:.5f} on {self.held_back} held-back "
                       f"conversations is below online.min_parity_cosine={self.min_parity_cosine}")
        gain = self.current_nll - self.candidate_nll
        if gain < self.min_improvement:
            out.append(f"too little improvement: accepted replies cost {self.candidate_nll:.4f} nats/token, "
                       f"{gain:+.4f} against the current model's {self.current_nll:.4f}; online.min_improvement="
                       f"{self.min_improvement}")
        return out


def _conversation(record: dict) -> list[dict]:
    return record["messages"] + [record["choices"][0]["message"]]


def _has_images(record: dict) -> bool:
    return any(isinstance(m["content"], list) and any(part.get("type") != "text" for part in m["content"])
               for m in record["messages"])


def split_log(path: str | Path) -> tuple[list[list[dict]], list[list[dict]]]:
    """(accepted conversations, conversations without feedback), each ending with the served reply.
    Conversations with images are left out: the log keeps a hash of each image, not the picture."""
    from unified.conversations import read_conversations

    records = [r for r in read_conversations(path) if r.get("choices")]
    with_images = sum(map(_has_images, records))
    if with_images:
        log.warning("%s: %d conversations with images left out (the log keeps their hashes, not the pictures)",
                    path, with_images)
        records = [r for r in records if not _has_images(r)]
    accepted = [_conversation(r) for r in records if (r.get("feedback") or {}).get("accepted") is True]
    unrated = [_conversation(r) for r in records if r.get("feedback") is None]
    return accepted, unrated


def _read_heldout(path: str | Path) -> list[list[dict]]:
    from unified.train.data import BadLine, check_messages

    conversations = []
    for lineno, line in enumerate(jsonl_lines(Path(path).read_text()), start=1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            check_messages(messages)
        except (json.JSONDecodeError, KeyError, TypeError, BadLine) as err:
            raise UserError(f"online.heldout {path}:{lineno}: {err}; each line needs \"messages\" ending with an "
                            f"assistant reply") from None
        conversations.append(messages)
    return conversations


def _usable(tokenizer, conversations: list[list[dict]], kind: str) -> list[list[dict]]:
    """The conversations the model's chat template can render with their replies located; the others are named
    and left out of training and of the gate alike."""
    from unified.train.data import BadLine, chat_example

    kept = []
    for number, messages in enumerate(conversations, start=1):
        try:
            chat_example(tokenizer, messages)
        except BadLine as err:
            log.warning("%s conversation %d left out: %s", kind, number, err)
            continue
        kept.append(messages)
    return kept


@torch.no_grad()
def _teacher_forced(model, tokenizer, conversations: list[list[dict]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per conversation: (logits predicting each assistant token [N, V], those tokens [N])."""
    from unified.train.data import IGNORE, chat_example

    out = []
    for messages in conversations:
        example = chat_example(tokenizer, messages)
        ids = torch.tensor([example.input_ids])
        targets = torch.tensor(example.labels[1:] + [IGNORE])
        keep = targets != IGNORE
        hidden = model(ids, torch.arange(ids.shape[1]))[0]  # [S, H]
        out.append((model.logits(hidden[keep]).float(), targets[keep]))
    return out


def gate(current, candidate, tokenizer, accepted, held_back, cfg) -> GateReport:
    def nll(scored):
        total = sum(torch.nn.functional.cross_entropy(logits, targets, reduction="sum") for logits, targets in scored)
        return float(total) / sum(len(targets) for _, targets in scored)

    now, new = _teacher_forced(current, tokenizer, held_back), _teacher_forced(candidate, tokenizer, held_back)
    cosines = torch.cat([torch.nn.functional.cosine_similarity(a, b, dim=-1) for (a, _), (b, _) in zip(now, new)])
    return GateReport(float(cosines.mean()), nll(_teacher_forced(current, tokenizer, accepted)),
                      nll(_teacher_forced(candidate, tokenizer, accepted)), cfg.min_parity_cosine, cfg.min_improvement,
                      len(held_back), len(accepted))


def reload_server(url: str, checkpoint: Path, api_key_env: str) -> dict:
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/admin/reload_weights", method="POST",
                                     data=json.dumps({"path": str(checkpoint.absolute())}).encode(),
                                     headers={"Content-Type": "application/json"})
    if os.environ.get(api_key_env):
        request.add_header("Authorization", f"Bearer {os.environ[api_key_env]}")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise UserError(f"the server at {url} refused the new weights ({err.code}): {err.read().decode()[:500]}") from None
    except urllib.error.URLError as err:
        raise UserError(f"cannot reach the server at {url} ({err.reason}); the gated candidate is in {checkpoint}, "
                        f"reload it later with POST /v1/admin/reload_weights") from None


def run_online(cfg) -> tuple[GateReport, dict | None]:
    """Returns the gate report and the server's answer to the reload (None when nothing was swapped)."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from unified.checkpoint import load_model
    from unified.checkpoint.builtin import resolve_model
    from unified.train.trainer import train

    if not cfg.data or not cfg.output:
        raise UserError("online learning needs data=<the server's conversation log> and output=<dir>")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("online learning trains, gates and swaps from one process; run it without a launcher")
    output = Path(cfg.output)
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    accepted, unrated = split_log(cfg.data)
    held_back = _read_heldout(cfg.online.heldout) if cfg.online.heldout else unrated
    accepted, held_back = _usable(tokenizer, accepted, "accepted"), _usable(tokenizer, held_back, "held-back")
    if not accepted:
        raise UserError(f"{cfg.data} holds no accepted conversations to learn from; rate some with POST /v1/feedback")
    if not held_back:
        raise UserError("no held-back conversations to check untouched behaviour on: give online.heldout=<jsonl> "
                        "or leave some logged conversations unrated")
    output.mkdir(parents=True, exist_ok=True)
    data = output / "accepted.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in accepted))
    log.info("%d accepted conversations to learn from, %d held back", len(accepted), len(held_back))

    train_cfg = OmegaConf.merge(cfg, {"data": str(data), "output": str(output / "candidate")})
    result = train(train_cfg)

    report = gate(load_model(path).model, load_model(result.output).model, tokenizer, accepted, held_back, cfg.online)
    (output / "gate.json").write_text(json.dumps({**asdict(report), "failures": report.failures}, indent=2) + "\n")
    if report.failures or not cfg.online.server:
        return report, None
    return report, reload_server(cfg.online.server, result.output, cfg.serve.api_key_env)
