"""The serving half of learning from served traffic: feedback on logged answers, and new weights without a restart.

`POST /v1/feedback` appends a verdict on a logged chat completion to the conversation log (see
conversation_log). `POST /v1/admin/reload_weights` stages another checkpoint of the served architecture
off the event loop, has the engine loop swap it in between two steps, and answers once every rank
serves it; one reload runs at a time. Both sit under `/v1/`, behind the same bearer token as the rest.
"""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request

from unified.engine.weight_update import stage_weights
from unified.errors import UserError
from unified.serve.conversation_log import UnknownConversation
from unified.serve.errors import APIError
from unified.serve.protocol import FeedbackRequest, ReloadWeightsRequest
from unified.serve.responses import Feedback, WeightsReloaded, documented

log = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/feedback", responses=documented(Feedback, 400, 401, 404, 409, 413))
async def feedback(body: FeedbackRequest, request: Request):
    server = request.app.state.server
    if server.conversations is None:
        raise APIError("conversation logging is off on this server, so there is nothing to give feedback on; "
                       "start it with serve.conversation_log=<file.jsonl>", status=409,
                       code="conversation_log_disabled")
    try:
        record = await server.conversations.add_feedback(body.id, body.accepted, body.comment)
    except UnknownConversation:
        raise APIError(f"no logged chat completion has the id {body.id!r}; send the `id` of a chat completion "
                       f"this server finished", status=404, param="id", code="conversation_not_found") from None
    except OSError as err:
        raise APIError(f"the feedback could not be recorded: {err}", status=500, type="server_error") from None
    return {"object": "feedback", "id": body.id, "accepted": record["accepted"], "comment": record["comment"],
            "created": record["created"]}


async def load_checkpoint(server, loop, path: str) -> int:
    """Stages the checkpoint at `path` off the event loop, has the engine loop swap it in between two steps
    and counts it in the metrics; returns the new weights version (UserError, old weights kept, if it cannot).
    The caller holds `server.reloading`."""
    engine, started = loop.engine, time.perf_counter()
    staged = await asyncio.to_thread(stage_weights, path, engine.model, engine.dtype)
    version = await loop.update_weights(path, staged)
    server.metrics.weight_updated(sum(t.numel() * t.element_size() for t in staged.values()),
                                  time.perf_counter() - started, version)
    return version


@router.post("/v1/admin/reload_weights", responses=documented(WeightsReloaded, 400, 401, 403, 409, 413, 503))
async def reload_weights(body: ReloadWeightsRequest, request: Request):
    server = request.app.state.server
    if not server.limits.allow_weight_reload:
        raise APIError("weight reloading is off on this server; start it with serve.allow_weight_reload=true "
                       "(and set an API key, see serve.api_key_env)", status=403, code="weight_reload_disabled")
    loop = server.require_ready()
    if server.reloading.locked():
        raise APIError("another weight reload is in progress; retry when it has answered", status=409,
                       code="reload_in_progress")
    async with server.reloading:
        try:
            version = await load_checkpoint(server, loop, body.path)
        except UserError as err:
            raise APIError(f"{err} (still serving weights version {loop.engine.weights_version})", param="path",
                           code="weights_not_loaded") from None
    server.weights_replaced(str(version))
    log.info("now serving weights version %d from %s", version, body.path)
    return {"object": "weights", "reloaded": body.path, "weights_version": version}
