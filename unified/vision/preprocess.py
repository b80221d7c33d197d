"""The image processor of a checkpoint: `processor_for(checkpoint_dir)`.

The family comes from config.json's model_type (or, without one, preprocessor_config.json's
image_processor_type); the settings from preprocessor_config.json in either the transformers layout
or, for Kimi-K2.5, its original `media_proc_cfg` block. Without a preprocessor_config.json the
family's transformers defaults apply, with patch and merge sizes taken from config.json's
vision_config so the token counts agree with the vision tower. Token-count settings for LLaVA come
from processor_config.json, else config.json. Settings that change the algorithm in a way we do not
implement are refused at load, naming the key.
"""
from __future__ import annotations

import json
from pathlib import Path

from unified.errors import UserError
from unified.vision.kimi_k25 import KimiK25Processor
from unified.vision.llava import LlavaProcessor
from unified.vision.pixels import ImageProcessor
from unified.vision.qwen2_vl import Qwen2VLProcessor

FAMILY_OF = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2VLProcessor, "llava": LlavaProcessor,
             "kimi_k25": KimiK25Processor}
_FAMILY_OF_PROCESSOR_TYPE = {"Qwen2VLImageProcessor": "qwen2_vl", "CLIPImageProcessor": "llava",
                             "LlavaImageProcessor": "llava", "Kimi_K25ImageProcessor": "kimi_k25"}
_COMMON_KEYS = ("image_mean", "image_std", "rescale_factor")
# Where config.json keeps the placeholder token's id, by family and vintage.
_IMAGE_TOKEN_ID_KEYS = ("image_token_id", "image_token_index", "media_placeholder_token_id")


def processor_for(checkpoint_dir) -> ImageProcessor:
    """The image processor a checkpoint's model expects (see the module docstring for the sources)."""
    root = Path(checkpoint_dir)
    model, preprocessor, processor = (_read_json(root / name) for name in
                                      ("config.json", "preprocessor_config.json", "processor_config.json"))
    model_type = model.get("model_type") or _FAMILY_OF_PROCESSOR_TYPE.get(
        str(preprocessor.get("image_processor_type", "")).removesuffix("Fast").removesuffix("Pil"))
    if model_type is None:
        raise UserError(f"{root}: neither config.json's model_type nor preprocessor_config.json's "
                        "image_processor_type names a model family; is this a vision-language checkpoint?")
    if model_type not in FAMILY_OF:
        raise UserError(f"{root}: model_type {model_type!r} takes no image input here; image input is "
                        f"implemented for {', '.join(sorted(FAMILY_OF))}.")
    family = FAMILY_OF[model_type]
    build = {Qwen2VLProcessor: _qwen2_vl, LlavaProcessor: _llava, KimiK25Processor: _kimi_k25}[family]
    result = build(preprocessor, model.get("vision_config") or {}, {**model, **processor}, root)
    result.image_token_id = next((model[key] for key in _IMAGE_TOKEN_ID_KEYS if key in model), None)
    return result


def image_prompt_marker(model_type: str) -> str:
    """The text one image is written as in a prompt of this model family (what its chat template emits)."""
    if model_type not in FAMILY_OF:
        raise UserError(f"model_type {model_type!r} takes no image input here; image input is implemented "
                        f"for {', '.join(sorted(FAMILY_OF))}.")
    return FAMILY_OF[model_type].prompt_marker


def _qwen2_vl(pre: dict, vision: dict, _: dict, root: Path) -> Qwen2VLProcessor:
    _refuse(pre, root, do_resize=True, do_convert_rgb=True)
    size = pre.get("size") or {}
    defaults = Qwen2VLProcessor()
    return Qwen2VLProcessor(
        min_pixels=pre.get("min_pixels", size.get("shortest_edge", defaults.min_pixels)),
        max_pixels=pre.get("max_pixels", size.get("longest_edge", defaults.max_pixels)),
        patch_size=pre.get("patch_size", vision.get("patch_size", defaults.patch_size)),
        temporal_patch_size=pre.get("temporal_patch_size", vision.get("temporal_patch_size",
                                                                      defaults.temporal_patch_size)),
        merge_size=pre.get("merge_size", vision.get("spatial_merge_size", defaults.merge_size)),
        resample=pre.get("resample", defaults.resample),
        do_rescale=pre.get("do_rescale", True), do_normalize=pre.get("do_normalize", True),
        **_common(pre))


