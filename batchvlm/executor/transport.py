"""How a worker's stream crosses to the main process: in chunks, one crossing each, the decoded pixels handed over by
reference, never copied by the main process.

DataLoader pickles whatever a worker yields into a pipe, which the main process reads and unpickles: item by item, a
1080p image's 6 MB copied four times, in the one process that feeds the device. Here:
- Each worker has a ring of shared memory (`Rings`), mapped by the main process before the workers fork, so that the
  main process, the worker and the worker's decoder child (forked from it) all map the same pages. The child writes an
  image's pixels straight into the free run at the ring's head (`RingWriter.free_run`, pipeline.decode); the worker
  keeps a view; the main process makes a tensor view of its own mapping. On CUDA the rings are page-locked once, when
  the job is built (`Rings.pin`), so that a batch's pixels cross to the device from the ring itself
  (devices.gather_to). A slice is given back once the main process has dropped the image (its batch finished): the
  worker reuses ring space in order, and where the ring is full it falls back to the path below. Every pass of the
  job (its workers fork anew) starts the rings over (`Rings.restart`).
- Pixels not in a ring (decoded in-process, too large for the free run) are copied into one new shared block per
  chunk (`torch.multiprocessing` hands its file descriptor over).
- A worker groups its stream into chunks, closed at a batch's patch budget, at `records`, or at a unit's end (so that
  a unit's last records never wait for the next unit's): what crosses the pipe is the records' small fields, the
  places of their pixels, and at most one descriptor.
The main process passes the items on in their order.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import multiprocessing
import weakref
from collections.abc import Iterable, Iterator

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from batchvlm.records import DecodedClip, DecodedImage, PreparedRecord, UnitEnd

log = logging.getLogger("batchvlm")

RING_BYTES = 128 << 20
"""Each worker's ring: room for its chunks in flight and the main process's batches (page-locked on CUDA: 1.9 GB for
fifteen workers); an image that does not fit the free run takes the copying path."""


@dataclass
class Chunk:
    """Items of one worker's stream in their order. Where each decoded image's pixels lie: `places`, (item, image,
    first byte, shape) in `block`; `in_ring`, (item, image, slice start, shape) in the worker's ring; `slices`, the
    ring slices (start, end: bytes since the ring began, padding included) the worker took since its last chunk,
    whether or not an image of this chunk holds one (an image of a record quarantined after it decoded does not)."""

    items: list
    block: torch.Tensor | None = None
    places: list[tuple[int, int, int, tuple[int, ...]]] = field(default_factory=list)
    worker: int = 0
    in_ring: list[tuple[int, int, int, tuple[int, ...]]] = field(default_factory=list)
    slices: list[tuple[int, int]] = field(default_factory=list)


class RingWriter:
    """A worker's end of its ring: hands out the free run at the head, in order, and takes back what the main process
    has released (`released`, bytes since the ring began, which the main process advances)."""

    def __init__(self, ring: mmap.mmap, released, index: int):
        self.map, self.released, self.index = ring, released, index
        self.size, self.address = len(ring), ring_address(ring)
        self.head = 0  # bytes handed out since the ring began, padding included
        self.taken_slices: list[tuple[int, int]] = []
        self.starts: dict[int, int] = {}  # ring offset of an image -> its slice's start

    def free_run(self) -> tuple[int, int]:
        """(ring offset, bytes) of the longest free run that the next image may take: after the head, or from the
        ring's start where the head's run to the end is the shorter (its tail is then skipped)."""
        free = self.size - (self.head - self.released[self.index])
        offset = self.head % self.size
        tail = min(free, self.size - offset)
        front = free - tail
        return (0, front) if front > tail else (offset, tail)

    def taken(self, place: tuple[int, int], shape: tuple[int, ...]) -> np.ndarray:
        """The image the decoder's child wrote at `place` (from `free_run`): its slice taken, a view returned."""
        offset, size = place[0], int(np.prod(shape))
        start = self.head
        self.head += (self.size - self.head % self.size if offset != self.head % self.size else 0) + size
        self.taken_slices.append((start, self.head))
        self.starts[offset] = start
        return np.frombuffer(self.map, np.uint8, size, offset).reshape(shape)

    def slice_of(self, pixels: np.ndarray) -> int | None:
        """The start of the slice holding these pixels, where `taken` handed them out."""
        offset = pixels.__array_interface__["data"][0] - self.address
        return self.starts.pop(offset, None) if 0 <= offset < self.size else None

    def handed(self) -> list[tuple[int, int]]:
        slices, self.taken_slices = self.taken_slices, []
        return slices


def ring_address(ring: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(ring))


