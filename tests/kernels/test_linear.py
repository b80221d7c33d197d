import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

from unified import kernels
from unified.kernels import cpu_ops
from unified.kernels.linear import takes_inference_path

linear_module = importlib.import_module("unified.kernels.linear")  # the package exports the function `linear`


@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48), (2, 17, 48), (300, 48), (0, 48)])
def test_inference_linear_matches_f_linear(shape):
    weight, bias = torch.randn(96, 48), torch.randn(96)
    x = torch.randn(*shape)
    with torch.inference_mode():
        assert takes_inference_path(x, weight) == torch.backends.mkldnn.is_available()
        for b in (bias, None):
            torch.testing.assert_close(kernels.linear(x, weight, b), F.linear(x, weight, b))


@pytest.mark.parametrize("layout", ["panels", "onednn"])
# 13 and 25 rows: tiles of unequal height; 600: more than one row block of the panel kernel (AVX2)
@pytest.mark.parametrize("rows", [0, 1, 5, 13, 25, 64, 300, 600])
# whole panels of 16 (an even count, an odd one) and a part panel; 2,048 inputs: more than one row block on AVX-512
@pytest.mark.parametrize("out_features,in_features", [(96, 48), (112, 48), (101, 45), (40, 2048)])
def test_packed_weight_matches_f_linear(layout, rows, out_features, in_features, monkeypatch):
    if layout == "onednn":
        monkeypatch.setattr(linear_module, "_panels_available", lambda: False)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    tolerance = {}
    if in_features > 1024:  # sums of 2,048 products round differently in each order (MKL's and the kernels')
        weight, tolerance = weight / in_features ** 0.5, {"rtol": 1e-5, "atol": 3e-5}  # scaled as a model's are
    packed = kernels.pack_weight(weight)
    if packed is None or packed.layout != layout:
        pytest.skip(f"no {layout} packing on this machine")
    for x in (torch.randn(rows, in_features), torch.randn(rows, 2, in_features)[:, 1]):  # contiguous, strided
        with torch.inference_mode():
            for b in (bias, None):
                torch.testing.assert_close(kernels.linear(x.unsqueeze(0), weight, b, packed),
                                           F.linear(x.unsqueeze(0), weight, b), **tolerance)