def _llava(pre: dict, vision: dict, tokens: dict, root: Path) -> LlavaProcessor:
    _refuse(pre, root, do_resize=True, do_convert_rgb=True)
    side = 224 if pre else vision.get("image_size", 224)  # transformers' class default, else the tower's
    size = pre.get("size", {"shortest_edge": side})
    size = {"shortest_edge": size} if isinstance(size, int) else size
    if set(size) not in ({"shortest_edge"}, {"height", "width"}):
        raise UserError(f"{root / 'preprocessor_config.json'}: size {size} is not supported; use "
                        '{"shortest_edge": N} or {"height": H, "width": W}.')
    crop = pre.get("crop_size", side)
    crop = (crop, crop) if isinstance(crop, int) else (crop["height"], crop["width"])
    do_center_crop = pre.get("do_center_crop", True)
    if not do_center_crop and "shortest_edge" in size:
        raise UserError(f"{root / 'preprocessor_config.json'}: do_center_crop false with a shortest_edge "
                        "resize gives images of different sizes, which LLaVA cannot batch; set do_center_crop.")
    clip_tower = "clip" in str(vision.get("model_type", "clip_vision_model"))
    return LlavaProcessor(
        shortest_edge=size.get("shortest_edge"), height=size.get("height"), width=size.get("width"),
        crop_size=crop if do_center_crop else None, do_pad=bool(pre.get("do_pad", False)),
        resample=pre.get("resample", LlavaProcessor.resample),
        do_rescale=pre.get("do_rescale", True), do_normalize=pre.get("do_normalize", True),
        patch_size=tokens.get("patch_size") or vision.get("patch_size", 14),
        num_additional_image_tokens=tokens.get("num_additional_image_tokens", int(clip_tower)),
        vision_feature_select_strategy=tokens.get("vision_feature_select_strategy") or "default",
        **_common(pre))


def _kimi_k25(pre: dict, vision: dict, _: dict, root: Path) -> KimiK25Processor:
    defaults = KimiK25Processor()
    if "media_proc_cfg" in pre:  # the original (remote-code) layout
        media = pre["media_proc_cfg"]
        return KimiK25Processor(
            patch_size=media.get("patch_size", defaults.patch_size),
            merge_size=media.get("merge_kernel_size", defaults.merge_size),
            max_patches=media.get("in_patch_limit", defaults.max_patches),
            max_size_per_side=media.get("patch_limit_on_one_side", defaults.max_size_per_side),
            **_common(media))
    _refuse(pre, root, do_resize=True, do_convert_rgb=True, do_rescale=True, do_normalize=True,
            resample=3)
    size = pre.get("size") or {}
    merge = vision.get("merge_kernel_size", defaults.merge_size)
    return KimiK25Processor(
        patch_size=pre.get("patch_size", vision.get("patch_size", defaults.patch_size)),
        merge_size=pre.get("merge_size", merge[0] if isinstance(merge, list) else merge),
        max_patches=pre.get("max_patches", defaults.max_patches),
        max_size_per_side=size.get("max_height", defaults.max_size_per_side), **_common(pre))


def _common(config: dict) -> dict:
    return {key: tuple(config[key]) if isinstance(config[key], list) else config[key]
            for key in _COMMON_KEYS if key in config}


def _refuse(config: dict, root: Path, **supported) -> None:
    for key, value in supported.items():
        if key in config and config[key] != value:
            raise UserError(f"{root / 'preprocessor_config.json'}: {key}={config[key]!r} is not supported "
                            f"(only {value!r}); remove the key or set it to {value!r}.")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e}); fix or remove the file.") from None
