"""How a worker's stream crosses to the main process: in chunks, one crossing each, the decoded pixels of a chunk's
records in one block of shared memory, handed over by reference.

DataLoader pickles whatever a worker yields into a pipe, which the main process reads and unpickles: item by item, a
1080p image's 6 MB copied four times, in the one process that feeds the device. Here a worker groups its stream into
chunks (closed at a batch's patch budget, at `records`, or at a unit's end, so that a unit's last records never wait
for the next unit's), copies each chunk's decoded pixels into one shared block (`torch.multiprocessing` hands its
file descriptor over), and yields the chunk: what crosses the pipe is the records' small fields and one descriptor.
The main process makes each image's pixels a view of the block, no copy, and passes the items on in their order; the
block is freed once the last record holding a view of it is done with.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import IterableDataset

from batchvlm.records import DecodedImage, PreparedRecord, UnitEnd


@dataclass
class Chunk:
    """Items of one worker's stream in their order; `places` says where each decoded image's pixels lie in `block`:
    (item, image, first byte, shape)."""

    items: list
    block: torch.Tensor | None = None
    places: list[tuple[int, int, int, tuple[int, ...]]] = field(default_factory=list)


class ChunkedStream(IterableDataset):
    """A worker's stream (an IterableDataset of items) as chunks."""

    def __init__(self, stream: IterableDataset, patch_budget: int, records: int):
        self.stream, self.patch_budget, self.records = stream, patch_budget, records

    def __iter__(self) -> Iterator[Chunk]:
        return chunked(iter(self.stream), self.patch_budget, self.records)


def chunked(items: Iterable, patch_budget: int, records: int) -> Iterator[Chunk]:
    pending, patches, count = [], 0, 0
    for item in items:
        pending.append(item)
        if isinstance(item, PreparedRecord):
            patches += item.num_patches
            count += 1
        if isinstance(item, UnitEnd) or patches >= patch_budget or count >= records:
            yield shared(pending)
            pending, patches, count = [], 0, 0
    if pending:
        yield shared(pending)


def host_images(items: list) -> Iterator[tuple[int, int, DecodedImage]]:
    """(item, image, image) of each decoded image whose pixels are a host array."""
    for position, item in enumerate(items):
        if isinstance(item, PreparedRecord):
            for index, image in enumerate(item.images):
                if isinstance(image, DecodedImage) and isinstance(image.pixels, np.ndarray):
                    yield position, index, image


def shared(items: list) -> Chunk:
    """The items as a chunk, their decoded pixels moved into one new shared block (and off the items)."""
    images = list(host_images(items))
    if not images:
        return Chunk(items)
    total = sum(image.pixels.nbytes for _, _, image in images)
    # Allocated in shared memory at once, as DataLoader's own collate does (share_memory_() would copy it there).
    block = torch.empty(0, dtype=torch.uint8).new(torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(
        total, device="cpu"))
    places, offset, flat = [], 0, block.numpy()
    for position, index, image in images:
        size = image.pixels.nbytes
        flat[offset:offset + size] = image.pixels.reshape(-1)
        places.append((position, index, offset, image.pixels.shape))
        image.pixels = None
        offset += size
    return Chunk(items, block, places)


def unchunked(chunks: Iterable[Chunk]) -> Iterator:
    """The items of each chunk in order, each decoded image's pixels a view of the chunk's block."""
    for chunk in chunks:
        for position, index, offset, shape in chunk.places:
            image = chunk.items[position].images[index]
            image.pixels = chunk.block[offset:offset + int(np.prod(shape))].view(shape)
        yield from chunk.items
