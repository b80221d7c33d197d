"""Answering an asyncio future from a worker thread (the engine thread, the conversation-log writer)."""
from __future__ import annotations

import asyncio


def settle_from_thread(loop: asyncio.AbstractEventLoop, done: asyncio.Future, outcome) -> None:
    """Sets `done`'s result to `outcome`, or raises it there if it is an exception; a caller that went
    away (a cancelled future) is skipped."""
    loop.call_soon_threadsafe(_settle, done, outcome)


def _settle(done: asyncio.Future, outcome) -> None:
    if done.cancelled():
        return
    if isinstance(outcome, BaseException):
        done.set_exception(outcome)
    else:
        done.set_result(outcome)
