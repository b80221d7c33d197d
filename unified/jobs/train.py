"""`recipe=sft` / `recipe=lora`: fine-tune, then print where the servable model is."""
from __future__ import annotations


def run(cfg) -> None:
    import torch

    from unified.train.trainer import train

    result = train(cfg)
    if torch.distributed.get_rank() == 0 and result.history:
        last = result.history[-1]
        print(f"trained {last.step} steps, final loss {last.loss:.4f}; serve it with: "
              f"unified recipe=serve model={result.output}")
