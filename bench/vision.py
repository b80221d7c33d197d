"""Images per second through the vision path: batched against one image at a time, in one run.

    .venv/bin/python bench/vision.py [--family qwen2_vl|llava] [--images 16] [--rounds 3]

A random-weight vision-language model (the tower is the part measured: Qwen2-VL-style NaViT or a
CLIP tower, scaled so that a CPU round takes seconds), 224x224-class photos of noise. Rows:
- preprocess: `processor_for(...)` on the PIL images (resize, normalise, patchify).
- tower, one at a time: `encode_images` called once per image.
- tower, batched: one `encode_images` call for all images (what the engine does per step).
- transformers tower, one at a time: the same weights in transformers' vision model (the peer).
- engine, one request at a time / all requests at once: image+text requests (1 output token) through
  LLMEngine, with the encoder cache cleared first, so every image is encoded.
Rounds alternate the rows; medians. A matmul is measured before and after (the host is shared).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import matmul_gflops  # noqa: E402

TEXT = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6)
FAMILIES = {
    "qwen2_vl": dict(
        text_config={**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [8, 12, 12]}},
        vision_config=dict(depth=6, embed_dim=384, hidden_size=256, num_heads=6, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, mlp_ratio=4),
        image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003),
    "llava": dict(
        text_config=dict(model_type="llama", **TEXT),
        vision_config=dict(model_type="clip_vision_model", hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                           num_attention_heads=6, image_size=224, patch_size=14, projection_dim=256),
        image_token_id=1000, vision_feature_layer=-2),
}
PREPROCESSOR = {"qwen2_vl": '{"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 50176, '
                            '"max_pixels": 50176, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}',
                "llava": None}


def build(family: str, folder: Path) -> Path:
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **FAMILIES[family])
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(folder)
    if PREPROCESSOR[family]:
        (folder / "preprocessor_config.json").write_text(PREPROCESSOR[family])
    return folder


def pictures(count: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((224, 224, 3)) * 255).astype("uint8")) for _ in range(count)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_vl")
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from transformers import AutoModelForImageTextToText

    from unified.checkpoint import load_model
    from unified.config.schema import DeviceConfig, EngineConfig, ParallelConfig
    from unified.engine.llm_engine import LLMEngine
    from unified.engine.sampling_params import SamplingParams
    from unified.runtime import start_runtime
    from unified.vision import processor_for

    gflops_before = matmul_gflops()
    start_runtime(DeviceConfig("cpu", "float32"), ParallelConfig(), 0)
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as tmp:
        path = build(args.family, Path(tmp))
        loaded = load_model(path)
        processor = processor_for(path)
        peer = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model, image_token = loaded.model, loaded.config.image_token_id
    tower_params = sum(p.numel() for p in model.vision.parameters())
    engine = LLMEngine(model, None, EngineConfig(num_blocks=2048, block_size=16, max_num_batched_tokens=8192),
                       torch.device("cpu"), torch.float32, None, set(), processor)
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def peer_encode(pixel_values, grid):
        if args.family == "llava":
            return peer.model.get_image_features(pixel_values=pixel_values)
        return peer.model.get_image_features(pixel_values=pixel_values, image_grid_thw=grid)

    def engine_run(images, together: bool):
        engine.runner.encoder_cache.clear()
        groups = [images] if together else [[image] for image in images]
        for group in groups:
            for i, image in enumerate(group):
                engine.add_request([1, 2, image_token, 3, 4], params, f"r{time.perf_counter_ns()}-{i}", images=[image])
            while engine.has_unfinished():
                engine.step()

    rows: dict[str, list[float]] = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            images = pictures(args.images, r)
            inputs = processor(images)
            grid = inputs.image_grid_thw
            per_image = ([(p, None) for p in inputs.pixel_values.split(1)] if grid is None else
                         list(zip(inputs.pixel_values.split(grid.prod(-1).tolist()), grid.split(1))))
            measured = {
                "preprocess": lambda: processor(images),
                "tower, one image at a time": lambda: [model.encode_images(p, g) for p, g in per_image],
                "tower, all images in one call": lambda: model.encode_images(inputs.pixel_values, grid),
                "transformers tower, one at a time": lambda: [peer_encode(p, g) for p, g in per_image],
                "engine, one request at a time": lambda: engine_run(images, together=False),
                "engine, all requests at once": lambda: engine_run(images, together=True),
            }
            for name, fn in measured.items():
                rows.setdefault(name, []).append(args.images / timed(fn))
            print(f"round {r + 1}: " + ", ".join(f"{n.split(',')[0]} {v[-1]:.1f}" for n, v in rows.items()),
                  file=sys.stderr, flush=True)
    gflops_after = matmul_gflops()

    tokens = inputs.num_tokens[0]
    print(f"\n{args.family} tower: {tower_params / 1e6:.1f}M parameters, {per_image[0][0].shape[0] if grid is not None else 1}"
          f" {'patches' if grid is not None else 'image'} -> {tokens} LM tokens per 224x224 image; {args.images} images"
          f" per round, {args.rounds} rounds, fp32, {torch.get_num_threads()} threads")
    print(f"host: matmul {gflops_before:.0f} GFLOP/s before, {gflops_after:.0f} after\n")
    print(f"{'path':<40}{'images/s':>10}   rounds")
    for name, values in rows.items():
        print(f"{name:<40}{statistics.median(values):>10.1f}   {', '.join(f'{v:.1f}' for v in values)}")
    batched = statistics.median(rows["tower, all images in one call"])
    single = statistics.median(rows["tower, one image at a time"])
    print(f"\ntower batched / one at a time: {batched / single:.2f}x; engine all at once / one at a time: "
          f"{statistics.median(rows['engine, all requests at once']) / statistics.median(rows['engine, one request at a time']):.2f}x")


if __name__ == "__main__":
    main()
