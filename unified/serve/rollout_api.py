"""The endpoints an external RL trainer drives (`recipe=rollout`): SGLang's weight sync, vLLM's sleep mode,
prefix-cache reset.

Paths, bodies and answers are SGLang's, so trainer code written for it works unchanged: an answer is
`{"success": bool, "message": str}` (a refusal also carries the OpenAI `error` object and a 4xx status).
SGLang's bodies carry optional fields that vary between its versions; the ones these endpoints do not
use are accepted and ignored. Weight changes run on the engine thread between two steps, one at a time;
requests in flight go on with the new weights. A trainer may name each update's policy with
`weight_version`, which `/get_weight_version`, `/v1/models` and the `X-Weight-Version` header of every
response report; without one it is the count of updates since start.

`POST /sleep?level=1` lets in-flight requests finish (for up to serve.shutdown_timeout_s, then ends them
with an error), then frees the KV cache and the packed weight copies; `level=2` frees the weights too.
Asleep, generation requests get 503 and /health says `"sleeping": true`; weight updates still work at
level 1. `POST /wake_up` takes the memory back; after level 2 the weights must come again by an update
before the server generates.
"""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field

from unified.engine.sleep_mode import EngineBusy
from unified.engine.weight_sync import JoinUpdateGroup, ReceiveWeights, WeightSyncError
from unified.errors import UserError
from unified.serve.async_engine import ASLEEP
from unified.serve.errors import APIError
from unified.serve.online_api import load_checkpoint
from unified.serve.protocol import _Request

log = logging.getLogger(__name__)
router = APIRouter()
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
PATHS = {"/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
         "/destroy_weights_update_group", "/get_weight_version", "/reset_prefix_cache", "/sleep", "/wake_up",
         "/is_sleeping"}
SLEEP_LEVELS = (1, 2)


class _SGLangRequest(_Request):
    model_config = ConfigDict(extra="ignore", strict=True)


class UpdateFromDiskRequest(_SGLangRequest):
    model_path: str = Field(min_length=1, description="an HF checkpoint folder of the served architecture")
    weight_version: str | None = None


class InitGroupRequest(_SGLangRequest):
    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="this server's first rank in the group; the trainer is rank 0")
    world_size: int = Field(ge=2)
    group_name: str = Field(DEFAULT_GROUP, min_length=1)
    backend: str = "gloo"


class UpdateFromDistributedRequest(_SGLangRequest):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(DEFAULT_GROUP, min_length=1)
    flush_cache: bool = True
    weight_version: str | None = None


class DestroyGroupRequest(_SGLangRequest):
    group_name: str = Field(DEFAULT_GROUP, min_length=1)


def _refused(message: str, status: int = 400, code: str = "weight_sync_failed") -> JSONResponse:
    body = APIError(message, status=status, code=code).body()
    return JSONResponse({"success": False, "message": message, **body}, status_code=status)


def _ok(message: str, **extra) -> dict:
    return {"success": True, "message": message, **extra}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateFromDiskRequest, request: Request):
    server = request.app.state.server
    loop = server.require_ready(generating=False)
    async with server.reloading:
        try:
            count = await load_checkpoint(server, loop, body.model_path)
        except UserError as err:
            return _refused(f"{err} (still serving weight version {server.weight_version})")
        version = server.weights_replaced(str(count) if body.weight_version is None else body.weight_version)
    log.info("now serving weight version %s from %s", version, body.model_path)
    return _ok(f"serving the weights of {body.model_path}", weight_version=version)


