"""Image requests through the engine: teacher-forced logits equal the plain forward of the same model on the
same image+text prompt, with requests batched together, prompts chunked through their images, the vision
encoder cache hit, and prefix caching that tells images apart. Bad images fail their request only."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.engine.conftest import TeacherForcing, assert_no_block_leaks, make_engine
from tests.vision_fixtures import IMAGE_TOKEN
from unified.checkpoint import load_model
from unified.config.schema import EngineConfig
from unified.engine.llm_engine import LLMEngine
from unified.engine.sampling_params import InvalidRequest, SamplingParams
from unified.model.multimodal import mrope_positions
from unified.vision import processor_for

# Small pixel budgets keep the tiny models' prompts short: the Qwen towers see 16-64 patches of 4 px.
PREPROCESSOR = {"qwen2_vl": {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 256, "max_pixels": 1024,
                             "patch_size": 4, "merge_size": 2, "temporal_patch_size": 2},
                "kimi_k25": None, "llava": None}


@pytest.fixture(scope="module")
def vl(runtime, tiny_vl_checkpoint):
    made = {}

    def get(family: str):
        if family not in made:
            path = tiny_vl_checkpoint(family)
            if PREPROCESSOR[family]:
                (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR[family]))
            made[family] = (load_model(path), processor_for(path))
        return made[family]

    return get


def engine_for(loaded, processor, **options) -> LLMEngine:
    options.setdefault("num_blocks", 96)
    options.setdefault("block_size", 4)
    return LLMEngine(loaded.model, None, EngineConfig(**options), torch.device("cpu"), torch.float32, None, set(),
                     processor)


def picture(seed: int, size=(28, 20)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def prompt(seed: int, images: int) -> list[int]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 140, 5).tolist()
    for _ in range(images):
        ids += [IMAGE_TOKEN] + rng.integers(0, 140, 3).tolist()
    return ids


@torch.inference_mode()
def reference(loaded, processor, ids: list[int], images: list, continuation: list[int]) -> torch.Tensor:
    """The plain forward over the expanded prompt + continuation: logits that predict each continuation token."""
    from unified.vision import expand_image_placeholders

    model, config = loaded.model, loaded.config
    inputs = processor(images) if images else None
    full = torch.tensor([(expand_image_placeholders(ids, IMAGE_TOKEN, inputs.num_tokens) if images else ids)
                         + continuation])
    embeds = model.encode_images(inputs.pixel_values, inputs.image_grid_thw) if images else None
    if config.mrope_section:
        prompt_len = full.shape[1] - len(continuation)
        positions, delta = mrope_positions(full[0, :prompt_len], inputs.image_grid_thw if images else None, config)
        tail = torch.arange(prompt_len, full.shape[1]) + delta
        positions = torch.cat([positions, tail.expand(3, -1)], dim=1)
    else:
        positions = torch.arange(full.shape[1])
    logits = model.logits(model(full, positions, image_embeds=embeds))[0]
    start = full.shape[1] - len(continuation) - 1
    return logits[start:start + len(continuation)]


def run(engine: LLMEngine, requests: list[tuple[list[int], list, list[int]]]) -> list[torch.Tensor]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=len(c), ignore_eos=True), images=imgs or None)
           for p, imgs, c in requests]
    forcing = TeacherForcing(dict(zip(ids, [c for _, _, c in requests])))
    while engine.has_unfinished():
        engine.step(forcing)
    return [torch.stack(forcing.logits[i]) for i in ids]


@pytest.mark.parametrize("family", ["qwen2_vl", "kimi_k25", "llava"])
@pytest.mark.parametrize("chunk", [2048, 24])
def test_image_requests_match_the_plain_forward(vl, family, chunk):
    loaded, processor = vl(family)
    engine = engine_for(loaded, processor, max_num_batched_tokens=chunk)
    requests = [(prompt(1, 1), [picture(1)], [7, 8, 9, 10]),
                (prompt(2, 2), [picture(2, (16, 36)), picture(3)], [11, 12, 13]),
                (prompt(3, 0), [], [14, 15, 16]),  # text only, in the same steps
                (prompt(4, 1), [picture(1)], [17, 18])]  # the first request's image again: encoded once
    later = [(prompt(5, 1), [picture(3)], [19, 20])]  # an image encoded before: from the encoder cache
    got = run(engine, requests) + run(engine, later)
    for (ids, images, continuation), logits in zip(requests + later, got):
        want = reference(loaded, processor, ids, images, continuation)
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    assert engine.runner.encoder_cache.misses == 3 and engine.runner.encoder_cache.hits >= 1
    assert_no_block_leaks(engine)


def test_prefix_cache_hits_only_for_the_same_image(vl):
    loaded, processor = vl("qwen2_vl")
    engine = engine_for(loaded, processor)
    text = list(range(20, 36)) + [IMAGE_TOKEN] + list(range(40, 60))  # 16 tokens (4 blocks) before the image

    def cached(image) -> int:
        rid = engine.add_request(text, SamplingParams(max_tokens=1, ignore_eos=True), images=[image])
        while engine.has_unfinished():
            for out in engine.step():
                assert out.request_id == rid
                result = out.num_cached_tokens
        return result

    first = cached(picture(5))
    assert first == 0
    assert cached(picture(6)) == 16  # only the text blocks before the image
    assert cached(picture(5)) > 16  # the same image: its blocks and the text after it
    assert_no_block_leaks(engine)


def test_bad_images_fail_their_request_only(vl, tiny_checkpoint):
    loaded, processor = vl("llava")
    engine = engine_for(loaded, processor)
    good = engine.add_request(prompt(1, 1), SamplingParams(max_tokens=2, ignore_eos=True), images=[picture(1)])
    bad = {"not an image": b"definitely not an image",
           "truncated": _png_bytes(picture(2))[:60],
           "zero bytes": b"",
           "remote url": "https://example.com/cat.png"}
    for what, image in bad.items():
        with pytest.raises(InvalidRequest) as err:
            engine.add_request(prompt(2, 1), SamplingParams(max_tokens=2), images=[image])
        assert len(str(err.value)) > 20, what
    with pytest.raises(InvalidRequest, match="placeholder"):
        engine.add_request(prompt(2, 2), SamplingParams(max_tokens=2), images=[picture(1)])
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == [good] and len(outputs[0].outputs[0].token_ids) == 2
    assert_no_block_leaks(engine)

    text_engine = make_engine(load_model(tiny_checkpoint("llama")))
    with pytest.raises(InvalidRequest, match="no image input"):
        text_engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), images=[picture(1)])


def test_images_the_tower_fails_on_fail_their_request_only(vl):
    """A request whose images the vision tower raises on (batched with others, then alone) ends with the
    error; the requests in the same steps finish as they would alone."""
    loaded, processor = vl("llava")
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    alone = engine_for(loaded, processor)
    alone.add_request(prompt(1, 1), params, "good", images=[picture(1)])
    expected = [o for _ in range(4) for o in alone.step()][0].outputs[0].token_ids

    engine = engine_for(loaded, processor)
    engine.add_request(prompt(1, 1), params, "good", images=[picture(1)])
    engine.add_request(prompt(2, 1), params, "poisoned", images=[picture(2)])
    poison = engine.requests["poisoned"].seqs[0].multimodal.images[0].pixel_values
    encode = engine.runner._encode

    def refusing(pixels, grid):
        if any(torch.equal(image, poison) for image in pixels):
            raise RuntimeError("the tower cannot take this image")
        return encode(pixels, grid)

    engine.runner._encode = refusing
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert outputs["good"].error is None and outputs["good"].outputs[0].token_ids == expected
    assert "cannot take this image" in outputs["poisoned"].error
    assert outputs["poisoned"].outputs[0].finish_reason == "error"
    assert_no_block_leaks(engine)


def _png_bytes(image: Image.Image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_prefetch_encodes_the_next_requests_images_during_the_step_before(vl):
    loaded, processor = vl("qwen2_vl")
    engine = engine_for(loaded, processor, max_num_seqs=1, image_prefetch=True)  # one request at a time
    requests = [(prompt(i, 1), [picture(10 + i)], [7, 8]) for i in range(3)]
    got = run(engine, requests)
    for (ids, images, continuation), logits in zip(requests, got):
        torch.testing.assert_close(logits, reference(loaded, processor, ids, images, continuation), atol=1e-4, rtol=1e-4)
    cache = engine.runner.encoder_cache
    # The first image is encoded by its own step; the other two while the request before them ran.
    assert cache.misses == 3 and cache.hits == 2
    assert_no_block_leaks(engine)