class Rings:
    """One ring per worker, made in the main process before the workers fork, and the main process's account of which
    slices it still holds (a slice is released, in order, once no image of it is alive here)."""

    def __init__(self, workers: int, size: int = RING_BYTES):
        self.maps = [mmap.mmap(-1, size) for _ in range(workers)]
        self.released = multiprocessing.RawArray("q", workers)
        self.generation = 0
        self.restart()

    def restart(self) -> None:
        """For a pass's new workers: every ring empty (an image of the last pass still alive gives nothing back)."""
        self.generation += 1
        self.released[:] = [0] * len(self.maps)
        self.ends: list[dict[int, int]] = [{} for _ in self.maps]  # slice start -> end, not yet released
        self.freed: list[set[int]] = [set() for _ in self.maps]

    def writer(self, worker: int) -> RingWriter:
        return RingWriter(self.maps[worker], self.released, worker)

    def arrived(self, chunk: Chunk) -> None:
        """The slices a chunk lists, those its images hold kept until the images are dropped, the others released."""
        worker = chunk.worker
        for start, end in chunk.slices:
            self.ends[worker][start] = end
        held = {start for _, _, start, _ in chunk.in_ring}
        for start, _ in chunk.slices:
            if start not in held:
                self._release(worker, start, self.generation)

    def view(self, worker: int, start: int, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The pixels at `offset` of a worker's ring, as a tensor; their slice released once it is dropped."""
        size = int(np.prod(shape))
        pixels = torch.frombuffer(self.maps[worker], dtype=torch.uint8, count=size, offset=offset).view(shape)
        weakref.finalize(pixels, self._release, worker, start, self.generation)
        return pixels

    def _release(self, worker: int, start: int, generation: int) -> None:
        if generation != self.generation:
            return
        self.freed[worker].add(start)
        released = self.released[worker]
        while released in self.freed[worker]:
            self.freed[worker].remove(released)
            released = self.ends[worker].pop(released)
        self.released[worker] = released

    def pin(self, device: torch.device) -> None:
        """On CUDA the rings page-locked (once: it touches every page), so that pixels cross to the device from them;
        unlocked when the rings are dropped."""
        addresses = []
        try:
            for ring in self.maps if device.type == "cuda" else ():
                address = ring_address(ring)
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, len(ring), 0))
                addresses.append(address)
        except RuntimeError as error:
            log.warning("a worker's ring could not be page-locked (%s): its pixels cross through a staging copy", error)
        weakref.finalize(self, unpin, addresses)


def unpin(addresses: list[int]) -> None:
    for address in addresses:
        torch.cuda.cudart().cudaHostUnregister(address)


def job_rings(workers: int, device: torch.device) -> Rings | None:
    """A job's rings (none where its stream runs inline), page-locked on CUDA."""
    if workers == 0:
        return None
    rings = Rings(workers)
    rings.pin(device)
    return rings


class ChunkedStream(IterableDataset):
    """A worker's stream (an IterableDataset of items, with the decoder it decodes with) as chunks, its decoder's
    pixels written to the worker's ring."""

    def __init__(self, stream: IterableDataset, patch_budget: int, records: int, rings: Rings | None = None):
        self.stream, self.patch_budget, self.records, self.rings = stream, patch_budget, records, rings

    def __iter__(self) -> Iterator[Chunk]:
        worker = get_worker_info()
        ring = None
        if self.rings is not None and worker is not None:
            ring = self.stream.decoder.ring = self.rings.writer(worker.id)
        return chunked(iter(self.stream), self.patch_budget, self.records, ring)


def chunked(items: Iterable, patch_budget: int, records: int, ring: RingWriter | None = None) -> Iterator[Chunk]:
    pending, patches, count = [], 0, 0
    for item in items:
        pending.append(item)
        if isinstance(item, PreparedRecord):
            patches += item.num_patches
            count += 1
        if isinstance(item, UnitEnd) or patches >= patch_budget or count >= records:
            yield shared(pending, ring)
            pending, patches, count = [], 0, 0
    if pending or (ring is not None and ring.taken_slices):
        yield shared(pending, ring)


def host_images(items: list) -> Iterator[tuple[int, int, DecodedImage | DecodedClip]]:
    """(item, index among its media, image) of each decoded image (or clip's frames) whose pixels are a host array."""
    for position, item in enumerate(items):
        if isinstance(item, PreparedRecord):
            for index, image in enumerate(item.media):
                if isinstance(image, (DecodedImage, DecodedClip)) and isinstance(image.pixels, np.ndarray):
                    yield position, index, image


def shared(items: list, ring: RingWriter | None = None) -> Chunk:
    """The items as a chunk, their decoded pixels (taken off the items: they cross once) placed in the ring where the
    decoder wrote them there, or else moved into one new shared block."""
    chunk = Chunk(items, worker=0 if ring is None else ring.index, slices=[] if ring is None else ring.handed())
    copied = []
    for position, index, image in host_images(items):
        start = None if ring is None else ring.slice_of(image.pixels)
        if start is None:
            copied.append((position, index, image))
        else:
            chunk.in_ring.append((position, index, start, image.pixels.shape))
            image.pixels = None
    if copied:
        chunk.block = shared_block(sum(image.pixels.nbytes for _, _, image in copied))
        offset, flat = 0, chunk.block.numpy()
        for position, index, image in copied:
            size = image.pixels.nbytes
            flat[offset:offset + size] = image.pixels.reshape(-1)
            chunk.places.append((position, index, offset, image.pixels.shape))
            image.pixels = None
            offset += size
    return chunk


def shared_block(size: int) -> torch.Tensor:
    """A uint8 tensor in shared memory at once, as DataLoader's own collate makes one (share_memory_() copies)."""
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(size, device="cpu")
    return torch.empty(0, dtype=torch.uint8).new(storage)


def unchunked(chunks: Iterable[Chunk], rings: Rings | None = None) -> Iterator:
    """The items of each chunk in order, each decoded image's pixels a view of its ring or of the chunk's block."""
    for chunk in chunks:
        for position, index, offset, shape in chunk.places:
            chunk.items[position].media[index].pixels = chunk.block[offset:offset + int(np.prod(shape))].view(shape)
        if rings is not None:
            rings.arrived(chunk)
            for position, index, start, shape in chunk.in_ring:
                offset = rings_offset(rings, chunk, start, shape)
                chunk.items[position].media[index].pixels = rings.view(chunk.worker, start, offset, shape)
        yield from chunk.items


def rings_offset(rings: Rings, chunk: Chunk, start: int, shape: tuple[int, ...]) -> int:
    """The ring offset of the image in the slice starting at `start`: its end less its size (a skipped tail comes
    first in a slice)."""
    end = rings.ends[chunk.worker][start]
    return (end - int(np.prod(shape))) % len(rings.maps[chunk.worker])
