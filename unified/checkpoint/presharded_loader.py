"""Loading a pre-sharded folder (unified/checkpoint/manifest.py): each rank maps its own file and nothing else.

The rank's file holds exactly its parameters, already sliced and fused, in the order they are filled, so
loading is one read per parameter (no slicing, no concatenation). Into host parameters of the stored dtype it
reads the file straight into them with positional reads, as a plain sequential read would, while a background
thread checks the previous tensor's checksum (unified/checkpoint/digests.py). Otherwise (device parameters,
another dtype) it copies from a memory map: a background thread reads ahead (unified/checkpoint/prefetch.py),
checking each tensor's checksum as it reads it or, with checksums off, paging it in, while the caller copies
the previous one into its parameter; once copied, a tensor's pages are unmapped so that the process does not
keep the file resident. Quantized folders (converted with engine.quantization=) are read through
quantized.dequantizing, as quantized HF checkpoints are.
"""
from __future__ import annotations

import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from unified.checkpoint.digests import checked_digest, matches
from unified.checkpoint.manifest import check_manifest_layout, read_manifest, shard_entry
from unified.checkpoint.prefetch import prefetched
from unified.checkpoint.quantized import dequantizing
from unified.checkpoint.safetensors_io import DTYPES, CheckpointError
from unified.runtime.layout import Layout

PAGE = mmap.PAGESIZE
HASH_THREADS = 8


class _StoredSlice:
    """What `SafetensorsCheckpoint.get_slice` returns, for one stored tensor of a rank file."""

    def __init__(self, rank_file: "RankFile", name: str):
        self.rank_file, self.name = rank_file, name

    def get_dtype(self) -> str:
        return self.rank_file.record(self.name)["dtype"]

    def get_shape(self) -> list[int]:
        return list(self.rank_file.record(self.name)["shape"])

    def __getitem__(self, index):
        return self.rank_file.get(self.name)[index]


