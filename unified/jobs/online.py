"""`recipe=online`: fine-tune on accepted served conversations, gate, hot-swap (see unified.train.online)."""
from __future__ import annotations


def run(cfg) -> None:
    from unified.train.online import run_online

    report, reloaded = run_online(cfg)
    print(f"gate: logits cosine {report.parity_cosine:.5f} on {report.held_back} held-back conversations; accepted "
          f"replies {report.current_nll:.4f} -> {report.candidate_nll:.4f} nats/token")
    if report.failures:
        print("gate failed, the served weights stay as they are:\n  " + "\n  ".join(report.failures))
        raise SystemExit(1)
    if reloaded is None:
        print(f"gate passed; the candidate is in {cfg.output}/candidate (no online.server given, nothing swapped)")
    else:
        print(f"gate passed; the server now serves weights version {reloaded['weights_version']}")