@router.post("/init_weights_update_group")
async def init_weights_update_group(body: InitGroupRequest, request: Request):
    server = request.app.state.server
    loop = server.require_ready(generating=False)
    spec = JoinUpdateGroup(body.master_address, body.master_port, body.rank_offset, body.world_size,
                           body.group_name, body.backend, server.limits.weight_update_timeout_s)
    try:
        await loop.between_steps(lambda: loop.engine.link.join_update_group(spec))
    except WeightSyncError as err:
        return _refused(str(err))
    return _ok(f"joined the update group {body.group_name!r} ({body.world_size} ranks)")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: UpdateFromDistributedRequest, request: Request):
    """Every tensor is received before the answer; the prefix cache is always emptied (its K/V came from
    the old weights), whatever `flush_cache` says."""
    server = request.app.state.server
    loop = server.require_ready(generating=False)
    spec = ReceiveWeights(body.group_name, body.names, body.dtypes, body.shapes)
    async with server.reloading:
        started = time.perf_counter()
        try:
            received = await loop.between_steps(lambda: loop.engine.link.receive_weights(spec))
        except WeightSyncError as err:
            return _refused(f"{err} (serving weight version {server.weight_version})")
        count = loop.engine.weights_version
        server.metrics.weight_updated(received, time.perf_counter() - started, count)
        version = server.weights_replaced(str(count) if body.weight_version is None else body.weight_version)
    tied = [name for name in body.names if name in loop.engine.link.groups.stream.ignored]
    note = (f"; {', '.join(tied)} ignored: this model's head is its input embeddings (tied), which change only "
            f"with the embedding tensor" if tied else "")
    return _ok(f"updated {len(body.names)} tensors ({received} bytes){note}", weight_version=version)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(body: DestroyGroupRequest, request: Request):
    loop = request.app.state.server.require_ready(generating=False)
    try:
        await loop.between_steps(lambda: loop.engine.link.leave_update_group(body.group_name))
    except WeightSyncError as err:
        return _refused(str(err))
    return _ok(f"left the update group {body.group_name!r}")


@router.get("/get_weight_version")
async def get_weight_version(request: Request):
    return {"weight_version": request.app.state.server.weight_version}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request):
    loop = request.app.state.server.require_ready(generating=False)
    await loop.between_steps(loop.engine.blocks.reset_prefix_cache)
    return _ok("the prefix cache is empty")


@router.post("/sleep")
async def sleep(request: Request, level: int = 1):
    server = request.app.state.server
    loop = server.require_ready(generating=False)
    if level not in SLEEP_LEVELS:
        return _refused(f"level={level}: sleep levels are 1 (free the KV cache and packed weight copies) and 2 (the "
                        f"weights too)", code="invalid_sleep_level")
    async with server.sleep_changes:  # a /wake_up sent while this waits for requests comes after it
        if server.sleeping:
            now = loop.engine.link.sleep_level
            if level > now:
                return _refused(f"asleep at level {now}; POST /wake_up first to sleep at level {level}", status=409,
                                code="asleep")
            return _ok(f"already asleep at level {now}")
        server.sleeping = True  # from here on generation requests are refused
        deadline = time.monotonic() + server.limits.shutdown_timeout_s
        while loop.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if loop.num_in_flight:
            log.warning("going to sleep: ending %d requests still in flight", loop.num_in_flight)
            loop.cancel_all(ASLEEP)
        try:
            freed = await loop.between_steps(lambda: loop.engine.link.sleep(level))
        except EngineBusy as err:  # a request slipped in before the flag was seen: stay awake
            server.sleeping = False
            return _refused(f"could not go to sleep: {err}", status=409, code="busy")
        server.asleep_since = time.monotonic()
    log.info("asleep at level %d: freed %s", level, freed)
    return _ok(f"asleep at level {level}", freed=freed)


@router.post("/wake_up")
async def wake_up(request: Request):
    server = request.app.state.server
    loop = server.require_ready(generating=False)
    async with server.sleep_changes:
        if not server.sleeping:
            return _ok("already awake")
        await loop.between_steps(loop.engine.link.wake_up)
        server.metrics.asleep_seconds.inc(time.monotonic() - server.asleep_since)
        server.sleeping = False
    return _ok("awake" + ("; send the weights before generating (sleep level 2 freed them)"
                          if loop.engine.link.weights_missing else ""))


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    return {"is_sleeping": request.app.state.server.sleeping}
