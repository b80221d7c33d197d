"""Reading and writing safetensors checkpoints (single file or sharded with an index).

Tensors are read lazily through memory maps, so a rank touches only the bytes it loads. Every error a
user can cause (pickled weights, a corrupt or truncated file, a missing tensor) names the file and,
where there is one, the tensor.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from unified.checkpoint.digests import digests
from unified.errors import UserError

INDEX = "model.safetensors.index.json"
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt")


class CheckpointError(UserError, ValueError):
    pass


class SafetensorsCheckpoint:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint folder {self.directory} does not exist")
        self.files = self._list_files()
        self._handles: dict[Path, object] = {}
        self.location: dict[str, Path] = {}
        for path in self.files:
            for name in self._open(path).keys():
                self.location[name] = path

    def _list_files(self) -> list[Path]:
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index} is not a valid safetensors index ({err!r}); re-download it") from err
            files = [self.directory / f for f in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shards that are not in the folder: {', '.join(missing)}")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if files:
            return files
        pickled = sorted(p.name for pattern in PICKLED for p in self.directory.glob(pattern))
        if pickled:
            raise CheckpointError(
                f"{self.directory} holds only pickled weights ({', '.join(pickled)}); pickle can run arbitrary "
                f"code, so we load safetensors only. Convert once with transformers: "
                f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")
        raise CheckpointError(f"{self.directory} contains no *.safetensors files")

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{path} is not a readable safetensors file ({err}); it may be truncated "
                                      f"or corrupt: re-download or re-export it") from err
        return self._handles[path]

    def release_mappings(self) -> None:
        """Unmaps the files: the pages that reads touched leave this process (they stay in the page cache, and
        a tensor already read is a copy); the next read maps its file again."""
        self._handles.clear()

    def has(self, name: str) -> bool:
        return name in self.location

    def file_of(self, name: str) -> Path:
        if name not in self.location:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory} "
                                  f"(files: {', '.join(p.name for p in self.files)}); the checkpoint is "
                                  f"incomplete or belongs to another architecture")
        return self.location[name]

    def get(self, name: str) -> torch.Tensor:
        path = self.file_of(name)
        try:
            return self._open(path).get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise CheckpointError(f"cannot read tensor {name!r} from {path} ({err}); the file may be "
                                  f"corrupt: re-download or re-export it") from err

    def get_slice(self, name: str):
        """A lazy view of tensor `name`: index it to read only those bytes."""
        return self._open(self.file_of(name)).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get_slice(name).get_shape())


def save_safetensors(tensors: dict[str, torch.Tensor], directory: str | Path,
                     max_shard_bytes: int = 5 * 1024 ** 3) -> list[Path]:
    """Writes HF-style shards (model-0000i-of-0000n.safetensors + index) or one model.safetensors.

    Each file is written under a temporary name and renamed, so an interrupted export never leaves a
    file that looks complete.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous()
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    paths = []
    for name, shard in zip(names, shards):
        tmp = directory / f".{name}.tmp"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, directory / name)
        paths.append(directory / name)
    if len(shards) > 1:
        weight_map = {t: n for n, shard in zip(names, shards) for t in shard}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths


# safetensors' names for torch dtypes
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_MAX_DIMS = 8  # header room per tensor assumes at most this many dimensions


class StreamingSafetensorsWriter:
    """Writes one safetensors file a tensor at a time, so memory never holds more than the tensor being written.

    The format puts a JSON header (names, dtypes, shapes, byte offsets) before the data. The header's room is
    reserved from the names to come (a bound for each entry), the data are written after it as they arrive,
    and the header is written last, padded with spaces (which the format allows) to the reserved size. The file
    is written under a temporary name and renamed by `close`, so an interrupted write leaves no complete-looking
    file. `add` returns the tensor's [begin, end) offsets in the file and the digests of its bytes
    (unified/checkpoint/digests.py).
    """

    def __init__(self, path: str | Path, names: list[str], metadata: dict[str, str] | None = None):
        self.path, self.tmp = Path(path), Path(path).with_name(f".{Path(path).name}.tmp")
        self.metadata = metadata or {"format": "pt"}
        entry = len('"":{"dtype":"F8_E4M3","shape":[],"data_offsets":[,]},') + 20 * (_MAX_DIMS + 2) + _MAX_DIMS
        room = len(json.dumps({"__metadata__": self.metadata})) + sum(len(json.dumps(n)) + entry for n in names) + 2
        self.header_room = room + (-room % 8)  # data start 8-byte aligned
        self.file = self.tmp.open("wb")
        self.file.seek(8 + self.header_room)
        self.header: dict[str, dict] = {}
        self.position = 0

    def add(self, name: str, tensor: torch.Tensor) -> tuple[tuple[int, int], dict[str, str]]:
        assert name not in self.header and tensor.dim() <= _MAX_DIMS, name
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self.file.write(data)
        begin, end = self.position, self.position + data.nbytes
        self.header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [begin, end]}
        self.position = end
        start = 8 + self.header_room
        return (start + begin, start + end), digests(data)

    def close(self) -> int:
        """Writes the header, renames the file into place; returns its size in bytes."""
        header = json.dumps({"__metadata__": self.metadata, **self.header}, separators=(",", ":")).encode()
        assert len(header) <= self.header_room, "safetensors header bound too small"
        self.file.seek(0)
        self.file.write(len(header.ljust(self.header_room)).to_bytes(8, "little") + header.ljust(self.header_room))
        self.file.close()
        os.replace(self.tmp, self.path)
        return 8 + self.header_room + self.position
