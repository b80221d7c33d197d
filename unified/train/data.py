"""Training examples from JSONL: chat conversations or prompt/completion pairs, tokenized with labels.

Each line is `{"messages": [{"role", "content"}, ...]}` (rendered with the model's chat template; loss on
the assistant turns only, including the tokens that end each turn) or `{"prompt", "completion"}` (raw
text; loss on the completion and the end-of-sequence token). A line that is not valid JSON or has the
wrong shape is reported with its line number and skipped; the rest still train.

For a vision-language model a message's content may be a list of parts, as `LLM.chat` takes them:
`{"type": "text", "text": ...}` and `{"type": "image", "image": <path relative to the data file, or a
data URL>}`. Images are preprocessed once, at load, by the checkpoint's processor; each image's placeholder
is expanded to the tokens its encoder rows fill (no loss on them), and the example keeps its pixels.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from jinja2 import TemplateError

from unified.chat import content_images, flatten_content
from unified.errors import InvalidRequest, UserError

log = logging.getLogger(__name__)
IGNORE = -100  # label of a token that does not count in the loss


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # same length; IGNORE where no loss
    pixel_values: torch.Tensor | None = None  # this example's images, in order, as the model's processor gives them
    image_grid_thw: torch.Tensor | None = None  # [images, 3], for the towers that need it

    @property
    def num_targets(self) -> int:
        return sum(label != IGNORE for label in self.labels)


class BadLine(ValueError):
    pass


@dataclass
class ImageSupport:
    """What image parts need: the checkpoint's processor, its placeholder id, where relative paths start."""
    processor: object  # unified.vision.ImageProcessor
    image_token_id: int
    base: Path

    def load(self, source):
        from unified.vision import load_image

        if isinstance(source, str) and not source.startswith("data:") and not Path(source).is_absolute():
            source = self.base / source
        return load_image(source)


def _template_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    except (TemplateError, ValueError, TypeError) as err:  # the model's own template refused the conversation
        raise BadLine(f"the model's chat template rejected it: {err}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadLine('"messages" must be a non-empty list')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list)):
            raise BadLine(f'message {i} must be an object with string "role" and "content" (a string or a list '
                          f'of content parts)')
    if not any(m["role"] == "assistant" for m in messages):
        raise BadLine("the conversation has no assistant message to learn from")


def chat_example(tokenizer, messages: list[dict], images: ImageSupport | None = None) -> Example:
    """Labels the tokens each assistant turn adds to the rendered conversation; relies on the template
    rendering a prefix of the conversation as a prefix of the whole (true of chat templates in use)."""
    if not tokenizer.chat_template:
        raise UserError("this model's tokenizer has no chat template; use prompt/completion lines instead")
    check_messages(messages)
    marker = images.processor.prompt_marker if images else None
    try:
        sources = content_images(messages)
        messages = [{**m, "content": flatten_content(m["content"], marker)} for m in messages]
    except InvalidRequest as err:
        raise BadLine(str(err)) from None
    if messages[0]["role"] == "assistant":  # no prompt before it: the template cannot place the reply
        raise BadLine("the conversation starts with an assistant reply; put the user's (or a system) message first")
    ids = _template_ids(tokenizer, messages, generation_prompt=False)
    labels = [IGNORE] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_template_ids(tokenizer, messages[:turn], generation_prompt=True))
        through_turn = _template_ids(tokenizer, messages[:turn + 1], generation_prompt=False)
        end = len(through_turn)
        if ids[:end] != through_turn:
            raise UserError("the chat template does not render a conversation's prefix as its prefix, so assistant "
                            "tokens cannot be located; use prompt/completion lines for this model")
        labels[start:end] = ids[start:end]
    return with_images(Example(ids, labels), sources, images) if sources else Example(ids, labels)


def with_images(example: Example, sources: list, images: ImageSupport) -> Example:
    """`example` with each image placeholder expanded to its image's tokens (no loss on them) and the pixels."""
    from unified.vision import ImageError, expand_image_placeholders

    try:
        inputs = images.processor([images.load(source) for source in sources])
        ids = expand_image_placeholders(example.input_ids, images.image_token_id, inputs.num_tokens)
    except ImageError as err:
        raise BadLine(str(err)) from None
    counts, labels = iter(inputs.num_tokens), []
    for token, label in zip(example.input_ids, example.labels):
        labels += [IGNORE] * next(counts) if token == images.image_token_id else [label]
    return Example(ids, labels, inputs.pixel_values, inputs.image_grid_thw)


def completion_example(tokenizer, prompt: str, completion: str) -> Example:
    if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
        raise BadLine('"prompt" and "completion" must be strings, the completion non-empty')
    prompt_ids = tokenizer(prompt)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    return Example(prompt_ids + completion_ids, [IGNORE] * len(prompt_ids) + completion_ids)


def parse_record(tokenizer, record, images: ImageSupport | None = None) -> Example:
    if not isinstance(record, dict):
        raise BadLine("each line must be a JSON object")
    if "messages" in record:
        return chat_example(tokenizer, record["messages"], images)
    if "prompt" in record and "completion" in record:
        return completion_example(tokenizer, record["prompt"], record["completion"])
    raise BadLine('a line needs "messages" (chat) or "prompt" and "completion"')


def _truncated(example: Example, max_len: int, images: ImageSupport | None) -> Example:
    ids = example.input_ids[:max_len]
    if example.pixel_values is not None and ids.count(images.image_token_id) != example.input_ids.count(
            images.image_token_id):
        raise BadLine(f"an image's tokens do not fit within train.seq_len={max_len}; raise it or shorten the line")
    return Example(ids, example.labels[:max_len], example.pixel_values, example.image_grid_thw)


def load_examples(path: str | Path, tokenizer, max_len: int, images: ImageSupport | None = None) -> list[Example]:
    """Every usable line of `path`, truncated to `max_len` tokens; reports skipped and truncated lines.
    `images`: how to read image parts (vision-language models; relative paths start at `path`'s folder)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data={path} is not a file; give a JSONL file of chat messages or prompt/completion pairs")
    examples, skipped, truncated = [], 0, 0
    with path.open("rb") as lines:  # binary: lines end at b"\n" only, and each is decoded on its own
        for lineno, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                log.warning("%s:%d skipped: not UTF-8 text (%s)", path, lineno, err.reason)
                skipped += 1
                continue
            try:
                example = parse_record(tokenizer, json.loads(line), images)
                if len(example.input_ids) > max_len:
                    example = _truncated(example, max_len, images)
                    truncated += 1
            except (json.JSONDecodeError, BadLine) as err:
                log.warning("%s:%d skipped: %s", path, lineno, err)
                skipped += 1
                continue
            if example.num_targets == 0:
                log.warning("%s:%d skipped: no target tokens left within train.seq_len=%d", path, lineno, max_len)
                skipped += 1
                continue
            examples.append(example)
    if truncated:
        log.warning("%d examples were longer than train.seq_len=%d tokens and were truncated", truncated, max_len)
    if not examples:
        raise UserError(f"{path} has no usable training examples ({skipped} lines skipped; see the warnings above)")
    log.info("%s: %d examples, %d lines skipped", path, len(examples), skipped)
    return examples