class RankFile:
    """One rank's file, memory-mapped. `get(name)` is a zero-copy view of a stored tensor, checked against the
    manifest's checksum the first time it is read (with `verify`); `param(name)` is one of our parameters as this
    rank holds it (dequantized if stored quantized). It reads like a SafetensorsCheckpoint (has, get, get_slice,
    shape, file_of), which is what quantized.dequantizing wraps."""

    def __init__(self, directory: Path, entry: dict, verify: bool, quantization: dict | None = None):
        self.directory, self.path = Path(directory), Path(directory) / entry["file"]
        self.tensors, self.params, self.verify = entry["tensors"], entry["params"], verify
        self.quantization = quantization  # the manifest's quantization_config of the stored tensors, if any
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"shard {self.path.name} of the pre-sharded checkpoint {self.directory} is missing; "
                                  f"copy it again from where the folder was converted, or convert again "
                                  f"(recipe=convert)") from None
        if size != entry["bytes"]:
            raise CheckpointError(f"shard {self.path} has {size} bytes but the manifest says {entry['bytes']}: it is "
                                  f"truncated or was overwritten; copy it again, or convert again (recipe=convert)")
        _check_records(self.path, entry, size, verify)
        with self.path.open("rb") as f:  # private, copy-on-write: torch wants writable buffers, nothing writes
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self._bytes = memoryview(self._map) if size else memoryview(b"")
        self._checked: set[str] = set()  # read once already (and checked, with `verify`)
        self._reader = dequantizing(self, SimpleNamespace(quantization_config=quantization))

    def record(self, name: str) -> dict:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name!r} is not in {self.path} (manifest.json); the folder is incomplete: "
                                  f"convert again")
        return self.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def file_of(self, name: str) -> Path:
        self.record(name)
        return self.path

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.record(name)["shape"])

    def get_slice(self, name: str) -> _StoredSlice:
        return _StoredSlice(self, name)

    def get(self, name: str) -> torch.Tensor:
        record = self.record(name)
        begin, end = record["offsets"]
        if name not in self._checked and end > begin:
            # one asynchronous read of the whole range; page faults alone would read it 128 KiB at a time
            self._map.madvise(mmap.MADV_WILLNEED, begin // PAGE * PAGE, end - begin // PAGE * PAGE)
        if self.verify and name not in self._checked:
            if not matches(record, self._bytes[begin:end]):
                raise _corrupt(self.path, name, record)
            self._checked.add(name)
        elif not self.verify and name not in self._checked:
            self._bytes[begin:end:PAGE].tobytes()  # one byte a page: the pages come in now, in this thread
            self._checked.add(name)
        shape, dtype = record["shape"], DTYPES[record["dtype"]]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=math.prod(shape), offset=begin).view(shape)

    def param(self, name: str) -> torch.Tensor:
        return self._reader.get(name).reshape(self.params[name]["shape"])

    def direct(self, name: str, target: torch.Tensor) -> bool:
        """Whether `read_into` can fill `target`: one stored tensor of its dtype and size, a contiguous host tensor."""
        stored = self.params[name]["stored"]
        if len(stored) != 1 or target.device.type != "cpu" or not target.is_contiguous():
            return False
        record = self.record(stored[0])
        return DTYPES[record["dtype"]] == target.dtype and math.prod(record["shape"]) == target.numel()

    def read_into(self, name: str, target: torch.Tensor) -> memoryview:
        """Reads `name` from the file straight into `target` (see `direct`) with positional reads, no memory map
        and no copy in between: a host load is then the storage's sequential read into the parameters. Returns
        the target's bytes (for `matches`)."""
        begin, end = self.stored_record(name)["offsets"]
        view = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())
        with self.path.open("rb", buffering=0) as f:
            done = 0
            while done < end - begin:
                got = os.preadv(f.fileno(), [view[done:]], begin + done)
                if got == 0:
                    raise CheckpointError(f"{self.path} ended inside tensor {name!r}: it is truncated; copy it again, "
                                          f"or convert again (recipe=convert)")
                done += got
        return view

    def stored_record(self, name: str) -> dict:
        """The record of the one tensor that stores parameter `name` (see `direct`)."""
        return self.record(self.params[name]["stored"][0])

    def matches(self, name: str, data: memoryview) -> bool:
        return matches(self.stored_record(name), data)

    def release(self, name: str) -> None:
        """Unmaps the whole pages of `name`'s stored tensors (they stay in the page cache, not in this process)."""
        for stored in self.params[name]["stored"]:
            begin, end = self.tensors[stored]["offsets"]
            begin, end = -(-begin // PAGE) * PAGE, end // PAGE * PAGE
            if end > begin:
                self._map.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def _check_records(path: Path, entry: dict, size: int, verify: bool) -> None:
    """Every tensor record of `entry` describes bytes inside the file that fit its dtype and shape, and every
    parameter names stored tensors (one of its own name and shape where it is stored as is): a manifest edited by
    hand must not load reinterpreted bytes."""
    def broken(name: str, what: str) -> CheckpointError:
        return CheckpointError(f"{path.parent / 'manifest.json'}: tensor {name!r} of {path.name} {what}; the manifest "
                               f"was edited or damaged: copy it again, or convert again (recipe=convert)")

    for name, record in entry["tensors"].items():
        dtype, shape, offsets = record.get("dtype"), record.get("shape"), record.get("offsets")
        if dtype not in DTYPES:
            raise broken(name, f"has dtype {dtype!r}, not one of {', '.join(DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise broken(name, f"has shape {shape!r}, not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(n, int) for n in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= size):
            raise broken(name, f"has offsets {offsets!r}, not a byte range inside the file's {size} bytes")
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != expected:
            raise broken(name, f"spans {offsets[1] - offsets[0]} bytes, but {dtype} of shape {shape} takes {expected}")
        if verify and "sha256" not in record and "xxh3_128" not in record:
            raise broken(name, "has no checksum (sha256 or xxh3_128); load with checksums off only if you trust it")
    for name, param in entry["params"].items():
        stored = param.get("stored")
        if not isinstance(stored, list) or not stored or any(s not in entry["tensors"] for s in stored):
            raise broken(name, f"is stored as {stored!r}, which the file's tensors do not all hold")
        record = entry["tensors"][name] if stored == [name] else None
        if record is not None and (record["shape"], record["dtype"]) != (param.get("shape"), param.get("dtype")):
            raise broken(name, f"is stored as {record['dtype']} {record['shape']} but recorded as the parameter "
                               f"{param.get('dtype')} {param.get('shape')}")


def open_rank_file(directory: Path, layout: Layout, verify: bool) -> RankFile:
    """This rank's file, after checking that the folder was converted for `layout`."""
    from megatron.core import parallel_state as ps

    manifest = read_manifest(directory)
    check_manifest_layout(directory, manifest, layout)
    entry = shard_entry(directory, manifest, ps.get_pipeline_model_parallel_rank(),
                        ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank())
    return RankFile(directory, entry, verify, manifest.get("quantization"))


def fill_from_rank_file(rank_file: RankFile, targets: dict[str, torch.Tensor],
                        progress: Callable[[int, int], None] | None) -> set[str]:
    """Copies every parameter of the rank's file into `targets` (our parameters and buffers by name)."""
    names = list(rank_file.params)
    foreign = [n for n in names if n not in targets]
    if foreign:
        raise CheckpointError(f"{rank_file.path} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, "
                              f"which the model built from {rank_file.directory / 'config.json'} does not have; "
                              f"config.json and the shards disagree: convert again")
    direct = {n for n in names if rank_file.direct(n, targets[n])}
    _read_directly(rank_file, [n for n in names if n in direct], targets,
                   lambda done: progress(done, len(names)) if progress else None)
    rest = [n for n in names if n not in direct]
    for done, (name, tensor) in enumerate(prefetched(rest, rank_file.param), start=len(direct) + 1):
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"{name} is {tuple(tensor.shape)} in {rank_file.path} but the model built from "
                                  f"{rank_file.directory / 'config.json'} expects {tuple(target.shape)}; config.json "
                                  f"and the shards disagree: convert again")
        target.copy_(tensor)
        del tensor
        rank_file.release(name)
        if progress:
            progress(done, len(names))
    return set(names)


def _corrupt(path: Path, name: str, record: dict) -> CheckpointError:
    return CheckpointError(f"tensor {name!r} in {path} does not match its {checked_digest(record)} in manifest.json: "
                           f"the file is corrupt; copy it again, or convert again (recipe=convert)")


def _read_directly(rank_file: RankFile, names: list[str], targets: dict[str, torch.Tensor],
                   progress: Callable[[int], None]) -> None:
    """`read_into` for each of `names`, in file order; with checksums on, background threads hash the tensors
    read while the next ones are read (several at once where there are cores for it: sha256, which folders
    converted before xxh3_128 was recorded are checked with, is slower than a fast disk reads), and a mismatch
    is named once the reads are done."""
    workers = max(1, min(HASH_THREADS, (os.cpu_count() or 2) - 1))  # the reading thread keeps a core
    hasher = ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-checksum") if rank_file.verify else None
    checks = []
    try:
        for done, name in enumerate(names, start=1):
            data = rank_file.read_into(name, targets[name])
            if hasher is not None:
                checks.append((name, hasher.submit(rank_file.matches, name, data)))
            progress(done)
        for name, ok in checks:
            if not ok.result():
                raise _corrupt(rank_file.path, name, rank_file.stored_record(name))
    finally:
        if hasher is not None:
            hasher.shutdown(wait=True, cancel_futures=True)
