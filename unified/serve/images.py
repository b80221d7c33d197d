"""Images in chat requests: what HTTP clients may send, the limits on it, and how it is logged.

- Only data URLs. An http(s) address is refused, not fetched: a server that downloads what a request
  names can be made to reach any address it can see. A file path (or any other scheme) is refused too,
  so a client cannot make the server read its files. Batch jobs, whose input the user owns, take paths.
- `serve.max_images` per request across its messages, `serve.max_image_bytes` per data URL; the rest of
  the body is held to `serve.max_body_bytes` as for text requests (the body guard lets a chat body grow
  by max_images x max_image_bytes, the handler then checks each part).
- Decoding (size from the header first, then the pixels) and preprocessing run on a worker thread, so
  neither the event loop nor the engine thread waits on a large file; the engine gets the pixel inputs.
- The conversation log keeps each image as the sha256 and size of its file, never the base64.
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from PIL import Image

from unified.serve.errors import APIError
from unified.vision.images import ImageError, data_url_bytes, load_image


@dataclass
class ImageRef:
    where: str  # e.g. "messages[0].content[2]", for error messages
    url: str


@dataclass
class RequestImage:
    image: Image.Image
    sha256: str  # of the file the data URL carried
    bytes: int


def image_refs(messages) -> list[ImageRef]:
    """The image parts of a chat request's messages, in prompt order."""
    return [ImageRef(f"messages[{m}].content[{p}]", part.image_url.url)
            for m, message in enumerate(messages) if isinstance(message.content, list)
            for p, part in enumerate(message.content) if part.type == "image_url"]


def check_images(refs: list[ImageRef], body_bytes: int, limits, takes_images: bool) -> None:
    """Refuses, before any decoding, images this server does not take and bodies over the limits."""
    if not refs:
        return
    if not takes_images:
        raise APIError("this model takes text only, no images: image inputs need a vision-language model",
                       param="messages")
    if len(refs) > limits.max_images:
        raise APIError(f"the request has {len(refs)} images; this server accepts at most {limits.max_images} "
                       f"per request (serve.max_images)", param="messages")
    for ref in refs:
        _check_url(ref)
        if len(ref.url) > limits.max_image_bytes:
            raise APIError(f"the data URL of {ref.where} is {len(ref.url):,} bytes, over this server's limit of "
                           f"{limits.max_image_bytes:,} per image (serve.max_image_bytes); downscale or recompress "
                           f"the image (models see at most a few megapixels)", status=413, param="messages")
    rest = body_bytes - sum(len(ref.url) for ref in refs)
    if rest > limits.max_body_bytes:
        raise APIError(f"the request body without its images is {rest:,} bytes, more than {limits.max_body_bytes:,} "
                       f"(serve.max_body_bytes)", status=413)


def _check_url(ref: ImageRef) -> None:
    url = ref.url
    if url[:5].lower() == "data:":
        return
    shown = repr(url if len(url) <= 60 else url[:60] + "...")
    if url.split(":", 1)[0].lower() in ("http", "https"):
        raise APIError(f"{ref.where}: image URLs are not fetched ({shown}): this server downloads nothing a "
                       "request names. Send the image itself as a data URL: data:image/png;base64,<base64 of "
                       "the file>.", param="messages")
    raise APIError(f"{ref.where}: image_url.url must be a data URL, data:image/png;base64,<base64 of the file> "
                   f"(got {shown}); this server reads no files or other URLs a request names.", param="messages")


async def decode_images(refs: list[ImageRef]) -> list[RequestImage]:
    """The checked RGB images, decoded off the event loop; a bad one is a 400 that names its part."""
    return await asyncio.to_thread(lambda: [_decode(ref) for ref in refs])


async def preprocess_images(processor, images: list[RequestImage]):
    """The model's pixel inputs for `images` (resize, normalise, patchify), computed off the event loop and
    the engine thread, so a large image delays neither."""
    try:
        return await asyncio.to_thread(processor, [i.image for i in images])
    except ImageError as err:
        raise APIError(str(err), param="messages") from None


def _decode(ref: ImageRef) -> RequestImage:
    try:
        data = data_url_bytes(ref.url)
        return RequestImage(load_image(data), hashlib.sha256(data).hexdigest(), len(data))
    except ImageError as err:
        raise APIError(f"{ref.where}: {err}", param="messages") from None


def logged_messages(messages: list[dict], images: list[RequestImage]) -> list[dict]:
    """The conversation as the log keeps it: text content as one string (what the online learner reads),
    and in a message with images its parts, each image as {"type": "image", "sha256", "bytes"}."""
    remaining = iter(images)
    logged = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list) and any(part["type"] == "image_url" for part in content):
            content = [part if part["type"] == "text" else _placeholder(next(remaining)) for part in content]
        elif isinstance(content, list):
            content = "".join(part["text"] for part in content)
        logged.append({**message, "content": content})
    return logged


def _placeholder(image: RequestImage) -> dict:
    return {"type": "image", "sha256": image.sha256, "bytes": image.bytes}
