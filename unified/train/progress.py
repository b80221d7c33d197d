"""What a training run reports: a console bar (loss, tokens/s, ETA), `metrics.jsonl`, wandb, and a
loss-curve PNG next to the checkpoints. Rank 0 reports; the other ranks stay quiet.

wandb runs offline by default (its files go under `<output>/wandb`, `wandb sync` uploads them later);
`train.wandb=online` logs live when the user has credentials, `disabled` turns it off.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    step: int  # 1-based: the number of optimizer steps done
    loss: float
    lr: float
    grad_norm: float | None
    tokens: int  # tokens (padding excluded) in the step, over all data-parallel ranks
    seconds: float


def read_metrics(path: Path) -> list[dict]:
    """The readable lines of a metrics.jsonl (a line cut short by a crash ends the readable history)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def read_steps(path: Path) -> list[StepRecord]:
    """A fine-tuning run's metrics.jsonl, step by step."""
    return [StepRecord(**r) for r in read_metrics(path)]


class MetricsSink:
    """`<output>/metrics.jsonl` and wandb, for any recipe's per-step dicts (each with its "step"). A resumed run
    keeps the history up to its checkpoint and drops the steps that were lost with the crash."""

    def __init__(self, output: Path, start_step: int, wandb_mode: str, wandb_project: str, run_config: dict):
        self.path = output / "metrics.jsonl"
        self.history = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=wandb_project, mode=wandb_mode, dir=str(output), config=run_config,
                                     resume="allow")

    def write(self, record: dict) -> None:
        self.history.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


class TrainLog:
    def __init__(self, output: Path, total_steps: int, start_step: int, enabled: bool, wandb_mode: str,
                 wandb_project: str, run_config: dict):
        self.enabled = enabled
        self.plot_path = output / "loss_curve.png"
        self.history: list[StepRecord] = []
        self._bar = self._sink = None
        if not enabled:
            return
        self._sink = MetricsSink(output, start_step, wandb_mode, wandb_project, run_config)
        self.history = [StepRecord(**r) for r in self._sink.history]
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def step(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        self.history.append(record)
        self._sink.write(asdict(record))
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{record.loss:.4f}", tok_s=f"{record.tokens / max(record.seconds, 1e-9):,.0f}",
                              lr=f"{record.lr:.2e}")

    def plot(self) -> None:
        if not self.enabled or not self.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r.step for r in self.history], [r.loss for r in self.history])
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=100)
        plt.close(fig)

    def close(self) -> None:
        if not self.enabled:
            return
        self.plot()
        self._bar.close()
        self._sink.close()
