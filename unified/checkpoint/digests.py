"""Checksums of the tensors of a pre-sharded folder (unified/checkpoint/manifest.py).

The manifest records two digests of each stored tensor's bytes: `sha256`, the digest that people and tools
compare against (`sha256sum` of a byte range), and `xxh3_128`, the 128-bit XXH3 hash, which loading checks.
Loading checks for corruption (a bad copy, a truncated or overwritten shard, bit rot), which a 128-bit hash
catches as surely as sha256 does; sha256 guards against deliberate collisions as well, but hashes at about a
tenth of the speed, slower than a page-cache read, so checking it would make the load hash-bound. Folders
converted before `xxh3_128` was recorded are checked against their sha256.
"""
from __future__ import annotations

import hashlib

import xxhash

CHECKED = "xxh3_128"


def digests(data) -> dict[str, str]:
    """Both digests of `data` (a bytes-like object), as the manifest records them."""
    return {"sha256": hashlib.sha256(data).hexdigest(), CHECKED: xxhash.xxh3_128(data).hexdigest()}


def checked_digest(record: dict) -> str:
    """The digest that loading checks for a tensor's manifest record."""
    return CHECKED if CHECKED in record else "sha256"


def matches(record: dict, data) -> bool:
    """Whether `data` has the digest that `record` (a manifest tensor record) says it has."""
    if CHECKED in record:
        return xxhash.xxh3_128(data).hexdigest() == record[CHECKED]
    return hashlib.sha256(data).hexdigest() == record["sha256"]
