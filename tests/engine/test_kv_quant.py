"""Quantised KV caches: accuracy on real weights and bytes per token."""
import pytest
import torch
import torch.nn.functional as F

from tests.engine.conftest import assert_no_block_leaks, make_engine, run_teacher_forced
from unified import kernels
from unified.checkpoint import load_model
from unified.engine.kv_cache import CacheShape

TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
        "books were made, who could read them, and how quickly new ideas travelled between cities. ")


@pytest.mark.parametrize("bits,zero_point", [(8, False), (4, False), (4, True)])
def test_quantize_roundtrip_error_is_bounded(bits, zero_point):
    x = torch.randn(7, 3, 64) + 5 * torch.randn(64)
    values, scale = kernels.quantize_kv(x, bits, zero_point=zero_point)
    trailing, dtype = kernels.scale_layout(64, bits, zero_point)
    assert values.shape[-1] == kernels.packed_dim(64, bits)
    assert scale.shape == (7, 3, *trailing) and scale.dtype == dtype
    back = kernels.dequantize_kv(values, scale, bits, torch.float32)
    # Rounding moves each rotated channel by at most half its step (int4: one per group of 32); the rotation
    # preserves the norm.
    step = scale[..., None].expand(7, 3, 64) if bits == 8 else scale[..., :2].float().repeat_interleave(32, -1)
    assert ((back - x).norm(dim=-1) <= step.pow(2).sum(-1).sqrt() / 2 * 1.01 + 1e-4).all()


def test_int4_centre_is_subtracted_and_not_restored():
    x = torch.randn(7, 3, 64) + 5 * torch.randn(64)
    centre = x.mean(0)
    back = kernels.dequantize_kv(*kernels.quantize_kv(x, 4, centre, zero_point=True), 4, torch.float32)
    uncentred = kernels.dequantize_kv(*kernels.quantize_kv(x, 4, zero_point=True), 4, torch.float32)
    assert (back - (x - centre)).norm() < 0.5 * (uncentred - x).norm()


@pytest.fixture(scope="module")
def decode_logits(runtime, smollm2_checkpoint):
    """Logits of 64 teacher-forced decode steps after a 512-token prompt, per KV-cache dtype."""
    from transformers import AutoTokenizer

    loaded = load_model(smollm2_checkpoint)
    ids = AutoTokenizer.from_pretrained(smollm2_checkpoint)(TEXT * 40)["input_ids"]
    prompt, continuation = ids[:512], ids[512:576]

    def run(dtype: str) -> torch.Tensor:
        engine = make_engine(loaded, num_blocks=40, block_size=16, kv_cache_dtype=dtype, max_num_batched_tokens=512)
        logits = run_teacher_forced(engine, [prompt], [continuation])[0]
        assert_no_block_leaks(engine)
        assert logits.shape[0] == 64
        return logits

    return run


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def test_int8_cache_tracks_the_full_precision_cache(decode_logits):
    full, int8 = decode_logits("auto"), decode_logits("int8")
    assert _cosine(int8, full) >= 0.999
    assert F.cosine_similarity(int8, full, dim=-1).mean() >= 0.999


def test_int4_cache_tracks_the_full_precision_cache(decode_logits):
    # int4 rounding amplifies last-bit differences of the K/V it quantises: the C++ kernels of an AVX-512
    # host and the PyTorch paths (full-precision logits equal to 1e-4) give int4 cosines about 0.01 apart,
    # and so do torch releases or weights scaled by 1 +- 1e-6 (from 0.97 to 0.995). A broken int4 cache falls
    # far below any of them, and would change the model's greedy choices.
    int4, full = decode_logits("int4"), decode_logits("auto")
    assert _cosine(int4, full) >= 0.95
    assert (int4.argmax(-1) == full.argmax(-1)).float().mean() >= 0.95


def test_bytes_per_token_include_scales(runtime, smollm2_checkpoint):
    config = load_model(smollm2_checkpoint).config
    shape = CacheShape.of(config)
    fp32 = shape.bytes_per_token(config.num_layers, torch.float32, None)
    assert fp32 == config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    assert shape.bytes_per_token(config.num_layers, torch.float32, 8) <= 0.30 * fp32
    # int4 per head: keys 32 code bytes + 2 fp16 scales and 2 zeros, values 32 + 2 scales: 76 / 512 of fp32.
    assert shape.bytes_per_token(config.num_layers, torch.float32, 4) == 76 / 512 * fp32 <= 0.17 * fp32
