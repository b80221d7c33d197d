"""compose_llava: a text checkpoint + a fresh CLIP tower is a real HF LLaVA checkpoint. transformers loads it
(model and processor) and computes the same logits as our loader on an image prompt; the text weights are
the source's; `<image>` is one token, the placeholder id."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from unified.config.schema import ClipTowerConfig

TOWER = ClipTowerConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4)


def test_composed_llava_loads_in_transformers_and_matches_ours(runtime, tiny_chat_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoProcessor, LlavaForConditionalGeneration

    from unified.checkpoint import load_model
    from unified.checkpoint.compose_vlm import compose_llava
    from unified.chat import chat_prompt
    from unified.vision import expand_image_placeholders, processor_for

    out = compose_llava(tiny_chat_checkpoint, tmp_path / "vlm", TOWER, seed=0)
    hf, info = LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    hf.eval()
    text = AutoModelForCausalLM.from_pretrained(tiny_chat_checkpoint, dtype=torch.float32).state_dict()
    composed = hf.state_dict()
    for name, tensor in text.items():
        ours = composed[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name]
        assert torch.equal(ours[:tensor.shape[0]], tensor), name  # the embedding grew by rows at the end

    processor = AutoProcessor.from_pretrained(out)
    image_token_id = hf.config.image_token_id
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == image_token_id
    image = Image.fromarray((np.random.default_rng(0).random((21, 27, 3)) * 255).astype(np.uint8))
    ours_processor = processor_for(out)
    inputs = ours_processor([image])
    expected_pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(inputs.pixel_values, expected_pixels)
    assert inputs.num_tokens == [(TOWER.image_size // TOWER.patch_size) ** 2]

    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "\nWhat?"}]}]
    prompt = chat_prompt(processor.tokenizer, messages, ours_processor.prompt_marker)
    ids = torch.tensor([expand_image_placeholders(prompt, image_token_id, inputs.num_tokens)])
    with torch.inference_mode():
        reference = hf(input_ids=ids, pixel_values=expected_pixels).logits[0]
        model = load_model(out).model
        hidden = model(ids, torch.arange(ids.shape[1])[None], image_embeds=model.encode_images(inputs.pixel_values))
        logits = model.logits(hidden[0])
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
