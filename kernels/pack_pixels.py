"""Preprocess a batch of mixed-size uint8 images into the family's packed patch rows, in two launches.

    host:      PIL filter taps per image and axis (kernels/taps.py), flat with per-image offsets;
               every image copied once into one device buffer
    kernel 1:  horizontal pass of every image whose width changes, rounded and clamped to uint8
               into a staging area of the same buffer (PIL's two-pass semantics)
    kernel 2:  for each value of the packed output: vertical pass, round and clamp, composite RGBA
               onto the background (floor), pad with raw 0, x*scale + bias, stored at its (row,
               column) of the family's PatchLayout; in every time slice of a row (TPS) for a still image,
               or, for a clip's frames in pairs (Qwen's temporal patches), each slice from its own frame

Each program block belongs to one image (its tables say which), so one launch covers any mix of
sizes. Kernel 2 walks the output in order, so its stores are contiguous and its loads gather.
The oracle is kernels/reference.py followed by `PatchLayout.patchify`.

Only builtins of triton.language, none of its @jit library functions (tl.zeros ...): those are
compiled-mode objects when triton was imported before TRITON_INTERPRET was set, and the CPU tests
interpret the kernels in a process where transformers has long imported triton.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from batchvlm.kernels.reference import BACKGROUNDS, CHESSBOARD_GRAY, CHESSBOARD_SQUARE, CHESSBOARD_WHITE
from batchvlm.kernels.taps import filter_taps, max_taps
from batchvlm.devices import gather_to, launching_on
from batchvlm.format.layouts import MERGE_WINDOW, RASTER_CHW, RASTER_HWC, PatchLayout

BLOCK = 1024
LAYOUT_CODES = {RASTER_CHW: 0, MERGE_WINDOW: 1, RASTER_HWC: 2}
# Columns of the per-image tables the kernels read (constexpr: the only globals a compiled kernel may read).
H_SOURCE, H_WIDTH_IN, H_CHANNELS, H_STAGE, H_WIDTH_OUT, H_TABLE, H_COUNT, H_COLUMNS = map(tl.constexpr, range(8))
(V_STAGE, V_HEIGHT_IN, V_WIDTH, V_CHANNELS, V_HEIGHT_OUT, V_GRID_W, V_TABLE, V_OUT, V_COUNT, V_STEP,
 V_COLUMNS) = map(tl.constexpr, range(11))
SQUARE, GRAY, WHITE = tl.constexpr(CHESSBOARD_SQUARE), tl.constexpr(CHESSBOARD_GRAY), tl.constexpr(CHESSBOARD_WHITE)


@triton.jit
def _round_half_even(x):
    # torch.round, which the reference uses between passes, rounds halves to even.
    rounded = tl.floor(x + 0.5)
    odd = (rounded - 2.0 * tl.floor(rounded * 0.5)) == 1.0
    return tl.where(((rounded - x) == 0.5) & odd, rounded - 1.0, rounded)


@triton.jit
def _to_uint8_range(x):
    return tl.minimum(tl.maximum(_round_half_even(x), 0.0), 255.0)


@triton.jit
def _resample(buffer_ptr, base, stride, size_in, out_index, start_ptr, weight_ptr, table, taps, mask):
    """One antialiased pass along one axis: output `out_index` is the weighted sum of its taps, the input
    samples at `base + k * stride` for k < size_in (zero-weight padding taps past the end are never read),
    rounded and clamped to the uint8 range as PIL does between its passes."""
    start = tl.load(start_ptr + table + out_index, mask=mask, other=0)
    acc = tl.full(out_index.shape, 0.0, tl.float32)
    for k in range(taps):
        weight = tl.load(weight_ptr + (table + out_index) * taps + k, mask=mask, other=0.0)
        sample = start + k
        pixel = tl.load(buffer_ptr + base + sample * stride, mask=mask & (sample < size_in), other=0)
        acc += weight * pixel.to(tl.float32)
    return _to_uint8_range(acc)


@triton.jit
def _horizontal_pass(buffer_ptr, meta_ptr, block_image_ptr, block_offset_ptr, start_ptr, weight_ptr, taps,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    meta = meta_ptr + tl.load(block_image_ptr + pid) * H_COLUMNS
    source = tl.load(meta + H_SOURCE)
    width_in = tl.load(meta + H_WIDTH_IN)
    channels = tl.load(meta + H_CHANNELS)
    width_out = tl.load(meta + H_WIDTH_OUT)
    table = tl.load(meta + H_TABLE)
    element = tl.load(block_offset_ptr + pid) + tl.arange(0, BLOCK)
    valid = element < tl.load(meta + H_COUNT)
    c = element % channels
    x = (element // channels) % width_out
    y = element // (channels * width_out)
    # along a row: neighbouring pixels are `channels` apart
    value = _resample(buffer_ptr, source + y * width_in * channels + c, channels, width_in, x, start_ptr, weight_ptr,
                      table, taps, valid)
    tl.store(buffer_ptr + tl.load(meta + H_STAGE) + element, value.to(tl.uint8), mask=valid)


@triton.jit
def _packed_value(buffer_ptr, stage, width, channels, height_in, y, x, c, inside, valid, start_ptr, weight_ptr, table,
                  taps, scale_ptr, bias_ptr, background, CHESSBOARD: tl.constexpr):
    """The normalized value at (y, x, c) of the image staged at `stage`: its vertical pass, alpha composited, padded."""
    # down a column: neighbouring pixels are a staged row (width * channels) apart
    row_stride = width * channels
    value = _resample(buffer_ptr, stage + x * channels + c, row_stride, height_in, y, start_ptr, weight_ptr, table,
                      taps, inside)
    if channels == 4:
        alpha = _resample(buffer_ptr, stage + x * channels + 3, row_stride, height_in, y, start_ptr, weight_ptr,
                          table, taps, inside)
        alpha = tl.minimum(tl.maximum(alpha / 255.0, 0.0), 1.0)
        if CHESSBOARD:
            cell = ((y // SQUARE) + (x // SQUARE)) % 2
            behind = tl.where(cell == 1, GRAY, WHITE)
        else:
            behind = background
        value = tl.floor(tl.minimum(tl.maximum(alpha * value + (1.0 - alpha) * behind, 0.0), 255.0))
    value = tl.where(inside, value, 0.0)  # pad with raw 0, before normalizing
    return value * tl.load(scale_ptr + c, mask=valid, other=0.0) + tl.load(bias_ptr + c, mask=valid, other=0.0)


@triton.jit
def _vertical_pass_and_pack(buffer_ptr, out_ptr, meta_ptr, block_image_ptr, block_offset_ptr, start_ptr, weight_ptr,
                            taps, scale_ptr, bias_ptr, background, LAYOUT: tl.constexpr, P: tl.constexpr,
                            M: tl.constexpr, TPS: tl.constexpr, CHESSBOARD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    meta = meta_ptr + tl.load(block_image_ptr + pid) * V_COLUMNS
    stage = tl.load(meta + V_STAGE)
    height_in = tl.load(meta + V_HEIGHT_IN)
    width = tl.load(meta + V_WIDTH)
    channels = tl.load(meta + V_CHANNELS)
    height = tl.load(meta + V_HEIGHT_OUT)
    grid_w = tl.load(meta + V_GRID_W)
    table = tl.load(meta + V_TABLE)
    # One element per value of a time slice: a still image's TPS slices are equal, stored TPS times.
    element = tl.load(block_offset_ptr + pid) + tl.arange(0, BLOCK)
    valid = element < tl.load(meta + V_COUNT)
    row = element // (3 * P * P)
    value_index = element % (3 * P * P)
    if LAYOUT == 2:  # raster HWC: (py, px, c) within the row
        c = value_index % 3
        px = (value_index // 3) % P
        py = value_index // (3 * P)
    else:  # raster CHW and merge window: (c, py, px) within the row
        c = value_index // (P * P)
        py = (value_index // P) % P
        px = value_index % P
    if LAYOUT == 1:  # rows grouped by M x M merge window, windows in raster order
        window = row // (M * M)
        within = row % (M * M)
        i = (window // (grid_w // M)) * M + within // M
        j = (window % (grid_w // M)) * M + within % M
    else:
        i = row // grid_w
        j = row % grid_w
    y = i * P + py
    x = j * P + px
    inside = valid & (y < height) & (x < width)
    normalized = _packed_value(buffer_ptr, stage, width, channels, height_in, y, x, c, inside, valid, start_ptr,
                               weight_ptr, table, taps, scale_ptr, bias_ptr, background, CHESSBOARD)
    destination = out_ptr + tl.load(meta + V_OUT) + row * (3 * TPS * P * P) + value_index
    for tau in tl.static_range(TPS):
        if tau > 0:  # compiled only where rows have time slices (layouts without read nothing more)
            # A clip's temporal patch holds TPS different frames, staged `step` apart; a still image (step 0) is one
            # frame repeated, computed once.
            step = tl.load(meta + V_STEP)
            if step != 0:
                normalized = _packed_value(buffer_ptr, stage + tau * step, width, channels, height_in, y, x, c,
                                           inside, valid, start_ptr, weight_ptr, table, taps, scale_ptr, bias_ptr,
                                           background, CHESSBOARD)
        # merge window rows are (c, tau, py, px): frame tau of channel c sits tau * P * P further on
        tl.store(destination + c * (TPS - 1) * P * P + tau * P * P, normalized, mask=valid)


def _blocks(counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For every program: the image it works on and its first element in that image."""
    per_image = [-(-count // BLOCK) for count in counts]
    image = np.repeat(np.arange(len(counts)), per_image)
    offset = np.concatenate([np.arange(n) * BLOCK for n in per_image]) if per_image else np.zeros(0)
    return image.astype(np.int64), offset.astype(np.int64)


def _axis_tables(sizes: list[tuple[int, int]], resample: str) -> tuple[np.ndarray, np.ndarray, list[int], int]:
    """Filter taps of one axis for every (in, out) pair, concatenated: start, weights, each pair's offset, width. A
    pair seen before (a clip's frames share one size) shares its taps' offset."""
    width = max((max_taps(n_in, n_out, resample) for n_in, n_out in sizes), default=1)
    starts, weights, offsets, cursor, seen = [], [], [], 0, {}
    for n_in, n_out in sizes:
        if (n_in, n_out) not in seen:
            start, weight = filter_taps(n_in, n_out, resample, width)
            starts.append(start)
            weights.append(weight)
            seen[n_in, n_out] = cursor
            cursor += n_out
        offsets.append(seen[n_in, n_out])
    if not sizes:
        return np.zeros(0, np.int64), np.zeros((0, width), np.float32), offsets, width
    return np.concatenate(starts), np.concatenate(weights), offsets, width


def _device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def pack_images(images: list[torch.Tensor], resized: list[tuple[int, int]], padded: list[tuple[int, int]],
                layout: PatchLayout, resample: str, background: str, scale: torch.Tensor, bias: torch.Tensor,
                device: torch.device, second_slice: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """HWC uint8 images (RGB or RGBA, on the host or on `device`) -> (packed rows [N, *layout.row_shape], rows per
    image).

    `resized` and `padded` are (height, width) per image; `scale` and `bias` the 3 per-channel
    normalization constants. Rows are in input order, each image's at its offset.

    `second_slice` (layouts of two time slices: a clip's frames in pairs): per image, the image whose pixels fill the
    second time slice of its rows; its own index for a still image (both slices the same, as without the list). An
    image named as another's second slice, of the same size, writes no rows of its own (0 rows).
    """
    with launching_on(device):  # Triton launches on the current CUDA device, which need not be the job's
        return _pack_images(images, resized, padded, layout, resample, background, scale, bias, device,
                            second_slice)


def _second_slices(images: list[torch.Tensor], resized: list[tuple[int, int]], second_slice: list[int] | None,
                   tps: int) -> set[int]:
    """The images that are another's second time slice (checked: only where a row has two, at the same size)."""
    if second_slice is None:
        return set()
    slices = {j for i, j in enumerate(second_slice) if j != i}
    for i, j in enumerate(second_slice):
        if j != i and (tps != 2 or images[j].shape != images[i].shape or resized[j] != resized[i]):
            raise ValueError(f"image {j} cannot be image {i}'s second time slice: a row of this layout has {tps} "
                             f"slices, the images are {tuple(images[i].shape)} -> {resized[i]} and "
                             f"{tuple(images[j].shape)} -> {resized[j]}")
    return slices


def _pack_images(images: list[torch.Tensor], resized: list[tuple[int, int]], padded: list[tuple[int, int]],
                 layout: PatchLayout, resample: str, background: str, scale: torch.Tensor, bias: torch.Tensor,
                 device: torch.device, second_slice: list[int] | None) -> tuple[torch.Tensor, list[int]]:
    p, m, tps = layout.patch_size, layout.merge_size if layout.kind == MERGE_WINDOW else 1, layout.temporal_patch_size
    slices = _second_slices(images, resized, second_slice, tps)
    sizes = [int(image.numel()) for image in images]
    source = np.cumsum([0] + sizes[:-1]).astype(np.int64)
    widened = [i for i, image in enumerate(images) if image.shape[1] != resized[i][1]]
    staged = [images[i].shape[0] * resized[i][1] * images[i].shape[2] for i in widened]
    stage = source.copy()  # images that keep their width are read in place
    stage[widened] = sum(sizes) + np.cumsum([0] + staged[:-1]).astype(np.int64)
    buffer = torch.empty(sum(sizes) + sum(staged), dtype=torch.uint8, device=device)
    # Images decoded on the host gathered straight into one pinned staging block, reused batch after batch; those
    # decoded on the device already (decode.jpeg=device) copied on the device.
    if images:
        gather_to(images, buffer[:sum(sizes)])

    if widened:
        h_start, h_weight, h_offset, h_taps = _axis_tables(
            [(images[i].shape[1], resized[i][1]) for i in widened], resample)
        h_meta = np.array([[source[i], images[i].shape[1], images[i].shape[2], stage[i], resized[i][1], offset, count]
                           for i, offset, count in zip(widened, h_offset, staged)], np.int64)
        block_image, block_offset = _blocks(staged)
        _horizontal_pass[(len(block_image),)](
            buffer, _device(h_meta, device), _device(block_image, device), _device(block_offset, device),
            _device(h_start, device), _device(h_weight, device), h_taps, BLOCK=BLOCK)

    rows = [0 if i in slices else (h // p) * (w // p) for i, (h, w) in enumerate(padded)]
    counts = [n * 3 * p * p for n in rows]
    # NaN until written: a value the kernel misses fails preprocess.feature_length's check that every row is finite.
    out = torch.full((sum(rows), *layout.row_shape), float("nan"), dtype=torch.float32, device=device)
    v_start, v_weight, v_offset, v_taps = _axis_tables(
        [(image.shape[0], size[0]) for image, size in zip(images, resized)], resample)
    out_offset = np.cumsum([0] + rows[:-1]) * (3 * tps * p * p)
    v_meta = np.array([[stage[i], image.shape[0], resized[i][1], image.shape[2], resized[i][0], padded[i][1] // p,
                        v_offset[i], out_offset[i], counts[i], 0 if second_slice is None else
                        stage[second_slice[i]] - stage[i]] for i, image in enumerate(images)], np.int64)
    block_image, block_offset = _blocks(counts)
    if len(block_image):
        _vertical_pass_and_pack[(len(block_image),)](
            buffer, out, _device(v_meta.reshape(-1, int(V_COLUMNS)), device), _device(block_image, device),
            _device(block_offset, device), _device(v_start, device), _device(v_weight, device), v_taps,
            scale.to(device, torch.float32).contiguous(), bias.to(device, torch.float32).contiguous(),
            BACKGROUNDS.get(background, 0.0), LAYOUT=LAYOUT_CODES[layout.kind], P=p, M=m, TPS=tps,
            CHESSBOARD=background == "chessboard", BLOCK=BLOCK)
    return out, rows
