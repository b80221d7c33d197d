"""`unified recipe=batch input=prompts.jsonl output=out.jsonl`: offline batch inference.

Each input line is a JSON object with `messages` (chat) or `prompt` (raw text or token ids), an optional `id`
(default: the line number) and optional sampling options (`max_tokens`, `temperature`, ...). A message's
`content` may be a list of parts for a vision-language model: text, `{"type": "image", "image": <file path
or data URL>}` or `{"type": "image_url", "image_url": {"url": <data URL>}}`; relative paths are read from
the input file's folder (the input is the user's own, so unlike the server, paths are fine). Results
are appended to the output as each request finishes, one flushed line each, so a rerun after a crash
skips the ids already written (a half-written last line is dropped and redone; a whole one that lost only
its newline is kept). A malformed input line is reported with its line number and skipped, as is a line
with an image that cannot be used; the others still run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from unified.chat import chat_prompt, content_images
from unified.engine.llm import LLM
from unified.engine.outputs import RequestOutput
from unified.engine.sampling_params import InvalidRequest, SamplingParams
from unified.errors import UserError
from unified.jsonl import jsonl_lines

REQUEST_KEYS = ("id", "messages", "prompt")


def _completed_ids(output: Path) -> set[str]:
    """Ids already in `output`. A crash can leave the last line torn (truncated here; its request is redone)
    or whole but without its newline (ended here, so that the next record starts a line of its own). Any
    other line that is not a record was not left by a crash, and the results after it are not thrown away
    with it: the run stops, naming it."""
    if not output.exists():
        return set()
    done, keep, ended = set(), 0, True
    with output.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                done.add(str(json.loads(raw)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
                if f.read(1):
                    raise UserError(f"{output}:{lineno} is not a result line with an 'id' ({err!r}); fix or "
                                    f"remove that line and rerun") from None
                break
            keep += len(raw)
            ended = raw.endswith(b"\n")
    with output.open("r+b") as f:
        f.truncate(keep)
        if not ended:
            f.seek(keep)
            f.write(b"\n")
    return done


def _parse(line: str, lineno: int, tokenizer, image_marker: str | None,
           folder: Path) -> tuple[str, list[int], list, SamplingParams]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise InvalidRequest(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(item, dict):
        raise InvalidRequest("each line must be a JSON object")
    request_id = str(item.get("id", f"line-{lineno}"))
    images = []
    if isinstance(item.get("messages"), list) and item["messages"]:
        if not all(isinstance(m, dict) and isinstance(m.get("content"), (str, list)) for m in item["messages"]):
            raise InvalidRequest("every message needs a 'content': a string or a list of parts")
        ids = chat_prompt(tokenizer, item["messages"], image_marker)
        images = [_resolve(image, folder) for image in content_images(item["messages"])]
    elif isinstance(item.get("prompt"), str):
        ids = tokenizer(item["prompt"])["input_ids"]
    elif isinstance(item.get("prompt"), list) and all(type(t) is int for t in item["prompt"]):  # not bools
        ids = item["prompt"]
    else:
        raise InvalidRequest("a line needs 'messages' (a non-empty list) or 'prompt' (a string or token ids)")
    options = {k: v for k, v in item.items() if k not in REQUEST_KEYS}
    options.setdefault("temperature", 0.0)
    options.setdefault("max_tokens", 256)
    return request_id, ids, images, SamplingParams.from_dict(options)


def _resolve(image, folder: Path):
    """A relative file path is read from the input file's folder; data and http(s) URLs pass as they are
    (the engine decodes the first and refuses the second)."""
    if not isinstance(image, str) or image.startswith("data:") or image.split(":", 1)[0].lower() in ("http", "https"):
        return image
    return folder / image


def _record(output: RequestOutput) -> dict:
    first = output.outputs[0]
    record = {"id": output.request_id, "text": first.text, "finish_reason": first.finish_reason,
              "usage": {"prompt_tokens": len(output.prompt_token_ids),
                        "completion_tokens": sum(len(o.token_ids) for o in output.outputs)}}
    if len(output.outputs) > 1:
        record["outputs"] = [{"text": o.text, "finish_reason": o.finish_reason} for o in output.outputs]
    if output.error is not None:  # this request failed alone; the others went on
        record["error"] = output.error
    if first.logprobs is not None:
        record["logprobs"] = [[{"token_id": e.token_id, "logprob": e.logprob, "top": e.top} for e in o.logprobs]
                              for o in output.outputs]
    return record


def run(cfg) -> None:
    if not cfg.input or not cfg.output:
        raise UserError("batch needs input= and output=: unified recipe=batch input=prompts.jsonl output=out.jsonl")
    source, target = Path(cfg.input), Path(cfg.output)
    if not source.is_file():
        raise UserError(f"input={source} {'is a folder' if source.is_dir() else 'does not exist'}; give a .jsonl file")
    if target.is_dir():
        raise UserError(f"output={target} is a folder; give the .jsonl file to write the results to")
    with LLM.from_run_config(cfg) as llm:  # other ranks follow the driver's steps inside this call
        _run_batch(llm, source, target, 4 * cfg.engine.max_num_seqs)


def _run_batch(llm, source: Path, target: Path, in_flight_cap: int) -> None:
    from tqdm import tqdm

    done = _completed_ids(target)
    lines = jsonl_lines(source.read_text())
    engine = llm.engine
    marker = engine.image_processor.prompt_marker if engine.image_processor else None
    pending = iter(enumerate(lines, start=1))
    skipped = errors = 0
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as out, tqdm(total=len(lines), desc="batch", unit="req") as bar:
        def submit() -> None:
            nonlocal skipped, errors
            for lineno, line in pending:
                if not line.strip():
                    bar.update(1)
                    continue
                try:
                    request_id, ids, images, params = _parse(line, lineno, llm.tokenizer, marker, source.parent)
                    if request_id in done:
                        skipped += 1
                        bar.update(1)
                        continue
                    engine.add_request(ids, params, request_id, images)
                except InvalidRequest as err:
                    errors += 1
                    bar.update(1)
                    print(f"{source}:{lineno}: skipped: {err}", file=sys.stderr)
                    continue
                if len(engine.requests) >= in_flight_cap:
                    return

        submit()
        while engine.has_unfinished():
            for output in engine.step():
                out.write(json.dumps(_record(output)) + "\n")
                out.flush()
                bar.update(1)
            if len(engine.requests) < in_flight_cap:
                submit()
    print(f"batch: {len(lines)} lines, {skipped} already done, {errors} skipped for errors -> {target}")
