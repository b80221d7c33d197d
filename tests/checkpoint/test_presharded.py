"""Pre-sharded checkpoints in one process: what each rank's file holds, the conversion back to HF bit for bit,
loading, and the errors a user meets (wrong layout, corrupt, truncated or missing shard, impossible layout).
Loading on two ranks is tests/parallel/test_presharded_two_ranks.py."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
import xxhash
from safetensors import safe_open

from tests.conftest import run_cli
from unified.checkpoint import load_model
from unified.checkpoint.manifest import MANIFEST, UNMAPPED, LayoutMismatch, shard_file
from unified.checkpoint.presharded import convert_to_hf, convert_to_presharded
from unified.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint, save_safetensors
from unified.runtime.layout import Layout, LayoutError

LAYOUTS = {"tp2": Layout(tensor=2), "ep2": Layout(expert=2), "pp2": Layout(pipeline=2)}
QUIET = dict(log=lambda *_: None)


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    ckpt = SafetensorsCheckpoint(folder)
    return {name: ckpt.get(name) for name in ckpt.location}


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory):
    """The tiny DeepSeek-V3 (MLA, routed and shared experts) pre-sharded for TP=2 (through the CLI), EP=2, PP=2."""
    hf, root = tiny_checkpoint("deepseek_v3"), tmp_path_factory.mktemp("presharded")
    result = run_cli("recipe=convert", f"model={hf}", f"output={root / 'tp2'}", "parallel.tensor=2")
    assert result.returncode == 0 and "pre-sharded" in result.stdout, result.stderr[-3000:]
    for name in ("ep2", "pp2"):
        convert_to_presharded(hf, root / name, LAYOUTS[name], **QUIET)
    return hf, root


def stored(folder, file) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / file), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_each_rank_file_holds_exactly_its_slices(converted):
    hf, root = converted
    source = hf_tensors(hf)
    for name, layout in LAYOUTS.items():
        manifest = json.loads((root / name / MANIFEST).read_text())
        assert manifest["layout"] == {"tensor": layout.tensor, "pipeline": layout.pipeline, "expert": layout.expert}
        assert len(manifest["shards"]) == 2
        for shard in manifest["shards"]:
            path = root / name / shard["file"]
            header = struct.unpack("<Q", path.read_bytes()[:8])[0]
            data = sum(t.numel() * t.element_size() for t in stored(root / name, shard["file"]).values())
            assert path.stat().st_size == shard["bytes"] == 8 + header + data  # nothing but its tensors
            for tensor, record in shard["tensors"].items():
                begin, end = record["offsets"]
                assert end - begin == torch.Size(record["shape"]).numel() * 4  # float32 throughout
    attn, mlp, moe = "model.layers.0.self_attn.", "model.layers.0.mlp.", "model.layers.1.mlp."
    for rank in (0, 1):
        tp = stored(root / "tp2", shard_file(0, rank, 0))
        assert torch.equal(tp["layers.0.attn.q_proj.weight"], source[attn + "q_b_proj.weight"].chunk(2, 0)[rank])
        assert torch.equal(tp["layers.0.attn.o_proj.weight"], source[attn + "o_proj.weight"].chunk(2, 1)[rank])
        assert torch.equal(tp["layers.0.attn.kv_a_proj.weight"], source[attn + "kv_a_proj_with_mqa.weight"])
        assert torch.equal(tp["layers.0.mlp.gate_up_proj.weight"],  # fused [gate_r | up_r]
                           torch.cat([source[mlp + "gate_proj.weight"].chunk(2, 0)[rank],
                                      source[mlp + "up_proj.weight"].chunk(2, 0)[rank]]))
        assert torch.equal(tp["embed.weight"], source["model.embed_tokens.weight"].chunk(2, 0)[rank])

        ep = stored(root / "ep2", shard_file(0, 0, rank))
        experts = range(4 * rank, 4 * rank + 4)  # 8 experts, 4 a rank
        assert torch.equal(ep["layers.1.mlp.experts.gate_up"], torch.stack(
            [torch.cat([source[f"{moe}experts.{e}.gate_proj.weight"], source[f"{moe}experts.{e}.up_proj.weight"]])
             for e in experts]))
        assert torch.equal(ep["layers.1.mlp.shared.down_proj.weight"], source[moe + "shared_experts.down_proj.weight"])

        pp = stored(root / "pp2", shard_file(rank, 0, 0))
        layers = {int(n.split(".")[1]) for n in pp if n.startswith("layers.")}
        assert layers == ({0} if rank == 0 else {1, 2})
        assert ("embed.weight" in pp, "lm_head.weight" in pp, "norm.weight" in pp) == (rank == 0, rank == 1, rank == 1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_converting_back_gives_the_hf_tensors_bit_for_bit(converted, tmp_path, name):
    hf, root = converted
    convert_to_hf(root / name, tmp_path / "hf", **QUIET)
    before, after = hf_tensors(hf), hf_tensors(tmp_path / "hf")
    assert list(before) == list(after)
    assert all(before[n].dtype == after[n].dtype and torch.equal(before[n], after[n]) for n in before)
    assert (tmp_path / "hf" / "config.json").read_text() == (hf / "config.json").read_text()


def test_sharded_bf16_source_with_unused_tensors_round_trips(tiny_checkpoint, tmp_path):
    """An index over several files, bf16, and a tensor the model does not use (kept in unmapped.safetensors)."""
    source = tmp_path / "hf"
    tensors = {n: t.to(torch.bfloat16) for n, t in hf_tensors(tiny_checkpoint("deepseek_v3")).items()}
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(4, 8).to(torch.bfloat16)  # e.g. an MTP layer
    save_safetensors(tensors, source, max_shard_bytes=200_000)
    (source / "config.json").write_text((tiny_checkpoint("deepseek_v3") / "config.json").read_text())
    convert_to_presharded(source, tmp_path / "tp2", Layout(tensor=2), **QUIET)
    assert (tmp_path / "tp2" / UNMAPPED).is_file()
    convert_to_hf(tmp_path / "tp2", tmp_path / "back", **QUIET)
    back = hf_tensors(tmp_path / "back")
    assert sorted(p.name for p in (tmp_path / "back").glob("*.safetensors")) == sorted(
        p.name for p in source.glob("*.safetensors"))
    assert back.keys() == tensors.keys()
    assert all(back[n].dtype == torch.bfloat16 and torch.equal(back[n], tensors[n]) for n in tensors)


def test_single_rank_folder_loads_as_the_hf_checkpoint(runtime, tiny_checkpoint, tmp_path):
    hf = tiny_checkpoint("deepseek_v3")
    convert_to_presharded(hf, tmp_path / "one", Layout(), **QUIET)
    progress = []
    ours = load_model(tmp_path / "one", progress=lambda done, total: progress.append((done, total))).model
    reference = load_model(hf).model
    assert progress[-1][0] == progress[-1][1] == len(progress)
    ids, positions = torch.tensor([[1, 5, 9, 30]]), torch.arange(4)
    with torch.inference_mode():
        assert torch.equal(ours.logits(ours(ids, positions)), reference.logits(reference(ids, positions)))


@pytest.mark.parametrize("method,dtype,step", [("int8", torch.int8, 1 / 127), ("fp8", torch.float8_e4m3fn, 1 / 16)])
def test_quantized_conversion_loads_dequantized(runtime, tiny_checkpoint, tmp_path, method, dtype, step):
    hf = tiny_checkpoint("deepseek_v3")
    convert_to_presharded(hf, tmp_path / method, Layout(), quantization=method, **QUIET)
    files = stored(tmp_path / method, shard_file(0, 0, 0))
    quantized = {n: t.dtype for n, t in files.items() if n.startswith("layers.0.attn.q_proj.weight")}
    assert dtype in quantized.values() and len(quantized) > 1, quantized  # the weight and its scales
    assert files["embed.weight"].dtype == torch.float32  # embeddings stay as they are
    assert (files["layers.1.mlp.experts.gate_up"].dtype == torch.float8_e4m3fn) == (method == "fp8")
    ours = dict(load_model(tmp_path / method).model.named_parameters())
    reference = dict(load_model(hf).model.named_parameters())
    for name in ("layers.0.attn.q_proj.weight", "layers.1.mlp.shared.gate_up_proj.weight"):
        error = (ours[name] - reference[name]).abs().max()
        assert 0 < error <= reference[name].abs().max() * step, name


def test_int4_without_a_group_size_that_fits_is_refused_before_anything_is_written(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match=r"no int4 group size .* divides every input size \(\[16,"):
        convert_to_presharded(tiny_checkpoint("deepseek_v3"), tmp_path / "int4", Layout(), quantization="int4", **QUIET)
    assert not (tmp_path / "int4").exists()


def test_a_folder_for_another_layout_is_refused_with_the_layout_to_use(runtime, converted):
    with pytest.raises(LayoutMismatch, match=r"parallel.tensor=2 parallel.pipeline=1 parallel.expert=1"):
        load_model(converted[1] / "tp2")


@pytest.fixture
def single(runtime, tiny_checkpoint, tmp_path):
    folder = tmp_path / "one"
    convert_to_presharded(tiny_checkpoint("deepseek_v3"), folder, Layout(), **QUIET)
    return folder, json.loads((folder / MANIFEST).read_text())["shards"][0]


@pytest.mark.parametrize("recorded", ["xxh3_128", "sha256"])  # sha256 only: converted before xxh3_128 was recorded
def test_a_corrupt_shard_is_named_unless_checksums_are_off(single, recorded):
    folder, shard = single
    record = shard["tensors"]["layers.1.attn.o_proj.weight"]
    begin, end = record["offsets"]
    data = (folder / shard["file"]).read_bytes()[begin:end]
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    assert record["xxh3_128"] == xxhash.xxh3_128(data).hexdigest()
    if recorded == "sha256":
        manifest = json.loads((folder / MANIFEST).read_text())
        for tensor in manifest["shards"][0]["tensors"].values():
            del tensor["xxh3_128"]
        (folder / MANIFEST).write_text(json.dumps(manifest))
    with open(folder / shard["file"], "r+b") as f:
        f.seek(begin + 5)
        f.write(b"\x7f")
    with pytest.raises(CheckpointError, match=rf"'layers.1.attn.o_proj.weight' in .*{shard['file']} does not match "
                                              rf"its {recorded}"):
        load_model(folder)
    load_model(folder, verify_checksums=False)


def test_a_truncated_or_missing_shard_is_named(single):
    folder, shard = single
    path = folder / shard["file"]
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard['file']} has .* bytes but the manifest says"):
        load_model(folder)
    path.unlink()
    with pytest.raises(CheckpointError, match=rf"shard {shard['file']} of the pre-sharded checkpoint .* is missing"):
        load_model(folder)


@pytest.mark.parametrize("damage", ["dtype", "shape", "layout", "digests", "param"])
def test_a_manifest_edited_by_hand_is_refused_naming_what_is_wrong(single, damage):
    folder, _ = single
    manifest = json.loads((folder / MANIFEST).read_text())
    shard = manifest["shards"][0]
    name = "layers.1.attn.o_proj.weight"
    expected = {"dtype": rf"'{name}' .* spans \d+ bytes, but BF16", "shape": rf"'{name}' .* is stored as F32 \[",
                "layout": "'layout' must give tensor, pipeline and expert", "digests": rf"'{name}' .* has no checksum",
                "param": rf"holds no {name}"}[damage]
    if damage == "dtype":
        shard["tensors"][name]["dtype"] = "BF16"
    elif damage == "shape":
        shard["tensors"][name]["shape"].reverse()
    elif damage == "layout":
        del manifest["layout"]
    elif damage == "digests":
        for key in ("sha256", "xxh3_128"):
            del shard["tensors"][name][key]
    else:
        del shard["params"][name]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=expected):
        load_model(folder)


def test_an_impossible_layout_is_refused_before_anything_is_written(tiny_checkpoint, tmp_path):
    with pytest.raises(LayoutError, match="tensor parallel 3 does not divide the 4 attention heads"):
        convert_to_presharded(tiny_checkpoint("deepseek_v3"), tmp_path / "out", Layout(tensor=3), **QUIET)
    assert not (tmp_path / "out").exists()
