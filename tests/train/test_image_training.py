"""Training on image+text lines: loading (paths relative to the data file, data URLs, bad images skipped),
placeholder expansion without loss on image tokens, and packed batches whose loss and gradients equal plain
per-example forwards with `image_embeds` (no image or attention crosses an example boundary)."""
from __future__ import annotations

import base64
import io
import json
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from unified.config.schema import ClipTowerConfig

TOWER = ClipTowerConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4)
TOKENS_PER_IMAGE = (16 // 4) ** 2


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory, tiny_chat_checkpoint):
    from unified.checkpoint.compose_vlm import compose_llava

    return compose_llava(tiny_chat_checkpoint, tmp_path_factory.mktemp("tiny-llava"), TOWER, seed=0)


def _png(rng: np.random.Generator, size: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _line(images: list[str], answer: str) -> str:
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": "\nWhat is it?"}]
    return json.dumps({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]})


@pytest.fixture
def image_data(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "pics").mkdir()
    for name, size in (("a.png", 20), ("b.png", 16), ("c.png", 30)):
        (tmp_path / "pics" / name).write_bytes(_png(rng, size))
    url = "data:image/png;base64," + base64.b64encode(_png(rng, 24)).decode()
    lines = [_line(["pics/a.png"], "a face"),
             _line(["pics/b.png", "pics/c.png"], "not a face, twice"),
             json.dumps({"messages": [{"role": "user", "content": "no image here"},
                                      {"role": "assistant", "content": "text only"}]}),
             _line(["pics/missing.png"], "never read"),
             _line([url], "from a data URL")]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _load(checkpoint, data, seq_len: int = 256):
    from transformers import AutoTokenizer

    from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from unified.train.data import load_examples
    from unified.train.trainer import _image_support

    config = model_config_from_hf(read_hf_config(checkpoint))
    return config, load_examples(data, AutoTokenizer.from_pretrained(checkpoint), seq_len,
                                 _image_support(config, checkpoint, str(data)))


def test_image_lines_load_with_expanded_placeholders_and_no_loss_on_them(runtime, tiny_llava, image_data, caplog):
    from unified.train.data import IGNORE

    with caplog.at_level(logging.WARNING):
        config, examples = _load(tiny_llava, image_data)
    assert "train.jsonl:4 skipped" in caplog.text and "missing.png" in caplog.text
    assert [None if e.pixel_values is None else e.pixel_values.shape[0] for e in examples] == [1, 2, None, 1]
    for example in examples:
        images = 0 if example.pixel_values is None else example.pixel_values.shape[0]
        image_positions = [i for i, t in enumerate(example.input_ids) if t == config.image_token_id]
        assert len(image_positions) == images * TOKENS_PER_IMAGE
        assert all(example.labels[i] == IGNORE for i in image_positions)
        assert example.num_targets > 0
    assert tuple(examples[0].pixel_values.shape[1:]) == (3, 16, 16)

    _, short = _load(tiny_llava, image_data, seq_len=40)  # cutting into an image skips the line
    assert all(e.pixel_values is None or e.input_ids.count(config.image_token_id) ==
               e.pixel_values.shape[0] * TOKENS_PER_IMAGE for e in short)


def _plain_loss(model, example) -> torch.Tensor:
    from unified.train.data import IGNORE

    ids = torch.tensor([example.input_ids])
    images = {}
    if example.pixel_values is not None:
        images["image_embeds"] = model.encode_images(example.pixel_values)
    hidden = model(ids, torch.arange(ids.shape[1])[None], **images)[0]  # [L, H]
    targets = torch.tensor(example.labels[1:] + [IGNORE])
    return F.cross_entropy(model.logits(hidden).float(), targets, ignore_index=IGNORE, reduction="sum")


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_packed_image_batches_equal_per_example_forwards(runtime, tiny_llava, image_data):
    from unified.checkpoint import load_model
    from unified.train.engine import TrainingModel
    from unified.train.packing import collate
    from unified.train.trainer import _freeze_all_but

    _, examples = _load(tiny_llava, image_data)
    model = load_model(tiny_llava).model.train()
    _freeze_all_but(model, "projector")
    reference = sum(_plain_loss(model, e) for e in examples)
    reference.backward()
    expected = _grads(model)
    assert set(expected) == {n for n, _ in model.named_parameters() if n.startswith("vision.projector.")}

    wrapped = TrainingModel(model)
    for rows in ([[0, 1, 2, 3]], [[3, 1], [2, 0]]):  # one packed row; two rows of two, images in other orders
        batch = collate(examples, rows, pad_id=0)
        assert batch.pixel_values.shape[0] == 4
        loss = wrapped(batch.input_ids, batch.positions, batch.targets, batch.segments, batch.pixel_values,
                       batch.image_grid_thw)
        torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-4)
        loss.backward()
        got = _grads(model)
        assert got.keys() == expected.keys()
        for name, grad in expected.items():  # fp32 sums in another order: close relative to the gradient's scale
            torch.testing.assert_close(got[name], grad, rtol=1e-3, atol=1e-3 * float(grad.abs().max()))


def test_trainable_vision_trains_tower_and_projector_only(runtime, tiny_llava, tiny_chat_checkpoint):
    from unified.checkpoint import load_model
    from unified.errors import UserError
    from unified.train.trainer import _freeze_all_but

    model = load_model(tiny_llava).model
    _freeze_all_but(model, "vision")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if n.startswith("vision.")}
    with pytest.raises(UserError, match="the model is text-only"):
        _freeze_all_but(load_model(tiny_chat_checkpoint).model, "projector")
