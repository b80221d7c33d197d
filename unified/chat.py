"""Chat formatting shared by the engine, training and the server: a conversation's token ids under the
model's own chat template, content parts flattened to text with one marker per image, and the images of a
conversation in order."""
from __future__ import annotations

from jinja2 import TemplateError

from unified.errors import InvalidRequest


def chat_prompt(tokenizer, messages: list[dict], image_marker: str | None = None,
                tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation under the model's chat template. A message's `content` may be a string
    or a list of parts: {"type": "text", "text": ...} and {"type": "image", ...} (whatever carries the
    image), each image written as `image_marker`, the model's text for one image. `tools` (OpenAI function
    definitions) go to the template as its `tools` variable."""
    messages = [{**m, "content": flatten_content(m["content"], image_marker)} for m in messages]
    if not tokenizer.chat_template:
        return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    except (TemplateError, ValueError, TypeError) as err:  # the model's own template refused the conversation
        raise InvalidRequest(f"the model's chat template rejected these messages: {err}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


IMAGE_PART_TYPES = ("image", "image_url")


def flatten_content(content: str | list[dict], image_marker: str | None) -> str:
    if isinstance(content, str):
        return content
    text = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind not in IMAGE_PART_TYPES:
            raise InvalidRequest(f'a content part must be {{"type": "text", "text": ...}} or an image part '
                                 f'(type {" or ".join(IMAGE_PART_TYPES)}); got {str(part)[:80]}')
        elif image_marker is None:
            raise InvalidRequest("this model takes no image input; send text parts only")
        else:
            text.append(image_marker)
    return "".join(text)


def content_images(messages: list[dict]) -> list:
    """The images of a conversation's content parts, in order: `image` (a path, bytes, data URL or PIL
    image) or OpenAI's `image_url` ({"url": ...} or the URL itself)."""
    images = []
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else ():
            if part.get("type") == "image":
                image = part.get("image")
            elif part.get("type") == "image_url":
                url = part.get("image_url")
                image = url.get("url") if isinstance(url, dict) else url
            else:
                continue
            if image is None:
                raise InvalidRequest(f'an image part carries no image ({str(part)[:80]}); send {{"type": "image", '
                                     f'"image": <file path or data URL>}} or {{"type": "image_url", "image_url": '
                                     f'{{"url": <data URL>}}}}')
            images.append(image)
    return images
