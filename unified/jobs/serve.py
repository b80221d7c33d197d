"""`unified recipe=serve host=127.0.0.1 port=8000 [model=<dir>]`: the OpenAI-compatible HTTP server."""
from __future__ import annotations


def run(cfg) -> None:
    from unified.serve.server import serve

    serve(cfg)
