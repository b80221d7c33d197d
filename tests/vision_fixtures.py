"""Tiny random-weight vision-language checkpoints of every VL family, and image+text inputs for them.

Each family's config is small but switches on what distinguishes it: M-RoPE and two images of different
sizes (Qwen), several windows per image plus a full-attention block (Qwen2.5-VL), a resampled position table
and an MLA+MoE text model (Kimi-K2.5), a CLIP tower read at an inner layer (LLaVA).
"""
from __future__ import annotations

import numpy as np
import torch

IMAGE_TOKEN = 150
_TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
_QWEN_TOKENS = dict(image_token_id=IMAGE_TOKEN, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)

VL_FAMILIES = {
    "qwen2_vl": dict(text_config={**_TEXT, "rope_parameters": _MROPE},
                     vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, patch_size=4,
                                        spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2), **_QWEN_TOKENS),
    # window_size 16 px = 2 x 2 LM tokens: the 8 x 12-patch image spans 2 x 3 windows; block 1 attends fully.
    "qwen2_5_vl": dict(text_config={**_TEXT, "rope_parameters": _MROPE},
                       vision_config=dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48,
                                          num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                                          window_size=16, fullatt_block_indexes=[1]), **_QWEN_TOKENS),
    "kimi_k25": dict(text_config=dict(model_type="deepseek_v3", **{**_TEXT, "num_key_value_heads": 4},
                                      n_routed_experts=4, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                      v_head_dim=12, first_k_dense_replace=1, n_group=1, topk_group=1,
                                      num_experts_per_tok=2, moe_intermediate_size=32),
                     vision_config=dict(patch_size=4, pos_emb_height=8, pos_emb_width=8, num_attention_heads=4,
                                        num_hidden_layers=2, hidden_size=32, intermediate_size=48),
                     projection_hidden_size=32, image_token_id=IMAGE_TOKEN, video_token_id=151,
                     tie_word_embeddings=False),
    "llava": dict(text_config=dict(model_type="llama", **_TEXT),
                  vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=3, num_attention_heads=4, image_size=16, patch_size=4,
                                     projection_dim=32),
                  image_token_id=IMAGE_TOKEN, vision_feature_layer=-2),
}
# Images per family as (height, width) in patches; LLaVA's are fixed by image_size.
IMAGE_GRIDS = {"qwen2_vl": [(8, 12), (4, 8)], "qwen2_5_vl": [(8, 12), (4, 8)], "kimi_k25": [(8, 12), (4, 6)],
               "llava": [(4, 4), (4, 4)]}


def build_tiny_vl_model(family: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **VL_FAMILIES[family])
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # Norms start at ones and biases at zero; random values make a wrong mapping visible.
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.dim() == 1 and "norm" in name and name.endswith("weight"):
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
            elif name.endswith((".bias", "e_score_correction_bias")):
                tensor.copy_(0.1 * torch.randn_like(tensor))
            elif isinstance(tensor, torch.nn.Parameter) and any(k in name for k in ("vision", "visual", "projector")):
                tensor.mul_(4.0)  # the 0.02 init leaves image rows too faint to check the tower through the logits
    return model


def _pil_images(family: str, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    patch = VL_FAMILIES[family]["vision_config"]["patch_size"]
    return [Image.fromarray((rng.random((h * patch, w * patch, 3)) * 255).astype("uint8"))
            for h, w in IMAGE_GRIDS[family]]


def image_inputs(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """pixel_values (and image_grid_thw for NaViT towers): the HF image processor's output where it runs
    without torchvision, else (Kimi) random patches in the layout its tower reads."""
    vision = VL_FAMILIES[family]["vision_config"]
    if family in ("qwen2_vl", "qwen2_5_vl"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        processor = Qwen2VLImageProcessorPil(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
                                             temporal_patch_size=vision["temporal_patch_size"],
                                             min_pixels=16 * 16, max_pixels=64 * 64)
        out = processor(images=_pil_images(family, seed), return_tensors="pt")
        assert [tuple(g[1:]) for g in out["image_grid_thw"].tolist()] == IMAGE_GRIDS[family]
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    if family == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        size = vision["image_size"]
        processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        return {"pixel_values": processor(images=_pil_images(family, seed), return_tensors="pt")["pixel_values"]}
    patch = vision["patch_size"]
    grids = IMAGE_GRIDS[family]
    patches = sum(h * w for h, w in grids)
    pixels = torch.randn(patches, 3, patch, patch, generator=torch.Generator().manual_seed(seed))
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, h, w] for h, w in grids])}


def prompt_ids(family: str, counts: list[int], seed: int = 0) -> torch.Tensor:
    """[1, S]: text, then each image's placeholders between random text tokens (ids below 140)."""
    generator = torch.Generator().manual_seed(seed)
    pieces = [torch.randint(0, 140, (5,), generator=generator)]
    for count in counts:
        pieces += [torch.full((count,), IMAGE_TOKEN), torch.randint(0, 140, (4,), generator=generator)]
    return torch.cat(pieces).unsqueeze(0)


def reference_logits(hf_model, family: str, ids: torch.Tensor, images: dict[str, torch.Tensor]) -> torch.Tensor:
    kwargs = dict(images)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        kwargs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    with torch.inference_mode():
        return hf_model(input_ids=ids, **kwargs).logits


def build_tiny_vl_chat_checkpoint(path, tokenizer_from, seed: int = 0):
    """A tiny random LLaVA that chats: `tokenizer_from`'s tokenizer and chat template plus `<image>` as one
    special token, the model's image_token_id. Its text weights are drawn wide (std 0.5), as in
    build_tiny_chat_checkpoint, so greedy choices have clear margins."""
    import shutil

    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    text = {**_TEXT, "vocab_size": len(tokenizer), "max_position_embeddings": 1024, "initializer_range": 0.5,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = AutoConfig.for_model("llava", text_config=dict(model_type="llama", **text),
                                  vision_config=VL_FAMILIES["llava"]["vision_config"],
                                  image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if any(k in name for k in ("vision", "projector")):
                tensor.mul_(4.0)  # so that the image, not only the text, decides the answer
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    for name in ("chat_template.jinja", "generation_config.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, path / name)
    return path
