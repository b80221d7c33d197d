"""Tool calling: tools go to the model through its own chat template, calls come back parsed from its text.

A template that never mentions `tools` would drop them silently, so such a model gets a 400 instead. The
calls are read in the format of the Hermes / Qwen templates, the common one among open models: each call
a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`. Text outside
the tags stays the message's content; a block that is not such an object stays text too.
"""
from __future__ import annotations

import json
import re
import uuid

from unified.engine.sampling_params import InvalidRequest

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def template_takes_tools(tokenizer) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" when tools are given
        template = template.get("tool_use") or template.get("default") or ""
    return bool(template) and re.search(r"\btools\b", template) is not None


def check_tools_supported(tokenizer) -> None:
    if not template_takes_tools(tokenizer):
        raise InvalidRequest("this model's chat template does not render tools, so the model would never see "
                             "them; send the request without tools, or serve a model whose template supports "
                             "tool calling")


def template_message(message: dict) -> dict:
    """An OpenAI message as chat templates expect it: a call's `arguments` as an object, not a JSON string."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call["function"])
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise InvalidRequest(f"tool call {call['id']!r} has arguments that are not JSON: "
                                 f"{function['arguments'][:80]!r}") from None
        converted.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": converted}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content left, calls in the OpenAI shape) of a model's answer."""
    calls, kept, at = [], [], 0
    for match in _CALL.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        calls.append(call)
    if not calls:
        return text, []
    content = "".join(kept + [text[at:]]).strip()
    return content or None, calls


def _call(block: str) -> dict | None:
    try:
        payload = json.loads(block)
    except ValueError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": payload["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
