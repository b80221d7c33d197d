"""load_image: every source kind, every color mode to RGB, and every bad input an ImageError with advice."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from unified.errors import UserError
from unified.vision.images import ImageError, load_image


def _picture(width=40, height=30, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _encode(image: Image.Image, fmt="PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with one tiny (invalid) data chunk."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_sources_path_bytes_data_url_and_pil_give_the_same_rgb(tmp_path):
    picture = _picture()
    data = _encode(picture)
    path = tmp_path / "picture.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    wrapped_url = url[:60] + "\n" + url[60:]  # line-wrapped base64, as some clients send it
    for source in (path, str(path), data, bytearray(data), memoryview(data), url, wrapped_url, picture):
        image = load_image(source)
        assert image.mode == "RGB" and image.size == (40, 30)
        assert np.array_equal(np.asarray(image), np.asarray(picture)), type(source)


def test_http_urls_are_refused_with_the_data_url_alternative():
    for url in ("http://169.254.169.254/latest/meta-data", "HTTPS://example.com/cat.png"):
        with pytest.raises(ImageError, match="not fetched.*data:image/png;base64"):
            load_image(url)


@pytest.mark.parametrize("url, message", [
    ("data:image/png,rawbytes", "must look like data:image/png;base64"),
    ("data:image/png;base64,@@@not base64@@@", "base64 payload is invalid"),
    ("data:image/png;base64,", "empty"),
    ("data:image/png;base64," + base64.b64encode(b"hello world").decode(), "not an image"),
])
def test_bad_data_urls(url, message):
    with pytest.raises(ImageError, match=message):
        load_image(url)


def test_bad_paths_and_types(tmp_path):
    with pytest.raises(ImageError, match="no image file at .*data URL"):
        load_image(str(tmp_path / "missing.png"))
    with pytest.raises(ImageError, match="cannot read the image file"):
        load_image(tmp_path)
    with pytest.raises(ImageError, match="file path, bytes or a data URL, not int"):
        load_image(42)
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(ImageError, match=r"empty \(0 bytes\)"):
        load_image(empty)


@pytest.mark.parametrize("data", [
    b"\x00", bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)),
    b"This is a text file, not a picture.\n" * 20, b"\x89PNG\r\n\x1a\n", b"GIF89a",
])
def test_not_an_image(data):
    with pytest.raises(ImageError, match="not an image Pillow can read.*send a PNG, JPEG"):
        load_image(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_truncated_files(fmt):
    data = _encode(_picture(200, 150).convert("P") if fmt == "GIF" else _picture(200, 150), fmt)
    with pytest.raises(ImageError, match="truncated|corrupt") as raised:
        load_image(data[: len(data) // 2])
    assert "send the complete file" in str(raised.value) or "re-export" in str(raised.value)


def test_corrupted_bytes_never_raise_anything_but_image_error():
    rng = np.random.default_rng(2)
    originals = [_encode(_picture(64, 48), "PNG"), _encode(_picture(64, 48), "JPEG")]
    for original in originals:
        for _ in range(40):
            data = bytearray(original)
            positions = rng.integers(0, len(data), 4)
            data[positions[0]:positions[0] + 1] = b""  # a dropped byte shifts everything after it
            for position in positions[1:]:
                if position < len(data):
                    data[position] = int(rng.integers(0, 256))
            try:
                image = load_image(bytes(data[: int(rng.integers(8, len(data) + 1))]))
            except ImageError:
                continue
            assert image.mode == "RGB"


def test_pixel_limit_is_checked_from_the_header_before_decoding():
    with pytest.raises(ImageError, match="too many pixels to decode safely.*downscale it below 50,000,000"):
        load_image(_png_header(100_000, 100_000))  # decoding would need 30 GB; the header is 60 bytes
    with pytest.raises(ImageError, match="over the limit of 50,000,000.*downscale"):
        load_image(_png_header(10_000, 6_000))
    with pytest.raises(ImageError, match="over the limit of 1,000"):
        load_image(_encode(_picture(40, 30)), max_pixels=1000)
    assert load_image(_encode(_picture(40, 25)), max_pixels=1000).size == (40, 25)
    with pytest.raises(ImageError, match="over the limit"):
        load_image(_picture(40, 30), max_pixels=1000)


@pytest.mark.parametrize("width, height", [(0, 10), (10, 0), (0, 0)])
def test_zero_size_images(width, height):
    with pytest.raises(ImageError, match="not an image Pillow can read|cannot be opened|no pixels"):
        load_image(_png_header(width, height))
    with pytest.raises(ImageError, match=f"no pixels \\({width}x{height}\\)"):
        load_image(Image.new("RGB", (width, height)))


def test_error_is_a_user_error():
    assert issubclass(ImageError, UserError)


def test_rgba_is_composited_on_white():
    rgba = np.zeros((2, 3, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 0)  # fully transparent -> white
    rgba[0, 1] = (10, 20, 30, 255)  # opaque -> unchanged
    rgba[0, 2] = (0, 0, 0, 128)  # half black over white -> mid gray
    image = load_image(_encode(Image.fromarray(rgba, "RGBA")))
    pixels = np.asarray(image)
    assert image.mode == "RGB"
    assert tuple(pixels[0, 0]) == (255, 255, 255)
    assert tuple(pixels[0, 1]) == (10, 20, 30)
    assert tuple(pixels[0, 2]) == (127, 127, 127)


def test_palette_with_transparency_and_gray_alpha_are_composited_on_white():
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 255] + [255, 0, 0] * 255)
    palette.putpixel((1, 1), 1)
    pixels = np.asarray(load_image(_encode(palette, transparency=0)))
    assert tuple(pixels[0, 0]) == (255, 255, 255) and tuple(pixels[1, 1]) == (255, 0, 0)
    gray_alpha = Image.fromarray(np.array([[[50, 0], [50, 255]]], np.uint8), "LA")
    assert np.asarray(load_image(_encode(gray_alpha))).tolist() == [[[255] * 3, [50] * 3]]


def test_gray_cmyk_and_one_bit_modes_become_rgb():
    gray = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4) * 20, "L")
    assert np.array_equal(np.asarray(load_image(_encode(gray)))[..., 1], np.asarray(gray))
    cmyk = Image.new("CMYK", (5, 4), (0, 255, 255, 0))  # pure red in CMYK
    image = load_image(_encode(cmyk, "JPEG", quality=100))
    assert image.mode == "RGB" and np.abs(np.asarray(image).astype(int) - (255, 0, 0)).max() <= 3
    bitmap = Image.new("1", (8, 8), 1)
    assert np.asarray(load_image(_encode(bitmap))).min() == 255


def test_16_bit_samples_are_scaled_not_clipped():
    samples = np.array([[0, 257, 32896, 65535]], np.uint16)  # 8-bit 0, 1, 128, 255
    image = load_image(_encode(Image.fromarray(samples)))  # a 16-bit grayscale PNG
    assert np.asarray(image)[0, :, 0].tolist() == [0, 1, 128, 255]
    wide = Image.fromarray(np.array([[0, 1000, 65535]], np.int32), "I")
    assert np.asarray(load_image(wide))[0, :, 0].tolist() == [0, 4, 255]
    eight_bit_range = Image.fromarray(np.array([[0, 7, 255]], np.int32), "I")
    assert np.asarray(load_image(eight_bit_range))[0, :, 0].tolist() == [0, 7, 255]
    with pytest.raises(ImageError, match="not 8- or 16-bit"):
        load_image(Image.fromarray(np.array([[-5.0, 1e6]], np.float32), "F"))


def test_exif_orientation_is_applied():
    picture = _picture(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, displayed rotated 90 degrees clockwise
    image = load_image(_encode(picture, exif=exif))
    assert image.size == (20, 40)
    assert np.array_equal(np.asarray(image), np.asarray(picture.transpose(Image.Transpose.ROTATE_270)))


def test_animation_gives_its_first_frame():
    frames = [Image.new("RGB", (6, 6), color) for color in ((255, 0, 0), (0, 0, 255))]
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    assert tuple(np.asarray(load_image(data))[0, 0]) == (255, 0, 0)


def test_tiny_and_blank_images_load():
    assert np.asarray(load_image(_encode(Image.new("RGB", (1, 1), (9, 8, 7))))).tolist() == [[[9, 8, 7]]]
    blank = load_image(_encode(Image.new("RGB", (300, 200), (128, 128, 128))))
    assert np.unique(np.asarray(blank)).tolist() == [128]
