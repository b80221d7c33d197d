"""Turning what a user sends (a path, raw bytes, a data URL) into a checked RGB `PIL.Image`.

Everything here runs on untrusted input, so the rules are:
- Size is checked from the header, before any pixel is decoded: a 100-byte PNG can claim 10^10 pixels.
- Every failure is an `ImageError` (a `UserError`, so HTTP layers answer 4xx) that says what is wrong and
  what to send instead; Pillow's own exceptions never escape.
- No network: `http(s)://` addresses are refused, since a server that fetches them can be made to reach
  any address it can see. Clients send the bytes, as a data URL. Likewise file paths are for local
  callers (CLI, batch jobs): an HTTP layer passes on only bytes and data URLs.
- One RGB convention, shared with the processors (`to_rgb`): transparency is composited on white (what
  the Hugging Face processors do), 16-bit samples are scaled to 8 bits (Pillow alone would clip them to
  white), the EXIF orientation is applied, and an animation or multi-page file gives its first frame.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps

from unified.errors import UserError

DEFAULT_MAX_PIXELS = 50_000_000
_ALPHA_BACKGROUND = (255, 255, 255, 255)


class ImageError(UserError, ValueError):
    """An image input that cannot be used; the message says why and what to send instead."""


def load_image(source, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Opens, checks and decodes one image into RGB.

    `source`: a file path (str or os.PathLike), raw file bytes, a `data:image/...;base64,...` URL, or a
    `PIL.Image.Image` (checked and converted like the others). Images over `max_pixels` are refused
    before their pixels are decoded.
    """
    if isinstance(source, Image.Image):
        _check_size(source.size, max_pixels)
        return to_rgb(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(io.BytesIO(source), "the image data", max_pixels)
    if isinstance(source, str) and source.startswith("data:"):
        return _decode(io.BytesIO(data_url_bytes(source)), "the data URL", max_pixels)
    if isinstance(source, str) and source.split(":", 1)[0].lower() in ("http", "https"):
        raise ImageError(f"image URLs are not fetched ({_short(source)}): the server does not download from "
                         "addresses a request names. Send the image itself as a data URL, "
                         "data:image/png;base64,<base64 of the file>.")
    if isinstance(source, (str, os.PathLike)):
        return _decode_file(source, max_pixels)
    raise ImageError(f"an image must be a file path, bytes or a data URL, not {type(source).__name__}.")


def to_rgb(image: Image.Image) -> Image.Image:
    """The RGB image a model sees: alpha and palette transparency composited on white, 16-bit scaled."""
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    try:
        if image.mode.startswith("I") or image.mode == "F":
            image = Image.fromarray(_to_8_bit(np.asarray(image), image.mode), mode="L")
        if image.has_transparency_data:
            background = Image.new("RGBA", image.size, _ALPHA_BACKGROUND)
            return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
        return image.convert("RGB")
    except ImageError:
        raise
    except Exception as e:  # Pillow raises ValueError/OSError/KeyError for modes it cannot convert
        raise ImageError(f"cannot convert an image in color mode {image.mode!r} to RGB ({e}); "
                         "save it as an 8-bit RGB PNG or JPEG and send that.") from None


def _decode(stream: BinaryIO, what: str, max_pixels: int) -> Image.Image:
    """Decodes a seekable stream; the stream must stay open until this returns."""
    size = stream.seek(0, io.SEEK_END)
    stream.seek(0)
    if not size:
        raise ImageError(f"{what} is empty (0 bytes); send a PNG, JPEG, WebP or GIF file.")
    try:
        with warnings.catch_warnings():
            # Our own limit (below) decides; Pillow's warning would only add noise to the logs.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(stream)
    except Image.DecompressionBombError as e:
        raise ImageError(f"{what} has too many pixels to decode safely ({str(e).rstrip('.')}); "
                         f"downscale it below {max_pixels:,} pixels.") from None
    except Image.UnidentifiedImageError:
        stream.seek(0)
        raise ImageError(f"{what} is not an image Pillow can read ({size:,} bytes starting "
                         f"{stream.read(12)!r}); send a PNG, JPEG, WebP or GIF file.") from None
    except Exception as e:
        raise ImageError(f"{what} starts like an image but cannot be opened ({type(e).__name__}: {e}): it is "
                         "corrupt or truncated; send the complete file, or re-export it as PNG or JPEG.") from None
    _check_size(image.size, max_pixels, what)
    try:
        image.seek(0)
        image.load()
    except OSError as e:
        if "truncated" in str(e) or "broken data stream" in str(e):
            raise ImageError(f"{what} is truncated: the file ends before all its pixels ({e}). "
                             "The upload was probably cut short; send the complete file.") from None
        raise ImageError(f"{what} is corrupt and cannot be decoded ({e}); re-export it as PNG or JPEG.") from None
    except Exception as e:
        raise ImageError(f"{what} is corrupt and cannot be decoded ({type(e).__name__}: {e}); "
                         "re-export it as PNG or JPEG.") from None
    try:
        image = ImageOps.exif_transpose(image)
    except Exception:  # unreadable orientation metadata: the pixels as stored are still a valid image
        pass
    return to_rgb(image)


def _check_size(size: tuple[int, int], max_pixels: int, what: str = "the image") -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ImageError(f"{what} has no pixels ({width}x{height}); send an image at least 1x1.")
    if width * height > max_pixels:
        raise ImageError(f"{what} is {width}x{height} = {width * height:,} pixels, over the limit of "
                         f"{max_pixels:,}; downscale it (models see at most a few megapixels anyway).")


def data_url_bytes(url: str) -> bytes:
    """The file a `data:<type>;base64,<payload>` URL carries; ImageError when it is not one."""
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ImageError(f"a data URL must look like data:image/png;base64,<base64 data>; got {_short(url)}.")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the data URL's base64 payload is invalid ({e}); encode the file with standard "
                         "base64 (A-Z a-z 0-9 + /, '=' padding).") from None


def _decode_file(path, max_pixels: int) -> Image.Image:
    try:
        file = open(path, "rb")
    except FileNotFoundError:
        raise ImageError(f"no image file at {_short(os.fspath(path))} (to send image data inline, use a data "
                         "URL: data:image/png;base64,...).") from None
    except OSError as e:
        raise ImageError(f"cannot read the image file {_short(os.fspath(path))}: {e.strerror or e}.") from None
    with file:
        return _decode(file, f"the file {os.fspath(path)!r}", max_pixels)


def _to_8_bit(samples: np.ndarray, mode: str) -> np.ndarray:
    """Single-channel integer or float samples as uint8: 8-bit ranges kept, 16-bit ranges scaled."""
    if mode.startswith("I;16"):
        return (samples.astype(np.uint16) >> 8).astype(np.uint8)
    low, high = (float(samples.min()), float(samples.max())) if samples.size else (0.0, 0.0)
    if low < 0 or high > 65535:
        raise ImageError(f"the image's samples range over [{low:g}, {high:g}], which is not 8- or 16-bit "
                         f"(color mode {mode!r}); save it as an 8-bit RGB PNG or JPEG and send that.")
    if high > 255:
        return (samples.astype(np.float64) / 257).round().astype(np.uint8)
    return samples.round().astype(np.uint8) if samples.dtype.kind == "f" else samples.astype(np.uint8)


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
