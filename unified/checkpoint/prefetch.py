"""Reading checkpoint tensors ahead of their use, so that reads overlap with copies into the model.

One background thread reads (storage to host memory: page faults on a memory map, a slice of a file) while
the caller copies the previous tensor into its parameter (host to device, or host to host). Reading releases
the GIL (file I/O, hashing, torch copies), so the two really run at once. At most `ahead` tensors wait, read
and not yet copied: memory holds a few tensors, never the model.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

Item = TypeVar("Item")
Read = TypeVar("Read")


def prefetched(items: Iterable[Item], read: Callable[[Item], Read], ahead: int = 2) -> Iterator[tuple[Item, Read]]:
    """(item, read(item)) in order, each read done in a background thread up to `ahead` items early. An error a
    read raises comes out here, at its item; leaving the loop early cancels the reads not yet started."""
    items = list(items)
    pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-read")
    pending: deque = deque()
    submitted = 0
    try:
        for item in items:
            while submitted < len(items) and len(pending) <= ahead:
                pending.append(pool.submit(read, items[submitted]))
                submitted += 1
            yield item, pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
