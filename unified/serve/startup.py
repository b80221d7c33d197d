"""Two-phase start-up: the port is bound at once, the model comes up on a background thread.

Phase one (`loading_weights`) starts the runtime, resolves the model and fills its weights; phase two
(`warming_up`) builds the engine (weight packing, KV-cache sizing) and runs representative batch shapes
through it. Progress is kept here for `/health` and the playground; a failure is kept with its message
so the server reports it instead of dying silently.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class Progress:
    done: int = 0
    total: int = 0

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total


@dataclass
class Startup:
    phase: str = "loading_weights"  # loading_weights -> warming_up -> ready | failed
    weights: Progress = field(default_factory=Progress)
    warmup: Progress = field(default_factory=Progress)
    message: str = "starting the runtime and reading the checkpoint"
    loop: object = None  # the EngineLoop, once ready

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def report(self) -> dict:
        progress = {name: {"done": p.done, "total": p.total} for name, p in
                    (("weights", self.weights), ("warmup", self.warmup)) if p.total}
        return {"status": "ready" if self.ready else "starting", "phase": self.phase, "progress": progress,
                "message": self.message}

    def start(self, cfg, on_step) -> threading.Thread:
        thread = threading.Thread(target=self._bring_up, args=(cfg, on_step), name="startup", daemon=True)
        thread.start()
        return thread

    def _bring_up(self, cfg, on_step) -> None:
        from unified.engine.llm import build_engine
        from unified.errors import UserError
        from unified.serve.async_engine import EngineLoop

        try:
            engine = build_engine(cfg.model, cfg.device, cfg.parallel, cfg.engine, cfg.seed, self.weights)
            self.phase, self.message = "warming_up", "running representative batch shapes"
            if cfg.serve.warm_up:
                engine.warm_up(self.warmup)
            loop = EngineLoop(engine, on_step)
            loop.start()
            self.loop = loop
            self.phase, self.message = "ready", "ready"
            log.info("ready: %s", Path(str(cfg.model)).name)
        except UserError as err:
            self.phase, self.message = "failed", str(err)
            log.error("start-up failed: %s", err)
        except Exception as err:  # noqa: BLE001 - reported through /health; the log keeps the traceback
            self.phase, self.message = "failed", f"{type(err).__name__}: {err}"
            log.exception("start-up failed")
