"""`unified recipe=serve host=127.0.0.1 port=8000 [model=<dir>]`: the OpenAI-compatible HTTP server.

Under a launcher, global rank 0 serves HTTP and drives the engine; the other ranks only follow its steps.
"""
from __future__ import annotations

import os


def run(cfg) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        from unified.engine.llm import LLM

        LLM.from_run_config(cfg)  # follows the driver's steps, then ends the process
        return
    from unified.serve.server import serve

    serve(cfg)