def test_avx2_and_avx512_machines_pack_in_panels():
    from unified.kernels import cpu_ops

    if not (cpu_ops.available() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")):
        pytest.skip("the panel kernel is built for AVX2 and AVX-512 machines")
    assert kernels.pack_weight(torch.randn(96, 48)).layout == "panels"


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("out_features,in_features", [(96, 48), (101, 45)])
def test_few_row_kernel_matches_f_linear(rows, out_features, in_features):
    """Batch-1 decode shapes take the weight-streaming C++ kernel: up to four rows of x one weight row at a
    time, more in whole groups of eight weight rows and a remainder; inputs that are and are not whole vectors."""
    from unified.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ CPU kernels on this machine")
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(rows, 1, in_features)
    with torch.no_grad():
        for b in (bias, None):
            expected = F.linear(x, weight, b)
            torch.testing.assert_close(torch.ops.unified_cpu.skinny_linear(x[:, 0], weight, b), expected[:, 0])
            torch.testing.assert_close(kernels.linear(x, weight, b), expected)


def test_a_packed_copy_is_ignored_once_the_weight_changes():
    weight, x = torch.randn(96, 48), torch.randn(64, 48)
    packed = kernels.pack_weight(weight)
    if packed is None:
        pytest.skip("oneDNN is not available in this torch build")
    with torch.no_grad():
        weight.add_(1.0)  # as a LoRA merge does
        torch.testing.assert_close(kernels.linear(x, weight, None, packed), F.linear(x, weight))
        weight.copy_(torch.randn(96, 48))  # as a weight update does
        torch.testing.assert_close(kernels.linear(x, weight, None, packed), F.linear(x, weight))
        torch.testing.assert_close(kernels.linear(x, weight, None, kernels.pack_weight(weight)), F.linear(x, weight))
    with torch.inference_mode():
        assert kernels.pack_weight(torch.randn(8, 4)) is None  # no version counter to check


def test_strided_operands():
    weight, x = torch.randn(96, 100)[:, :48], torch.randn(8, 100)[:, 52:]  # views into wider rows
    with torch.no_grad():
        torch.testing.assert_close(kernels.linear(x, weight), F.linear(x, weight))


def test_training_gets_gradients():
    weight = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(32, 4)
    assert not takes_inference_path(x, weight)
    kernels.linear(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, x.sum(0).expand(8, 4))


def test_the_training_path_ignores_packed_copies_and_kernels_with_autograd_off():
    weight, x = torch.randn(96, 48), torch.randn(5, 48)
    other = kernels.pack_weight(weight + 1.0)
    if other is None:
        pytest.skip("no packed copies on this machine")
    claims_current = dataclasses.replace(other, version=weight._version)  # another weight's copy, passed off as this one's
    with torch.no_grad():
        fast = kernels.linear(x, weight, None, claims_current)
        with kernels.training_path():
            plain = kernels.linear(x, weight, None, claims_current)
    assert torch.equal(plain, F.linear(x, weight))
    assert not torch.allclose(fast, plain)  # outside, the inference path trusts the copy


def test_a_row_or_two_read_the_plain_weight_rather_than_onednn_s_copy(monkeypatch):
    """On oneDNN machines one or two rows stream the plain weight (faster there); more rows, and a copy with a
    LoRA adapter folded in (which the plain weight lacks), use the copy. A copy of another weight passed off as
    this one's tells which was read."""
    from unified.kernels import cpu_ops

    monkeypatch.setattr(linear_module, "_panels_available", lambda: False)
    weight = torch.randn(96, 48)
    other = kernels.pack_weight(weight + 1.0)
    if other is None or other.layout != "onednn" or not cpu_ops.available():
        pytest.skip("no oneDNN copies or C++ kernels on this machine")
    copy = dataclasses.replace(other, version=weight._version)
    with torch.inference_mode():
        for rows in (1, 2, 3, 8):
            x = torch.randn(rows, 48)
            read = weight if rows <= linear_module.SKINNY_OVER_PACKED_MAX_ROWS else weight + 1.0
            torch.testing.assert_close(kernels.linear(x, weight, None, copy), F.linear(x, read))
        folded = dataclasses.replace(copy, adapter=(0,))
        torch.testing.assert_close(kernels.linear(x[:1], weight, None, folded), F.linear(x[:1], weight + 1.0))
        head = kernels.pack_head(weight, chunk=32)
        x = torch.randn(1, 48)
        torch.testing.assert_close(kernels.head_logits(x, head, weight), F.linear(x, weight))
        assert kernels.head_argmax(x, head, weight).item() == F.linear(x, weight).argmax().item()


def test_a_head_packed_in_vocabulary_chunks_gives_the_logits_and_their_first_maximum():
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(1000, 64, generator=g), torch.randn(5, 64, generator=g)
    weight[700] = weight[300]  # a tie across chunks: the first maximum wins, as argmax
    x[0] = weight[300] * 4
    head = kernels.pack_head(weight, chunk=256)
    assert head is not None and [(s, e) for s, e, _ in head.chunks] == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    with torch.inference_mode():
        logits = kernels.head_logits(x, head)
        torch.testing.assert_close(logits, F.linear(x, weight), rtol=1e-5, atol=1e-4)
        tokens = kernels.head_argmax(x, head)
    assert tokens.tolist() == logits.argmax(-1).tolist() and tokens[0] == 300
    assert linear_module.head_chunk_size() >= 1024 and linear_module.head_chunk_size() % 256 == 0


def _near_ties(rows: int, vocab: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A head [vocab, dim] and x [rows, dim] where each row's two best tokens are apart by far less than int8's
    rounding of them; their full-precision winners."""
    g = torch.Generator().manual_seed(seed)
    weight, x = torch.randn(vocab, dim, generator=g), torch.randn(rows, dim, generator=g)
    winners = []
    for row in range(rows):
        first, second = 2 * row + 1, 600 + 2 * row  # in different chunks of 256
        weight[first] = x[row] * (40 / x[row].norm() ** 2) + torch.randn(dim, generator=g) * 0.3
        weight[second] = weight[first] + 1e-4 * torch.randn(dim, generator=g)
        winners.append(first if weight[first] @ x[row] > weight[second] @ x[row] else second)
    return weight, x, winners


@pytest.mark.parametrize("k", [1, 2, 8])
def test_a_quantized_heads_best_logits_are_computed_again_in_full_precision(k):
    """`rescore` k: each row's k largest int8 logits become the full-precision ones, the others stay int8's, and
    the greedy choice taken chunk by chunk is the first maximum of those logits; with k >= 2 it is full
    precision's choice on near ties that int8 alone gets wrong."""
    weight, x, winners = _near_ties(rows=24, vocab=1000, dim=64, seed=11)
    head = kernels.pack_head(weight, chunk=256, quantization="int8")
    with torch.inference_mode():
        plain = kernels.head_logits(x, head, weight)
        rescored = kernels.head_logits(x, head, weight, rescore=k)
        tokens = kernels.head_argmax(x, head, weight, rescore=k)
    top = plain.topk(k, -1).indices
    torch.testing.assert_close(rescored.gather(-1, top), F.linear(x, weight).gather(-1, top), rtol=1e-5, atol=1e-5)
    kept = torch.ones_like(plain, dtype=torch.bool).scatter_(-1, top, False)
    assert torch.equal(rescored[kept], plain[kept])
    assert tokens.tolist() == rescored.argmax(-1).tolist()
    assert plain.argmax(-1).tolist() != winners  # int8 alone swaps some of the near ties
    if k >= 2:
        assert tokens.tolist() == winners
    assert kernels.head_argmax(x, head, weight).tolist() == plain.argmax(-1).tolist()  # rescore 0: int8's


def test_a_packed_head_serves_only_the_weight_it_was_packed_from():
    """A step in place or another shape retires the copy; a ZeRO-3 partition (empty storage, whole shape in
    `ds_shape`, its version unchanged) keeps it."""
    weight, x = torch.nn.Parameter(torch.randn(600, 32)), torch.randn(3, 32)
    head = kernels.pack_head(weight.detach(), chunk=256)
    with torch.no_grad():
        assert head is not None and head.serves(x, weight)
        weight.add_(1.0)
        assert not head.serves(x, weight)
    head = kernels.pack_head(weight.detach(), chunk=256)
    assert not head.serves(x, weight)  # autograd on: the training path
    with torch.inference_mode():
        assert head.serves(x, weight) and not head.serves(x.double(), weight)
        assert not head.serves(x, torch.nn.Parameter(torch.randn(500, 32)))
        assert not head.serves(x, torch.randn(600, 32))  # an inference tensor: no version to tell by
        weight.data, weight.ds_shape = torch.empty(0), torch.Size([600, 32])
        assert head.serves(x, weight)


def as_the_kernel_reads(x: torch.Tensor, packed, bias: torch.Tensor) -> torch.Tensor:
    """The reference for what `quantized_linear` computes: with x rounded to int16 where the C++ stream takes it."""
    rows = x.shape[0]
    if rows <= linear_module.QUANTIZED_KERNEL_MAX_ROWS and cpu_ops.available():
        x = linear_module.int16_rounded_input(x, linear_module.int16_input_block(x.shape[1], packed.scale.shape[1]))
    return linear_module.quantized_linear_reference(x, packed, bias)


@pytest.mark.parametrize("rows", [1, 3, 6, 16, 40])
@pytest.mark.parametrize("out_features", [13, 37])
@pytest.mark.parametrize("in_features,group", [(256, 128), (100, None), (256, None), (576, None)])
def test_int8_weight_only_linear_matches_its_reference(rows, in_features, group, out_features):
    """The C++ stream (up to 16 rows in blocks of 4, x read as int16) equals x @ (q * scale).T with x rounded as
    `int16_rounded_input` says, the chunked path beyond it with x as it is: one scale per output feature, or per
    128 inputs of it (100 inputs: three int16 blocks of 32 and four float ones); 37 outputs take one row of x's
    two runs of 16 weight rows reduced together and three alone."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    packed = linear_module.quantize_int8(weight, group=group)
    assert packed.tensor.dtype == torch.int8 and packed.scale.shape == (out_features, 2 if group else 1)
    error = (linear_module.dequantize(packed) - weight).abs()
    assert (error <= packed.scale.repeat_interleave(in_features // packed.scale.shape[1], 1) / 2 + 1e-6).all()
    with torch.inference_mode():
        torch.testing.assert_close(kernels.linear(x, weight, bias, packed), as_the_kernel_reads(x, packed, bias),
                                   rtol=1e-5, atol=1e-5 * max(1, in_features / 256))  # float32 sums' rounding
    assert torch.equal(kernels.linear(x, weight, bias, packed), F.linear(x, weight, bias))  # training: the weight


@pytest.mark.parametrize("rows", [1, 3, 6, 16, 40])
@pytest.mark.parametrize("out_features", [13, 37])
@pytest.mark.parametrize("in_features,group", [(256, None), (96, None), (100, None), (64, 16), (576, None)])
def test_int4_weight_only_linear_matches_its_reference(rows, in_features, group, out_features):
    """As for int8: the C++ stream (x as int16 over groups of 32 inputs or more and over one scale per output
    feature; groups of 16 keep x in float32) and the chunked path equal x @ dequantized.T."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    packed = linear_module.quantize_int4(weight, group=group)
    groups = in_features // (group or linear_module.int4_group(in_features))
    assert packed.tensor.dtype == torch.uint8 and packed.tensor.shape == (out_features, in_features // 2)
    assert packed.scale.shape == (out_features, groups)
    error = (linear_module.dequantize(packed) - weight).abs()
    assert (error <= packed.scale.repeat_interleave(in_features // groups, 1) + 1e-6).all()  # -8 may clamp +8
    plain = weight.view(out_features, groups, -1)  # no worse than the plain |w|max -> 7 scale, group by group
    plain_scale = plain.abs().amax(-1, keepdim=True) / 7
    plain_error = (torch.round(plain / plain_scale) * plain_scale - plain).square().sum(-1)
    assert (error.view(out_features, groups, -1).square().sum(-1) <= plain_error + 1e-6).all()
    with torch.inference_mode():
        torch.testing.assert_close(kernels.linear(x, weight, bias, packed), as_the_kernel_reads(x, packed, bias),
                                   rtol=1e-5, atol=1e-5 * max(1, in_features / 256))  # float32 sums' rounding
    assert torch.equal(kernels.linear(x, weight, bias, packed), F.linear(x, weight, bias))  # training: the weight


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels are not built")
@pytest.mark.parametrize("layout", ["int8", "int4"])
@pytest.mark.parametrize("width", [1536, 576])
def test_the_int16_input_of_the_quantized_kernels_is_close_to_float_and_the_same_for_any_batch(layout, width):
    """x read as int16, one scale per block of inputs, moves the output by far less than the weights' own
    rounding did; a block of zeros (a padded row) stays exact; a NaN is not rounded away; and a row's output does
    not depend on which other rows share the call, which speculative decoding's verification forward relies on."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, width, generator=g)
    x = torch.randn(7, width, generator=g) * torch.rand(1, width, generator=g) * 4
    x[:, 20] = 300.0  # an outlier feature: only its own block's step grows
    x[3] = 0.0
    packed = (linear_module.quantize_int8 if layout == "int8" else linear_module.quantize_int4)(weight)
    plain = F.linear(x, linear_module.dequantize(packed))
    with torch.inference_mode():
        got = linear_module.quantized_linear(x, packed)
        alone = torch.cat([linear_module.quantized_linear(x[i:i + 1], packed) for i in range(7)])
    assert torch.equal(got, alone)
    assert torch.equal(got[3], torch.zeros(40))
    broken_x = x.clone()
    broken_x[5, 500] = float("nan")  # a broken activation shows in its row, as in float32, and only there
    with torch.inference_mode():
        broken = linear_module.quantized_linear(broken_x, packed)
    assert broken[5].isnan().all() and torch.equal(broken[:5], got[:5]) and torch.equal(broken[6], got[6])
    weight_error = (F.linear(x, weight) - plain).norm()
    assert (got - plain).norm() < weight_error / 20  # 1/37 for int8 here, ~1/150 without the outlier
    assert linear_module.int16_input_block(1536, 1) == 256 and linear_module.int16_input_block(576, 1) == 192
    assert linear_module.int16_input_block(100, 1) == 32 and linear_module.int16_input_block(20, 1) == 0
    assert linear_module.int16_input_block(1536, 12) == 128 and linear_module.int16_input_block(1536, 96) == 0


@pytest.mark.parametrize("divisor", [7.0, 7.5])
def test_int4_copies_of_a_symmetric_int4_checkpoint_are_its_own_values(divisor):
    """Weights dequantized from a symmetric int4 checkpoint, whether its scales were |w|max / 7 (ours) or
    compressed-tensors' |w|max / 7.5 with clamping, quantize back to the stored values and scales exactly, and
    the packed bytes are compressed-tensors' int32 packing read as bytes."""
    from unified.checkpoint.quantized import _unpack_int32, pack_int32

    g = torch.Generator().manual_seed(3)
    original = torch.randn(8, 256, generator=g) * 0.05
    grouped = original.view(8, 2, 128)
    scale = (grouped.abs().amax(-1) / divisor).to(torch.bfloat16).float()  # checkpoints store bf16 scales
    q = torch.round(grouped / scale[..., None]).clamp(-8, 7).view(8, 256)
    weight = (q.view(8, 2, 128) * scale[..., None]).view(8, 256)
    packed = linear_module.quantize_int4(weight, group=128)
    assert torch.equal(packed.scale, scale)
    assert torch.equal(linear_module.dequantize(packed), weight)
    assert torch.equal(_unpack_int32(packed.tensor.view(torch.int32), 4, (8, 256), "w"), q.to(torch.int8))
    assert torch.equal(packed.tensor.view(torch.int32), pack_int32(q.to(torch.int8), 4))


@pytest.mark.parametrize("layout", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_a_smoothed_copy_computes_the_weight_it_encodes(layout, rows):
    """An activation-aware copy quantizes weight * s and multiplies x by 1 / s (its input_scale) before it: the
    C++ stream (x / s read as int16) and the chunked path compute x @ the weight it encodes. (Whether that is
    closer to the weight than the plain copy depends on s: tests/model/test_calibration.py.)"""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(24, 256, generator=g), torch.randn(24, generator=g)
    x = torch.randn(rows, 256, generator=g)
    smoothing = torch.rand(256, generator=g) * 4 + 0.25
    packed = kernels.quantize(weight, layout, smoothing=smoothing)
    torch.testing.assert_close(packed.input_scale, smoothing.reciprocal())
    encoded = linear_module.dequantize(packed)
    torch.testing.assert_close(linear_module.dequantize(packed, smoothed=True) * packed.input_scale, encoded)
    with torch.inference_mode():
        got = kernels.linear(x, weight, bias, packed)
    read = x * packed.input_scale
    if rows <= linear_module.QUANTIZED_KERNEL_MAX_ROWS and cpu_ops.available():
        read = linear_module.int16_rounded_input(read, packed.input_block)
    torch.testing.assert_close(got, F.linear(read, linear_module.dequantize(packed, smoothed=True), bias),
                               rtol=1e-5, atol=1e-4)
