"""A LLaVA-layout vision-language checkpoint from a text checkpoint plus a fresh CLIP tower and projector.

No package ships real vision weights, so the tower and projector start random (transformers' own init)
and are trained afterwards (see recipe=vision_demo). The result is an ordinary HF LLaVA folder that
transformers' `LlavaForConditionalGeneration`, `AutoProcessor`, our loader, `processor_for` and the
engine all read: config.json (model_type llava), safetensors, the text tokenizer with an `<image>` token
added (its id is config.image_token_id; the embedding, tied head included, grows by one row, padded to a
multiple of 64), the chat template, and the CLIP image processor (preprocessor_config.json, and
processor_config.json with the token-count settings).
"""
from __future__ import annotations

from pathlib import Path

import torch

from unified.config.schema import ClipTowerConfig
from unified.errors import UserError

IMAGE_TOKEN = "<image>"


def compose_llava(text_checkpoint: str | Path, out_dir: str | Path, tower: ClipTowerConfig, seed: int = 0) -> Path:
    from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPVisionConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if tower.image_size % tower.patch_size or tower.hidden_size % tower.num_heads:
        raise UserError(f"vision tower: image_size {tower.image_size} must be a multiple of patch_size "
                        f"{tower.patch_size}, and hidden_size {tower.hidden_size} of num_heads {tower.num_heads}")
    text_checkpoint, out_dir = Path(text_checkpoint), Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(text_checkpoint)
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = AutoModelForCausalLM.from_pretrained(text_checkpoint, dtype=torch.float32)
    if len(tokenizer) > text.config.vocab_size:
        text.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)  # new rows: the mean embedding

    side = tower.image_size // tower.patch_size
    vision = CLIPVisionConfig(hidden_size=tower.hidden_size, intermediate_size=tower.intermediate_size,
                              num_hidden_layers=tower.num_layers, num_attention_heads=tower.num_heads,
                              image_size=tower.image_size, patch_size=tower.patch_size,
                              projection_dim=tower.hidden_size)
    config = LlavaConfig(vision_config=vision, text_config=text.config, image_token_id=image_token_id,
                         vision_feature_layer=-1, vision_feature_select_strategy="default",
                         image_seq_length=side * side, tie_word_embeddings=text.config.tie_word_embeddings)
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    if config.tie_word_embeddings:
        model.tie_weights()
    else:
        model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.generation_config = text.generation_config
    model.save_pretrained(out_dir)

    size = tower.image_size
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    image_processor.save_pretrained(out_dir)
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=tower.patch_size,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token=IMAGE_TOKEN,
                   chat_template=tokenizer.chat_template).save_pretrained(out_dir)
    return out_dir
