"""The kernels' parameter record (``AttnParams`` in ``kernels/attention/params.cuh``).

Built as a NumPy structured scalar and passed to the kernel by value. Every
field is 8 bytes wide, so C++ and NumPy lay it out alike with no padding (but
for WsFwdParams' 64-byte-aligned tensor maps, whose offsets are given); the
kernel checks the size at compile time.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass

import numpy as np

MAX_BATCH_DIMS = 8

PARAMS_DTYPE = np.dtype(
    [
        ("q", np.uint64), ("k", np.uint64), ("v", np.uint64), ("out", np.uint64), ("lse", np.uint64),
        ("cu_seqlens_q", np.uint64), ("cu_seqlens_k", np.uint64), ("tiles", np.uint64),
        ("alibi_slopes", np.uint64), ("sinks", np.uint64), ("bias", np.uint64), ("dropout_seed", np.uint64),
        ("user_args", np.uint64),
        ("q_row_stride", np.int64), ("k_row_stride", np.int64), ("v_row_stride", np.int64),
        ("nq", np.int64), ("nk", np.int64), ("d", np.int64), ("dv", np.int64),
        ("window_left", np.int64), ("window_right", np.int64),
        ("scale_log2", np.float32), ("scale_log2_lo", np.float32),
        ("cap", np.float32), ("cap_inv", np.float32), ("unscale", np.float32), ("slope_unit", np.float32),
        ("dropout_threshold", np.uint32), ("dropout_scale", np.float32),
        ("bias_row_stride", np.int64), ("bias_col_stride", np.int64), ("bias_float32", np.int64),
        ("num_m_blocks", np.int64),
        ("num_tiles", np.int64),
        ("batch_size", np.int64),
        ("grid_group", np.int64),
        ("group_size", np.int64), ("group_inner", np.int64), ("q_group_stride", np.int64),
        ("batch_ndim", np.int64),
        ("batch_shape", np.int64, (MAX_BATCH_DIMS,)),
        ("q_batch_stride", np.int64, (MAX_BATCH_DIMS,)),
        ("k_batch_stride", np.int64, (MAX_BATCH_DIMS,)),
        ("v_batch_stride", np.int64, (MAX_BATCH_DIMS,)),
        ("bias_batch_stride", np.int64, (MAX_BATCH_DIMS,)),
        ("batch_div", np.int64, (MAX_BATCH_DIMS,)),
        ("entries_div", np.int64), ("group_div", np.int64), ("grid_div", np.int64),
    ]
)


# kernels/prefill/attn_fwd_sm90_ws.cuh: WsFwdParams, AttnParams then three 128-byte tensor
# maps from a 64-byte boundary (_tensor_map.attention_maps; zeros where the kernel loads by
# cp.async), then the pointer to the tile counter (_launch.tile_counter), padded to 64 bytes
MAP_BYTES = 128
WS_MAPS_OFFSET = -(-PARAMS_DTYPE.itemsize // 64) * 64
WS_COUNTER_OFFSET = WS_MAPS_OFFSET + 3 * MAP_BYTES
WS_PARAMS_DTYPE = np.dtype({
    "names": list(PARAMS_DTYPE.names) + ["q_map", "k_map", "v_map", "tile_counter"],
    "formats": [PARAMS_DTYPE.fields[n][0] for n in PARAMS_DTYPE.names] + [(np.uint8, (MAP_BYTES,))] * 3 + [np.uint64],
    "offsets": [PARAMS_DTYPE.fields[n][1] for n in PARAMS_DTYPE.names]
    + [WS_MAPS_OFFSET + i * MAP_BYTES for i in range(3)] + [WS_COUNTER_OFFSET],
    "itemsize": -(-(WS_COUNTER_OFFSET + 8) // 64) * 64,
})


BWD_PARAMS_DTYPE = np.dtype(
    PARAMS_DTYPE.descr
    + [
        ("dout", np.uint64), ("delta", np.uint64), ("dq", np.uint64), ("dk", np.uint64), ("dv_grad", np.uint64),
        ("dbias", np.uint64), ("num_n_blocks", np.int64),
    ]
)


# Threads of the one block that builds a tile list (kernels/attention/schedule.cuh), given to
# the kernels as CUFLASH_SCHEDULE_THREADS.
SCHEDULE_THREADS = 1024

# kernels/decode/decode.cuh: DecodeParams, field for field (pointers first).
DECODE_POINTERS = ("q", "k", "v", "out", "lse", "seqlens", "block_table", "part_out", "part_lse", "split_counts", "k_new", "v_new",
                   "alibi_slopes", "sinks", "user_args")
DECODE_PARAMS_DTYPE = np.dtype(
    [(name, np.uint64) for name in DECODE_POINTERS]
    + [(name, np.int64) for name in (
        "q_stride_b", "q_stride_e", "q_stride_row", "k_stride_b", "k_stride_e", "k_stride_row",
        "v_stride_b", "v_stride_e", "v_stride_row", "kn_stride_b", "kn_stride_e", "kn_stride_row",
        "vn_stride_b", "vn_stride_e", "vn_stride_row", "batch", "entries", "rows", "nq", "d", "dv", "n_new",
        "seqlen_all", "capacity", "page_size", "page_div", "num_pages", "max_pages", "window_left", "window_right")]
    + [("scale_log2", np.float32), ("scale_log2_lo", np.float32), ("splits", np.int64), ("split_keys", np.int64)]
    + [(name, np.float32) for name in ("cap", "cap_inv", "unscale", "slope_unit")]
)


def decode_params(**fields) -> np.ndarray:
    """One ``DecodeParams`` record (a length-1 structured array), every field by name but
    the pointers, which are left 0 (``Record.fill`` gives them)."""
    values = (0,) * len(DECODE_POINTERS) + tuple(fields.pop(name) for name in DECODE_PARAMS_DTYPE.names[len(DECODE_POINTERS):])
    if fields:
        raise TypeError(f"not fields of DecodeParams: {sorted(fields)}")
    return np.array([values], dtype=DECODE_PARAMS_DTYPE)


def scale_log2_parts(scale: float) -> tuple[float, float]:
    """scale * log2(e) rounded to float32, and the float32 nearest the rest: the kernels'
    ``scale_log2`` and ``scale_log2_lo`` (float32 inputs multiply by both)."""
    exact = scale * math.log2(math.e)
    with np.errstate(over="ignore", invalid="ignore"):   # a scale past float32's range: inf, as the kernels had it
        high = np.float32(exact)
        return float(high), float(np.float32(exact - float(high)))


def score_units(mods, scale: float) -> tuple[float, float, float, float]:
    """AttnParams' cap, cap_inv, unscale, slope_unit (kernels/attention/score_path.cuh) for the
    call's modifiers ``mods`` (_mods.ScoreMods, or None): softcap c in raw scores' units, c / scale
    and scale / c (0, 0: none), 1 / (scale log2 e) and 1 / scale (0 where the scale is 0: no
    modifier then reaches the kernels)."""
    softcap = mods.softcap if mods is not None else 0.0
    cap = (softcap / scale, scale / softcap) if softcap and scale else (0.0, 0.0)
    return cap + ((1 / (scale * math.log2(math.e)), 1 / scale) if scale else (0.0, 0.0))


def bias_and_dropout(mods, batch_dims: int) -> tuple:
    """AttnParams' dropout_threshold, dropout_scale, bias_row_stride, bias_col_stride,
    bias_float32 and bias_batch_stride (kernels/attention/score_path.cuh) for the call's
    modifiers ``mods`` (_mods.ScoreMods, or None), over ``batch_dims`` kernel batch dims."""
    p = mods.dropout_p if mods is not None else 0.0
    dropout = (math.floor(p * 65536), 1 / (1 - p)) if p else (0, 1.0)
    bias = mods.bias if mods is not None else None
    if bias is None:
        return dropout + (0, 0, 0, (0,) * MAX_BATCH_DIMS)
    pad = batch_dims - len(bias.batch_strides)   # (leading dims of size 1: a tensor map's padded layout)
    assert pad >= 0, "the bias's strides are those of the kernels' batch dims"
    return dropout + (bias.row_stride, bias.col_stride, int(bias.float32),
                      (0,) * pad + tuple(bias.batch_strides) + (0,) * (MAX_BATCH_DIMS - batch_dims))


def fast_divisor(d: int) -> int:
    """The constant of params.cuh's fast_div for divisor d (dividends below 2**31): with
    l = ceil(log2 d) and m = ceil(2**(31 + l) / d), n // d == (n * m >> 32) >> (l - 1),
    packed as m | (l - 1) << 32; 0 for d = 1 (the dividend itself)."""
    if d <= 1:
        return 0
    log = (d - 1).bit_length()
    return -(-(1 << (31 + log)) // d) | (log - 1) << 32


# What the batch entries of one group of the grid order may read (K and V, or Q
# and dO): a fraction of the L2 cache of current GPUs (40 MB and more).
GRID_GROUP_BYTES = 16 << 20


def window_sides(left, right, nq: int, nk: int) -> tuple[int, int]:
    """The band's sides as the kernels take them (kernels/attention/mask.cuh), for Nq rows
    (at most ``nq`` per sequence) against Nk keys (at most ``nk``): an unbounded side, or
    one wider than the keys, becomes the least that reaches every key, left Nk and right
    Nq, so that ``row + off + right + 1`` (at most Nk + Nq) stays within int32."""
    return (nk if left is None else min(left, nk)), (nq if right is None else min(right, nq))


def grid_group(x, entries: int) -> int:
    """Batch entries per group of a kernel's grid order (params.cuh: grid_position).

    Without a mask every block has the same work, and one entry per group keeps the
    blocks running at once on the same K and V. Under a causal or windowed mask a
    group holds as many entries as fit GRID_GROUP_BYTES, so that the blocks with the
    most keys of all of them start first and the light ones fill the end (by
    measurement, docs/design.md, "Tiles and dispatch": better than a group just large enough
    to fill the GPU)."""
    if x.left is None and x.right is None:
        return 1
    entry_bytes = max(x.nq, x.nk) * (x.d + x.dv) * x.q.itemsize
    return max(1, min(entries, GRID_GROUP_BYTES // max(1, entry_bytes)))


@dataclass(frozen=True)
class BatchLayout:
    """How a launch walks the batch: its (merged) dims, each tensor's strides along
    them (0 where broadcast), and for a grouped dk/dv pass the query group of each
    K/V entry (params.cuh: group_size, group_inner, q_group_stride)."""

    shape: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]  # q, k, v
    entries: int  # batch entries the launch covers (K/V entries when grouped)
    group_size: int = 1
    group_inner: int = 1
    q_group_stride: int = 0


def batch_layout(x) -> BatchLayout:
    """The layout of every launch but a grouped dk/dv pass."""
    return BatchLayout(tuple(x.kernel_batch_shape), tuple(x.kernel_batch_strides), x.batch_size)


def attn_params(inputs, block_m: int, layout: BatchLayout | None = None) -> np.ndarray:
    """One ``AttnParams`` record (a length-1 structured array) for a forward launch,
    its pointers left 0 (``Record.fill`` gives them)."""
    return np.array([_attn_values(inputs, block_m, layout or batch_layout(inputs))], dtype=PARAMS_DTYPE)


def ws_params(inputs, block_m: int, layout: BatchLayout | None = None) -> np.ndarray:
    """One ``WsFwdParams`` record: ``attn_params``' fields, the maps zero (``Record.write``
    gives them per call where the kernel reads through them)."""
    record = np.zeros(1, dtype=WS_PARAMS_DTYPE)
    attn = attn_params(inputs, block_m, layout)
    for name in PARAMS_DTYPE.names:
        record[0][name] = attn[0][name]
    return record


def bwd_params(inputs, resident: int, layout: BatchLayout | None = None) -> np.ndarray:
    """One ``BwdParams`` record, pointers left 0; query and key blocks of ``resident`` rows."""
    values = _attn_values(inputs, resident, layout or batch_layout(inputs))
    values += (0,) * BWD_POINTERS + (-(-inputs.nk // resident),)
    return np.array([values], dtype=BWD_PARAMS_DTYPE)


# The fields written per call, as 8-byte words of each record: q, k, v, out, lse, cu_seqlens_q,
# cu_seqlens_k, tiles, alibi_slopes, sinks, bias, dropout's seed and the user path's arguments
# first in both attention records, then the backward's dout, delta, dq, dk, dv_grad, dbias right
# after AttnParams; a DecodeParams record starts with its pointers.
FWD_POINTERS = 13
BWD_POINTERS = 6
_POINTER_WORDS = {   # runs of consecutive words (slices assign faster than index arrays)
    PARAMS_DTYPE: (slice(0, FWD_POINTERS),),
    BWD_PARAMS_DTYPE: (slice(0, FWD_POINTERS), slice(PARAMS_DTYPE.itemsize // 8, PARAMS_DTYPE.itemsize // 8 + BWD_POINTERS)),
    DECODE_PARAMS_DTYPE: (slice(0, len(DECODE_POINTERS)),),
    WS_PARAMS_DTYPE: (slice(0, FWD_POINTERS), slice(WS_COUNTER_OFFSET // 8, WS_COUNTER_OFFSET // 8 + 1)),
}


class Record:
    """A parameter record kept for launches, laid out as the driver takes a kernel's
    parameters: word 0 holds the address of the record, which follows it. ``fill``
    writes each call's data pointers into it; the driver copies it when the kernel is
    launched, so the next call can fill it again (under ``lock``, for threads)."""

    __slots__ = ("buffer", "bytes", "words", "dtype", "kernel_params", "pointer_runs", "lock")

    def __init__(self, params: np.ndarray):
        self.buffer = np.zeros(params.nbytes // 8 + 1, dtype=np.uint64)
        self.bytes = memoryview(self.buffer).cast("B")
        self.words = self.buffer[1:]
        self.words[:] = params.view(np.uint64)
        self.dtype = params.dtype
        self.kernel_params = int(self.buffer.ctypes.data)   # (void **) for cuLaunchKernel
        self.buffer[0] = self.kernel_params + 8
        # each run of pointer words as (packer, byte offset in the buffer, first and last pointer)
        self.pointer_runs, start = [], 0
        for run in _POINTER_WORDS[params.dtype]:
            count = run.stop - run.start
            self.pointer_runs.append((struct.Struct(f"<{count}Q"), 8 * (1 + run.start), start, start + count))
            start += count
        self.lock = threading.Lock()

    def fill(self, pointers) -> None:
        """Writes the data pointers (ints, 0 for none) into the record's pointer fields, in order."""
        for packer, offset, first, last in self.pointer_runs:
            packer.pack_into(self.buffer, offset, *pointers[first:last])

    def write(self, offset: int, data: bytes) -> None:
        """Writes ``data`` into the record at byte ``offset`` (a call's tensor maps)."""
        self.bytes[8 + offset:8 + offset + len(data)] = data

    def view(self) -> np.void:
        """The record as its structured dtype (for inspection)."""
        return self.words.view(self.dtype)[0]


def _attn_values(x, block_m: int, layout: BatchLayout) -> tuple:
    """The fields of ``AttnParams``, in order, pointers 0."""
    left, right = window_sides(x.left, x.right, x.nq, x.nk)
    n = len(layout.shape)
    pad = (0,) * (MAX_BATCH_DIMS - n)
    q_strides, k_strides, v_strides = (tuple(st) + pad for st in layout.strides)
    group, m_blocks = grid_group(x, layout.entries), -(-x.nq // block_m)
    *extras, bias_strides = bias_and_dropout(x.mods, n)
    return (
        *(0,) * FWD_POINTERS,
        *x.row_strides,
        x.nq, x.nk, x.d, x.dv,
        left, right,
        *scale_log2_parts(x.scale),
        *score_units(x.mods, x.scale),
        *extras,
        m_blocks, 0, layout.entries, group,
        layout.group_size, layout.group_inner, layout.q_group_stride,
        n, tuple(layout.shape) + pad, q_strides, k_strides, v_strides, bias_strides,
        tuple(fast_divisor(d) for d in layout.shape) + pad,
        fast_divisor(layout.entries), fast_divisor(group), fast_divisor(group * m_blocks),
    )
