"""Vision-language models against `transformers` on the same weights (fp32): image+text logits, M-RoPE
positions, chunked prompts, checkpoint layouts, export round-trip and bad checkpoints."""
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.vision_fixtures import IMAGE_TOKEN, VL_FAMILIES, image_inputs, prompt_ids, reference_logits
from unified.checkpoint import CheckpointError, export_hf, load_model
from unified.errors import UserError
from unified.jobs.parity import cosine
from unified.model.multimodal import VisionLanguageModel, mrope_positions


def _hf_model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def _positions(loaded, ids, grid):
    if loaded.config.mrope_section:
        return mrope_positions(ids[0], grid, loaded.config)[0]  # [3, S]
    return torch.arange(ids.shape[1])


def _our_logits(loaded, images, seed: int = 0):
    """(logits [1, S, V], prompt ids) for a prompt holding every image of `images`."""
    model = loaded.model
    grid = images.get("image_grid_thw")
    with torch.inference_mode():
        embeds = model.encode_images(images["pixel_values"], grid)
        grid = grid if grid is not None else model.vision.grid_of(images["pixel_values"])
        ids = prompt_ids(loaded.config.vision.kind, model.image_token_counts(grid), seed)
        return model.logits(model(ids, _positions(loaded, ids, grid), image_embeds=embeds)), ids


@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_image_and_text_logits_match_transformers(family, runtime, tiny_vl_checkpoint):
    path = tiny_vl_checkpoint(family)
    ours = load_model(path)
    assert isinstance(ours.model, VisionLanguageModel)
    images = image_inputs(family)
    logits, ids = _our_logits(ours, images)
    assert int((ids == IMAGE_TOKEN).sum()) >= 2 * 8  # both images are in the prompt
    reference = reference_logits(_hf_model(path), family, ids, images)
    assert cosine(logits, reference) >= 0.99999
    assert (logits - reference).abs().max().item() <= 1e-4
    # The images matter: other pixels move the logits of the text after them well beyond the tolerance.
    other = _our_logits(ours, {**images, "pixel_values": images["pixel_values"].flip(0)})[0]
    assert (other - logits).abs().max().item() > 1e-2


def test_qwen25_tower_runs_windows_and_full_attention(runtime, tiny_vl_checkpoint):
    tower = load_model(tiny_vl_checkpoint("qwen2_5_vl")).model.vision
    _, _, frames, windows = tower._layout(image_inputs("qwen2_5_vl")["image_grid_thw"], torch.device("cpu"))
    assert windows.unique().numel() > 2 * frames.unique().numel()  # several windows per image
    assert tower.config.fullatt_blocks == [1] and tower.config.depth == 3


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_mrope_positions_match_get_rope_index(family, runtime, tiny_vl_checkpoint):
    path = tiny_vl_checkpoint(family)
    ours = load_model(path)
    grid = image_inputs(family)["image_grid_thw"]
    ids = prompt_ids(family, ours.model.image_token_counts(grid))
    positions, delta = mrope_positions(ids[0], grid, ours.config)
    expected, deltas = _hf_model(path).model.get_rope_index(ids, (ids == IMAGE_TOKEN).int(), image_grid_thw=grid)
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(deltas[0, 0])


def test_text_positions_on_an_mrope_model_broadcast_to_three_axes(runtime, tiny_vl_checkpoint):
    model = load_model(tiny_vl_checkpoint("qwen2_vl")).model
    ids = torch.randint(0, 140, (2, 12), generator=torch.Generator().manual_seed(3))
    flat = torch.arange(12).expand(2, -1)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids, flat), model(ids, flat.expand(3, -1, -1)), rtol=0, atol=0)


def test_a_chunk_takes_only_its_own_image_rows(runtime, tiny_vl_checkpoint):
    ours = load_model(tiny_vl_checkpoint("qwen2_vl"))
    model, images = ours.model, image_inputs("qwen2_vl")
    full, ids = _our_logits(ours, images)
    positions = _positions(ours, ids, images["image_grid_thw"])
    cut = int((ids[0] == IMAGE_TOKEN).nonzero()[10]) + 1  # inside the first image
    with torch.inference_mode():
        rows = model.encode_images(images["pixel_values"], images["image_grid_thw"])[:11]
        chunk = model.logits(model(ids[:, :cut], positions[:, :cut], image_embeds=rows))
        with pytest.raises(UserError, match=r"11 image placeholder tokens \(id 150\) but 12 image embedding rows"):
            model(ids[:, :cut], positions[:, :cut], image_embeds=torch.cat((rows, rows[:1])))
    torch.testing.assert_close(chunk, full[:, :cut], rtol=1e-5, atol=1e-5)


# Other layouts of the same tensors: the original Hub releases and transformers' in-memory names.
LAYOUTS = {
    "qwen2_vl": [(r"^visual\.", "model.visual."), (r"^model\.(?!visual)", "model.language_model.")],
    "llava": [(r"^vision_tower\.", "vision_tower.vision_model.")],
    "kimi_k25": [(r"^language_model\.model\.blocks\.", "language_model.model.layers."),
                 (r"^vision_tower\.encoder\.patch_embed\.", "vision_tower.patch_embed."),
                 (r"^model\.mm_projector\.", "mm_projector.")],
}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_other_checkpoint_layouts_load_the_same_model(family, runtime, tiny_vl_checkpoint, tmp_path):
    source = tiny_vl_checkpoint(family)
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    state = load_file(tmp_path / "model.safetensors")
    renamed = {}
    for name, tensor in state.items():
        for pattern, replacement in LAYOUTS[family]:
            name = re.sub(pattern, replacement, name)
        renamed[name] = tensor
    assert set(renamed) != set(state)
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    images = image_inputs(family)
    torch.testing.assert_close(_our_logits(load_model(tmp_path), images)[0],
                               _our_logits(load_model(source), images)[0], rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(VL_FAMILIES))
def test_export_round_trips_through_transformers(family, runtime, tiny_vl_checkpoint, tmp_path):
    from transformers import AutoModelForImageTextToText

    path = tiny_vl_checkpoint(family)
    ours = load_model(path)
    export_hf(ours, tmp_path / "export")
    assert set(load_file(tmp_path / "export" / "model.safetensors")) == set(load_file(path / "model.safetensors"))
    reloaded, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "export", dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info.values()), info
    images = image_inputs(family)
    logits, ids = _our_logits(ours, images)
    torch.testing.assert_close(reference_logits(reloaded.eval(), family, ids, images),
                               reference_logits(_hf_model(path), family, ids, images), rtol=0, atol=0)
    assert cosine(logits, reference_logits(reloaded, family, ids, images)) >= 0.99999


def test_missing_vision_tensor_is_named(runtime, tiny_vl_checkpoint, tmp_path):
    shutil.copytree(tiny_vl_checkpoint("qwen2_5_vl"), tmp_path, dirs_exist_ok=True)
    state = load_file(tmp_path / "model.safetensors")
    del state["visual.blocks.2.attn.qkv.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'visual.blocks.2.attn.qkv.weight' is missing"):
        load_model(tmp_path)


def test_vision_shape_mismatch_is_explained(runtime, tiny_vl_checkpoint, tmp_path):
    shutil.copytree(tiny_vl_checkpoint("llava"), tmp_path, dirs_exist_ok=True)
    state = load_file(tmp_path / "model.safetensors")
    state["multi_modal_projector.linear_1.weight"] = state["multi_modal_projector.linear_1.weight"][:, :16].clone()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"shape mismatch: multi_modal_projector.linear_1.weight .*"
                                              r"vision.projector.fc1.weight"):
        load_model(tmp_path)
