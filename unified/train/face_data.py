"""The face / not-a-face image task of recipe=vision_demo, from images that ship inside scikit-image.

`lfw_subset.npy` holds 100 aligned 25x25 grey faces (Labeled Faces in the Wild) then 100 non-face patches
of natural images. A seeded shuffle keeps `heldout_per_class` of each class out of training; the training
side adds each image's mirror and non-face crops of scikit-image's bundled sample photographs (plus the
astronaut's face). Everything is written as PNG files and chat JSONL lines that `recipe=sft` reads:
the user sends the image and QUESTION, the assistant answers "face" or "not a face".
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from unified.errors import UserError

QUESTION = "Is this a face? Answer 'face' or 'not a face'."
FACE, NOT_FACE = "face", "not a face"
# Bundled photographs without a face in them (the others scikit-image downloads on first use).
NON_FACE_SAMPLES = ("coffee.png", "rocket.jpg", "brick.png", "grass.png", "gravel.png", "coins.png", "moon.png",
                    "page.png", "text.png", "horse.png", "hubble_deep_field.jpg", "retina.jpg", "cell.png")
ASTRONAUT_FACE = ("astronaut.png", (180, 70, 300, 190))  # (left, top, right, bottom)
CROPS_PER_SAMPLE = 4


def _skimage_data() -> Path:
    try:
        import skimage.data
    except ImportError:
        raise UserError("recipe=vision_demo needs scikit-image (pip install scikit-image; scripts/setup.sh "
                        "installs it)") from None
    folder = Path(skimage.data.__file__).parent
    if not (folder / "lfw_subset.npy").is_file():
        raise UserError(f"{folder} has no lfw_subset.npy; reinstall scikit-image (its wheel ships the file)")
    return folder


def chat_line(image: str, answer: str | None) -> dict:
    """One conversation: `image` (a path relative to the JSONL file) with QUESTION, and the answer if given."""
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "\n" + QUESTION}]}]
    return {"messages": messages + ([{"role": "assistant", "content": answer}] if answer else [])}


def parse_answer(reply: str) -> str | None:
    """FACE, NOT_FACE, or None for a reply that is neither."""
    text = reply.strip().lower().rstrip(".!")
    return NOT_FACE if text.startswith("not a face") else FACE if text == FACE else None


def _sample_images(folder: Path, rng: random.Random) -> list[tuple[Image.Image, str]]:
    out = []
    for name in NON_FACE_SAMPLES:
        if not (folder / name).is_file():
            continue
        photo = ImageOps.grayscale(Image.open(folder / name))
        for _ in range(CROPS_PER_SAMPLE):
            side = rng.randint(min(photo.size) // 6, min(photo.size) // 2)
            left, top = rng.randint(0, photo.width - side), rng.randint(0, photo.height - side)
            out.append((photo.crop((left, top, left + side, top + side)).resize((25, 25)), NOT_FACE))
    name, box = ASTRONAUT_FACE
    if (folder / name).is_file():
        out.append((ImageOps.grayscale(Image.open(folder / name)).crop(box).resize((25, 25)), FACE))
    return out


def write_face_data(out: Path, heldout_per_class: int, seed: int) -> tuple[Path, Path]:
    """Writes out/images/*.png, out/train.jsonl and out/heldout.jsonl; returns the two JSONL paths."""
    folder = _skimage_data()
    lfw = np.load(folder / "lfw_subset.npy")  # [200, 25, 25] in [0, 1]: faces, then non-faces
    per_class = len(lfw) // 2
    if not 0 < heldout_per_class < per_class:
        raise UserError(f"vision_demo.heldout_per_class={heldout_per_class} must be between 1 and {per_class - 1}")
    rng = random.Random(seed)
    train, heldout = [], []
    for label, indices in ((FACE, range(per_class)), (NOT_FACE, range(per_class, len(lfw)))):
        order = list(indices)
        rng.shuffle(order)
        pictures = [(Image.fromarray((lfw[i] * 255).round().astype(np.uint8)), label) for i in order]
        heldout += pictures[:heldout_per_class]
        train += [(p, label) for picture, _ in pictures[heldout_per_class:] for p in (picture, ImageOps.mirror(picture))]
    train += _sample_images(folder, rng)
    rng.shuffle(train)
    (out / "images").mkdir(parents=True, exist_ok=True)
    paths = []
    for split, items in (("train", train), ("heldout", heldout)):
        lines = []
        for i, (picture, label) in enumerate(items):
            name = f"images/{split}-{i:04d}.png"
            picture.save(out / name)
            lines.append(json.dumps(chat_line(name, label)))
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        paths.append(out / f"{split}.jsonl")
    return paths[0], paths[1]
