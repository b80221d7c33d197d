"""`recipe=grpo` and `recipe=ppo`: the engine's rollouts and DeepSpeed's updates, then where the model is."""
from __future__ import annotations


def run(cfg) -> None:
    from unified.rlhf.run import run_rlhf

    history = run_rlhf(cfg)
    if not history:  # a rollout rank of a separate run: the trainer reports
        return
    last = history[-1]
    held_out = f", held-out reward {last['eval/reward']:.3f}" if "eval/reward" in last else ""
    print(f"trained {last['step']} {cfg.rlhf.algorithm.upper()} steps, reward {last['reward']:.3f}{held_out}; "
          f"serve it with: unified recipe=serve model={cfg.output}")
