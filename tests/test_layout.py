"""Kernel-side layout on the CPU: the source joins, the batch-dim merging is exact."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import _checks, _compile, _dispatch, _mask, _params, _tiles


def test_kernel_source_has_every_file():
    src = _compile.kernel_source()
    for name in _compile.KERNEL_FILES:
        assert f"// ---- {name} ----" in src
    assert "attn_fwd(const AttnParams p)" in src


def test_specializations_cover_every_dtype_and_bucket():
    names = _tiles.all_specializations()
    n_types, n_dims = len(_tiles.ELEMENT_TYPES), len(_tiles.HEAD_DIM_BUCKETS)
    # per (dtype, head dim, dense or packed, score path): forward, dk/dv, dq; per dtype: delta,
    # the sum of grouped partials and merge_attention; the tile-list builder; and the KV-cache kernels
    decode = _tiles.decode_specializations()
    paths = len(_tiles.SCORE_PATHS)
    assert len(names) == len(set(names)) == n_types * (2 * 3 * n_dims * paths + 3) + 1 + len(decode)
    for dt, (elem, item) in _tiles.ELEMENT_TYPES.items():
        assert f"cuflash::kvcache_append<{elem}>" in decode
        for hd in _tiles.HEAD_DIM_BUCKETS:
            if _tiles.decode_supported(hd, item):
                for rows in (1, 20):
                    for page_size in (None, 1, 16, 64, 128, 256, 100):
                        tiles = _tiles.decode_tiles(hd, rows, item, page_size)
                        assert tiles.smem_bytes(hd, item) <= 227 * 1024
                        assert all(tiles.name(dt, hd, scores=scores) in decode for scores in _tiles.DECODE_SCORE_PATHS)
    for dt in _tiles.ELEMENT_TYPES:
        for hd in _tiles.HEAD_DIM_BUCKETS:
            item = _tiles.ELEMENT_TYPES[dt][1]
            for packed in (False, True):
                assert _tiles.fwd_tiles(dt, hd, packed).smem_bytes(item) <= 227 * 1024
                for scores in _tiles.SCORE_PATHS:
                    tiles = _tiles.fwd_tiles(dt, hd, packed, scores)
                    assert _tiles.fwd_name(dt, tiles, packed, scores) in names
                    staged = scores == _tiles.FULL and not packed   # (attn_fwd.cuh: STAGED_BIAS)
                    assert tiles.smem_bytes(item, staged_bias=staged) <= 227 * 1024
            assert _tiles.bwd_tiles(dt, hd).smem_bytes(item) <= 227 * 1024


def test_hopper_specializations_fit_shared_memory():
    names = _tiles.all_specializations("sm_90a")
    portable = set(_tiles.all_specializations())
    # on sm_90a the portable kernels remain only where no Hopper kernel exists (float32, odd buckets)
    assert all("_sm90" not in n for n in portable) and any("_sm90<" in n for n in names)
    assert any("_sm90_ws<" in n for n in names)
    # the decoding kernels for splits in several clusters per row group exist only there
    two_level = {n for n in names if n.startswith("cuflash::attn_decode<") and ", true, cuflash::" in n}
    assert two_level and not two_level & portable
    assert {n.replace(", true, ", ", false, ") for n in two_level} <= portable
    # and the rounding of dq's float32 sums, which only Hopper's dk/dv pass adds up
    sums = {_tiles.scale_dq_sums_name(dt, hd) for dt in ("float16", "bfloat16") for hd in (64, 128)}
    assert sums <= set(names) and not sums & portable
    assert {n for n in names if "_sm90" not in n} - two_level - sums < portable
    for dt in ("float16", "bfloat16"):
        for hd in _tiles.HEAD_DIM_BUCKETS:
            fwd, bwd = _tiles.sm90_fwd_tiles(dt, hd), _tiles.sm90_bwd_tiles(dt, hd)
            assert (fwd is None) == (bwd is None) == (hd % 64 != 0 or hd == 192)
            if fwd is not None:
                for packed in (False, True):
                    # every kernel the forward picks, by keys per tile, is compiled and fits:
                    # the loading-warpgroup tiles through maps where dense, by cp.async where
                    # no map fits, or (maps_only) attn_fwd_sm90 there
                    for keys, mask in itertools.product((64, 100, 128, 200, 1000, 2047, 5000, 10000), _tiles.MASKS):
                        tiles = _tiles.hopper_fwd_tiles(dt, hd, keys, mask)
                        picks = [tiles]
                        if isinstance(tiles, _tiles.Sm90WsFwdTiles):
                            fallback = tiles.without_maps() or _tiles.sm90_fwd_tiles(dt, hd, keys)
                            picks = [fallback] + ([] if packed else [dataclasses.replace(tiles, tma=True)])
                        for t in picks:
                            assert _tiles.hopper_fwd_name(dt, t, packed) in names
                            assert t.smem_bytes(2) <= 232448
                    for queries in (1, 4096):   # (head dim 64: a loading warpgroup from 2048 queries)
                        tiles = _tiles.sm90_bwd_tiles(dt, hd, queries)
                        assert set(_tiles.sm90_bwd_names(dt, tiles, packed)) <= set(names)
                        assert tiles.dkdv_smem_bytes(2) <= 232448
                        # not deterministic: the dk/dv pass on a loading warpgroup adds dq up at head dims 64 and 128
                        anyorder = _tiles.sm90_bwd_tiles(dt, hd, queries, False)
                        assert anyorder.dkdv_adds_dq == (hd in (64, 128) and queries >= 2048)
                        # (the same tiles otherwise)
                        assert dataclasses.replace(anyorder, dkdv_adds_dq=False) == tiles
                        assert anyorder.dkdv_smem_bytes(2) <= 232448
                        if not packed:   # (packed sequences always take the dq pass)
                            assert _tiles.sm90_bwd_names(dt, anyorder, packed)[0] in names
                        if anyorder.dkdv_adds_dq:
                            assert {_tiles.delta_name(dt), _tiles.scale_dq_sums_name(dt, hd)} <= set(names)
                ws = _tiles.sm90_ws_fwd_tiles(dt, hd, 5000)
                assert (ws is not None) == (hd in (64, 128, 256))
                assert (_tiles.sm90_ws_fwd_tiles(dt, hd, 100) is not None) == (hd in (128, 256))
                if ws is not None:   # three computing warpgroups at head dim 64 from 2048 keys, through maps only
                    three = hd == 64
                    assert ws.consumers == (3 if three else 2) and ws.block_m == 64 * ws.consumers
                    assert _tiles.sm90_ws_fwd_tiles(dt, hd, 2047).consumers == 2
                    for mask in _tiles.MASKS:   # three K/V stages with three computing warpgroups without a mask
                        assert _tiles.sm90_ws_fwd_tiles(dt, hd, 5000, mask).stages == (3 if three and mask == "none" else 2)
                    fallback = ws.without_maps()
                    assert fallback is None if ws.maps_only else (fallback.consumers == fallback.stages == 2 and not fallback.tma)
                if hd == 128:   # 176-key blocks without a mask from 2048 keys, causal from 8192; by cp.async 128 keys
                    for mask, keys in (("none", 2048), ("causal", 8192)):
                        wide = _tiles.sm90_ws_fwd_tiles(dt, hd, keys, mask)
                        assert (wide.block_n, wide.q_buffers) == (176, 1) and wide.maps_only
                        assert wide.without_maps() == _tiles.sm90_ws_fwd_tiles(dt, hd, keys, "window")
                        assert _tiles.sm90_ws_fwd_tiles(dt, hd, keys - 1, mask).block_n == 128
                    assert _tiles.sm90_ws_fwd_tiles(dt, hd, 10**6, "window").block_n == 128
                if hd == 256:   # 80-key blocks, one Q buffer, through maps only
                    assert (ws.block_n, ws.q_buffers, ws.maps_only) == (80, 1, True)
                assert fwd.smem_bytes(2) <= 232448 and bwd.smem_bytes(2) <= 232448
                assert bwd.dkdv_smem_bytes(2) <= 232448
    assert _tiles.sm90_fwd_tiles("float32", 64) is None


def test_head_dim_bucket():
    assert _tiles.head_dim_bucket(0, 0) == 32
    assert _tiles.head_dim_bucket(72, 8) == 96
    assert _tiles.head_dim_bucket(64, 136) == 192


@pytest.mark.parametrize("dtype", [_params.PARAMS_DTYPE, _params.BWD_PARAMS_DTYPE, _params.DECODE_PARAMS_DTYPE])
def test_params_records_have_no_padding(dtype):
    """As the kernels' structs (params.cuh): each field at a multiple of its element's
    size, back to back, 8-byte fields or pairs of 4-byte ones."""
    fields = [dtype.fields[f] for f in dtype.names]
    assert sum(f[0].itemsize for f in fields) == dtype.itemsize
    assert all(offset % f.base.itemsize == 0 for f, offset in fields)
    assert all(f.base.itemsize in (4, 8) for f, _ in fields) and dtype.itemsize % 8 == 0


def test_kernel_parameters_point_at_the_record():
    params = np.zeros(1, dtype=_params.BWD_PARAMS_DTYPE)
    params[0]["nq"], params[0]["scale_log2"] = 1234, 0.25
    record = _params.Record(params)
    # the driver's kernel parameters: one pointer, to the record that follows it
    assert record.buffer[0] == record.kernel_params + 8 == record.words.ctypes.data
    assert record.words.tobytes() == params.tobytes()
    assert record.view()["nq"] == 1234 and record.view()["scale_log2"] == 0.25


@st.composite
def broadcast_views(draw):
    nd = draw(st.integers(0, 4))
    batch = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    arrays = []
    for _ in range(3):
        keep = draw(st.integers(0, nd))  # trailing batch dims this tensor has
        shape = tuple(n if draw(st.booleans()) else 1 for n in batch[nd - keep:])
        base = np.empty(shape + (5, 8), dtype=np.float16)
        if shape and draw(st.booleans()):  # a permuted-storage view
            base = np.empty((5,) + shape + (8,), dtype=np.float16)
            base = np.moveaxis(base, 0, -2)
        arrays.append(base)
    return batch, arrays


@settings(max_examples=200, deadline=None)
@given(broadcast_views())
def test_merged_batch_layout_addresses_the_same_elements(case):
    batch, arrays = case
    shape, strides = _checks.kernel_batch_layout(batch, arrays)
    assert len(shape) <= _params.MAX_BATCH_DIMS
    assert int(np.prod(shape, dtype=np.int64)) == int(np.prod(batch, dtype=np.int64))
    for x, st_ in zip(arrays, strides):
        full = np.broadcast_to(x, batch + x.shape[-2:])
        for flat, idx in enumerate(itertools.product(*(range(n) for n in batch))):
            # decompose the flat batch index the way the kernel does (innermost dim first)
            b, offset = flat, 0
            for n, s in zip(reversed(shape), reversed(st_)):
                offset += (b % n) * s
                b //= n
            expected = (full[idx].__array_interface__["data"][0] - x.__array_interface__["data"][0]) // x.itemsize
            assert offset == expected


def _fast_div(n, magic):
    """params.cuh's fast_div, in Python: the high word of a 32 x 32-bit product, shifted."""
    m = magic & 0xFFFFFFFF
    return (n * m >> 32) >> (magic >> 32) if m else n


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.integers(1, 4096), st.integers(1, 2**31 - 1),
                 st.sampled_from([2**k + o for k in range(1, 31) for o in (-1, 0, 1)])),
       st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50))
def test_fast_divisor_divides_exactly(d, dividends):
    """The kernels' division by a multiply and a shift agrees with // for every dividend below 2**31."""
    magic = _params.fast_divisor(d)
    assert magic & 0xFFFFFFFF < 2**32 and magic >> 32 < 31
    for n in dividends + [0, 1, d - 1, d, d + 1, 2**31 - 1, (2**31 - 1) // d * d]:
        if n < 2**31:
            assert _fast_div(n, magic) == n // d, (n, d)


class _FakeArray:
    """What a call signature reads from an array, without a GPU."""

    def __init__(self, shape, strides, ptr, dtype=np.float16, device=0):
        self.shape, self.strides, self.dtype = shape, strides, np.dtype(dtype)
        self.data = type("Pointer", (), {"ptr": ptr, "device_id": device})()


def test_call_signature_separates_what_the_checks_depend_on():
    from cuflash import _plans

    def sig(*arrays, causal=False, window=None, scale=None):
        return _plans._signature("fwd", arrays, causal, window, scale)

    a = _FakeArray((2, 8, 64), (1024, 128, 2), 4096)
    base = sig(a, a, a)
    assert base is not None and base == sig(a, a, _FakeArray((2, 8, 64), (1024, 128, 2), 8192))
    others = [
        sig(a, a, _FakeArray((2, 8, 64), (1024, 128, 2), 4098)),   # off a 16-byte boundary
        sig(a, a, _FakeArray((2, 8, 64), (2048, 128, 2), 4096)),   # strides
        sig(a, a, _FakeArray((2, 8, 64), (1024, 128, 2), 4096, np.float32)),
        sig(a, a, _FakeArray((2, 8, 64), (1024, 128, 2), 4096, device=1)),
        sig(a, a, a, causal=True), sig(a, a, a, causal=1),
        sig(a, a, a, window=(4, None)), sig(a, a, a, window=(True, None)),
        sig(a, a, a, scale=1.0), sig(a, a, a, scale=1),
    ]
    assert len({base, *others}) == 1 + len(others)
    assert sig(a, a, np.zeros((2, 8, 64))) is None   # no device pointer: the checks report it
    assert sig(a, a, a, window=iter((1, 2))) is None   # left for the checks, not consumed here
    assert sig(a, a, a, scale=[1.0]) is None


def test_pointers_land_in_their_fields():
    record = np.zeros(1, dtype=_params.BWD_PARAMS_DTYPE)
    record[0]["nq"], record[0]["num_n_blocks"] = 77, 5
    names = ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "tiles", "alibi_slopes", "sinks", "bias",
             "dropout_seed", "user_args", "dout", "delta", "dq", "dk", "dv_grad", "dbias")
    arrays = [_FakeArray((1,), (2,), 4096 * (i + 1)) for i in range(len(names))]
    arrays[6] = None   # a null pointer
    kept = _params.Record(record)
    want = [0 if a is None else a.data.ptr for a in arrays]
    want[11] = 2**64 - 1   # a seed: any 64-bit int
    kept.fill(want)
    filled = kept.view()
    assert [int(filled[n]) for n in names] == want
    assert filled["nq"] == 77 and filled["num_n_blocks"] == 5 and record[0]["q"] == 0
    fwd = _params.Record(np.zeros(1, dtype=_params.PARAMS_DTYPE))
    fwd.fill(want[:_params.FWD_POINTERS])
    assert [int(fwd.view()[n]) for n in names[:_params.FWD_POINTERS]] == want[:_params.FWD_POINTERS]
    assert len(names) == _params.FWD_POINTERS + _params.BWD_POINTERS


def _group_of(q_shape, k_shape, v_shape=None):
    arrays = [np.empty(s, dtype=np.float16) for s in (q_shape, k_shape, v_shape or k_shape)]
    batch = _checks.check_shapes(*(a.shape for a in arrays))
    kshape, kstrides = _checks.kernel_batch_layout(batch, arrays)
    return _checks.query_group(batch, [a.shape for a in arrays], kshape, kstrides), kshape


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, want",
    [
        ((2, 3, 50, 64), (2, 1, 50, 64), None, (3, 3)),                  # GQA along the heads
        ((2, 8, 4, 50, 64), (2, 8, 1, 50, 64), None, (4, 4)),            # (B, Hkv, G) against (B, Hkv, 1)
        ((2, 16, 50, 64), (50, 64), None, (32, 32)),                      # one K/V for every entry
        ((4, 16, 50, 64), (1, 16, 50, 64), None, (4, 4)),                 # k shared across the batch
        ((2, 3, 50, 64), (2, 1, 50, 64), (2, 3, 50, 64), None),           # k broadcast, v not
        ((2, 8, 4, 50, 64), (1, 8, 1, 50, 64), None, None),               # two separate broadcast dims
        ((2, 3, 50, 64), (2, 3, 50, 64), None, None),                     # nothing shared
    ],
)
def test_query_group(q_shape, k_shape, v_shape, want):
    group, kshape = _group_of(q_shape, k_shape, v_shape)
    if want is None:
        assert group is None
    else:
        dim, size, q_stride = group
        assert (size, kshape[dim]) == want and q_stride != 0


def test_dkdv_layout_splits_groups_only_when_blocks_are_few():
    q = np.empty((1, 2, 8, 256, 64), dtype=np.float16)
    k = np.empty((1, 2, 1, 256, 64), dtype=np.float16)
    batch = (1, 2, 8)
    kshape, kstrides = _checks.kernel_batch_layout(batch, (q, k, k))
    group = _checks.query_group(batch, (q.shape, k.shape, k.shape), kshape, kstrides)

    class X:   # what dkdv_layout reads of AttnInputs
        batch_size, left, right = 16, None, 0
        kernel_batch_shape, kernel_batch_strides = kshape, kstrides
    X.group = group
    few, entries = _dispatch.dkdv_layout(X, key_blocks=4, slots=264)   # 2 x 4 blocks: the largest split, 4
    assert entries == (2, 4, 1) and few.entries == 8 and few.group_size == 2
    assert few.shape == (2, 4, 2) and few.strides[0] == (8 * 256 * 64, 2 * 256 * 64, 256 * 64)
    some, entries = _dispatch.dkdv_layout(X, key_blocks=40, slots=132)   # 2 x 40 blocks: 2 parts fill the GPU
    assert entries == (2, 2, 1) and some.group_size == 4
    many, entries = _dispatch.dkdv_layout(X, key_blocks=1000, slots=264)
    assert entries == (2, 1, 1) and many.entries == 2 and many.group_size == 8 and many.shape == kshape


def test_decode_params_record_holds_every_field_in_order():
    names = _params.DECODE_PARAMS_DTYPE.names
    assert names[:len(_params.DECODE_POINTERS)] == _params.DECODE_POINTERS
    values = {n: (0.25 if n == "scale_log2" else i + 1) for i, n in enumerate(names)}
    fields = {n: x for n, x in values.items() if n not in _params.DECODE_POINTERS}
    params = _params.decode_params(**fields)

    kept = _params.Record(params)
    kept.fill([0 if n == "block_table" else values[n] for n in _params.DECODE_POINTERS])   # (no block table)
    record = kept.view()
    assert all(record[n] == (0 if n == "block_table" else values[n]) for n in names)
    with pytest.raises(TypeError, match="not fields"):
        _params.decode_params(**fields, stray=1)
    with pytest.raises(KeyError):
        _params.decode_params(**{n: x for n, x in fields.items() if n != "splits"})


@pytest.mark.parametrize("scale", [0.125, 1 / 3, 1 / math.sqrt(96), -0.7, 1e-30, 1e-45, 3e38])
def test_the_scale_reaches_the_kernels_as_a_float_and_its_rest(scale):
    """scale * log2(e) as float32 (what the 16-bit kernels multiply by) and the float32
    nearest the rest (float32's second multiply): together within float32's rounding of the rest."""
    exact = scale * math.log2(math.e)
    high, low = _params.scale_log2_parts(scale)
    with np.errstate(over="ignore", invalid="ignore"):   # 3e38: past float32, inf as the kernels had it
        assert high == float(np.float32(exact)) and low == float(np.float32(exact - high))
    if math.isfinite(high):
        assert abs(exact - (high + low)) <= 2.0**-24 * abs(exact - high) + 1e-45


def test_window_sides_reach_every_key_and_fit_an_int():
    """An unbounded (or wider than needed) side becomes the least that reaches every key:
    row i of Nq sees key j < Nk iff i + off - left <= j <= i + off + right (off = Nk - Nq),
    and the kernels' row + off + right + 1 stays below 2**31 for Nq + Nk below it."""
    for nq, nk in ((1, 1), (3, 5), (7, 2), (2**30, 2**30 - 2)):
        left, right = _params.window_sides(None, None, nq, nk)
        off = nk - nq
        assert (nq - 1) + off - left <= 0    # every row's left edge at or before key 0
        assert 0 + off + right >= nk - 1     # every row's right edge at or past the last key
        assert (nq - 1) + off + right + 1 < 2**31
        assert _params.window_sides(5, 0, nq, nk) == (min(5, nk), 0)
        assert _params.window_sides(10**12, 10**12, nq, nk) == (nk, nq)


def _attn_record(nq, nk, left, right, backward=False):
    """The AttnParams (or BwdParams) record of a forward of Nq rows by Nk keys, as built for the kernels."""
    a = np.zeros(1, np.float16)
    x = _checks.AttnInputs(a, a, a, "float16", (1,), nq, nk, 64, 64, 64, left, right, 0.125, (64, 64, 64), (1,),
                           ((0,), (0,), (0,)))
    return (_params.bwd_params(x, 64) if backward else _params.attn_params(x, 64))[0]


def _kernel_sides(record):
    """The sides as kernels/attention/mask.cuh's Band takes them: int(p.window_left), cut to 32 bits."""
    return tuple(int(np.array([record[f]], np.int64).astype(np.int32)[0]) for f in ("window_left", "window_right"))


def _band_sums(nq, nk, left, right):
    """Every sum of mask.cuh's Band (in C's left-to-right order) at its extreme rows and keys."""
    off = nk - nq
    sums = []
    for row in (0, nq - 1):   # allows, apply_row_bounds, cuts, key_range (row_end - 1 = row)
        sums += [(row, off, right, 1), (row, off, -left), (row, 1, off, -left)]
    for key in (0, nk - 1):   # row_range (key_end - 1 = key)
        sums += [(key, -off, -right), (key, -off, left, 1)]
    return sums


def _wraps(terms):
    """Whether a left-to-right sum of ints leaves int32 on the way."""
    total = 0
    for t in terms:
        total += t
        if not -2**31 <= total < 2**31:
            return True
    return False


@pytest.mark.parametrize("nq, nk", [(2**30, 2**30 - 2), (2**31 - 2**20, 2**20 - 1), (1, 2**31 - 2), (2**31 - 2, 1)])
def test_window_sides_sent_to_the_kernels_fit_an_int_near_2_31_rows(nq, nk):
    """Issue 49: unbounded sides once went to the kernels as Nq + Nk, and the Band's
    row + off + right + 1 wrapped past int32 near 2**30 rows. The records built for the
    kernels now hold sides below 2**31 (int(p.window_left) keeps them) with which no sum
    of the Band leaves int32 for Nq + Nk up to 2**31 - 1 (beyond, no side helps: row 0 needs
    right >= Nq - 1, and row Nq - 1 then sums to Nk + Nq - 1), and that still reach every key."""
    huge = (None, 2**31 - 1, nq + nk, 10**12)
    for left, right in [(a, b) for a in huge for b in huge] + [(None, 0), (5, 0), (0, 3)]:
        for backward in (False, True):
            record = _attn_record(nq, nk, left, right, backward)
            k_left, k_right = _kernel_sides(record)
            assert (k_left, k_right) == (int(record["window_left"]), int(record["window_right"])), "cut by int()"
            assert not any(_wraps(s) for s in _band_sums(nq, nk, k_left, k_right)), (left, right)
            off = nk - nq   # a side narrower than the keys as given, else one that reaches every key
            assert k_left == left if left is not None and left < nk else (nq - 1) + off - k_left <= 0
            assert k_right == right if right is not None and right < nq else 0 + off + k_right >= nk - 1


def _band_allows(nq, nk, left, right):
    """Band::allows of mask.cuh over every (row, key) of one sequence, in wrapping int32."""
    i32 = np.int32
    row, col = np.arange(nq, dtype=i32)[:, None], np.arange(nk, dtype=i32)[None, :]
    off, left, right = (np.full((1, 1), v, i32) for v in (nk - nq, left, right))
    return (col < nk) & (col <= row + off + right) & (col >= row + off - left)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 24), st.integers(0, 24)), min_size=1, max_size=3),
       *[st.one_of(st.none(), st.integers(0, 30), st.sampled_from((2**31 - 1, 2**31, 2**32 + 3, 10**12)))] * 2)
def test_window_sides_sent_to_the_kernels_keep_the_reference_mask(lengths, left, right):
    """Small sequences (packed: the record made for the totals, each sequence's band of its own
    lengths) with sides up to 10**12: the kernels' Band, from the record, in int32 as they do
    it, allows exactly what cuflash.reference's mask does."""
    total_q, total_k = sum(n for n, _ in lengths), sum(n for _, n in lengths)
    k_left, k_right = _kernel_sides(_attn_record(total_q, total_k, left, right))
    for nq, nk in lengths:
        np.testing.assert_array_equal(_band_allows(nq, nk, k_left, k_right), _mask.allowed(nq, nk, left, right))


def test_per_stream_memory_keys_tell_streams_and_threads_apart():
    """Kept per-stream memory (the tile counter, split decoding's workspace) is keyed by device
    and stream; the per-thread default stream is a different stream in each host thread, so
    its key holds a token of the thread, which no later thread gets, even one that reuses the
    first one's thread id while work of its stream may still be queued."""
    import threading

    from cuflash import _launch

    per_thread = _launch._PER_THREAD_STREAM
    assert _launch._stream_key(0, 1234) == _launch._stream_key(0, 1234) != _launch._stream_key(1, 1234)
    assert _launch._stream_key(0, per_thread) == _launch._stream_key(0, per_thread)   # one thread: one key
    keys, idents = [], []

    def record():
        keys.append(_launch._stream_key(0, per_thread))
        idents.append(threading.get_ident())

    for _ in range(3):   # one after the other: ids are often reused
        t = threading.Thread(target=record)
        t.start()
        t.join()
    keys.append(_launch._stream_key(0, per_thread))
    assert len(set(keys)) == len(keys), (idents, keys)
    assert all(k[:2] == (0, per_thread) for k in keys)


def test_extended_launch_config_is_cuda_h_layout():
    """cuLaunchKernelEx reads CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out
    (64-bit): the attribute 72 bytes (id, padding to 8, a 64-byte value union), the config 56
    (grid, block, shared bytes, then the stream at 32, the attributes at 40 and their count at
    48). A programmatic launch asks for programmatic stream serialization (id 6, value 1), a
    clustered one for cluster dimensions (id 4, value x, y, z), and one that is both for both;
    the config keeps its attributes alive on its own."""
    import ctypes
    import gc

    from cuflash import _launch

    assert ctypes.sizeof(_launch._LaunchAttribute) == 72
    assert _launch._LaunchAttribute.value.offset == 8
    config_type = _launch._LaunchConfig
    assert ctypes.sizeof(config_type) == 56
    assert (config_type.smem.offset, config_type.stream.offset, config_type.attrs.offset,
            config_type.num_attrs.offset) == (24, 32, 40, 48)
    cases = {(True, 1): [(6, [1, 0, 0])], (False, 4): [(4, [1, 4, 1])], (True, 16): [(6, [1, 0, 0]), (4, [1, 16, 1])]}
    for (programmatic, cluster), expected in cases.items():
        config = _launch._launch_config((3, 16, 7), 128, 1000, programmatic, cluster)
        gc.collect()
        assert (list(config.grid), list(config.block), config.smem, config.num_attrs) == ([3, 16, 7], [128, 1, 1], 1000,
                                                                                         len(expected))
        got = [(config.attrs[i].id, list(config.attrs[i].value[:3])) for i in range(config.num_attrs)]
        assert got == expected
        assert not any(v for i in range(config.num_attrs) for v in config.attrs[i].value[3:])


def test_decode_splits_keep_their_least_keys():
    """Split decoding's plan keeps at least two key blocks per split and, where asked, at least
    min_keys keys; every key lands in exactly one split; a forced count is taken as given."""
    from cuflash import _dispatch

    for longest in (1, 100, 4096, 32768, 131072):
        for block_n in (64, 128):
            for min_keys in (0, 256):
                splits, per_split, cluster = _dispatch.decode_splits(8, longest, None, 132, block_n, 1, min_keys)
                assert cluster == 1
                assert per_split % block_n == 0
                assert (splits - 1) * per_split < max(longest, 1) <= splits * per_split
                if splits > 1:
                    assert per_split >= max(2 * block_n, min_keys)
    # the case the floor is for: 4K keys of pages of 16 rows, 64-key blocks, 8 entries, 2 per SM
    assert _dispatch.decode_splits(8, 4096, None, 264, 64, 4)[1] == 128
    assert _dispatch.decode_splits(8, 4096, None, 264, 64, 4, 256)[1] == 256
    assert _dispatch.decode_splits(8, 4096, 5, 264, 64, 4, 256) == (5, 832, 1)


def test_decode_splits_in_clusters():
    """Where clusters can take the splits (Hopper), the plan weighs, count by count, their merge
    on chip, which costs less than the merge through global memory, against the room clusters
    leave: it never clusters a count the driver finds no room for, and without room for any
    it plans as without clusters. A cluster's size divides the count; with fewer splits per
    cluster than the count, the clusters' parts merge through global memory, which still costs
    less than merging every split there. 8 entries, 64-key blocks, one block per SM."""
    from cuflash import _dispatch

    plain = _dispatch.decode_splits(8, 4096, None, 132, 64, 4)
    assert plain[0] > 8 and plain[2] == 1
    assert _dispatch.decode_splits(8, 4096, None, 132, 64, 4, 0, lambda c, two_level: 0) == plain
    splits, _, cluster = _dispatch.decode_splits(8, 4096, None, 132, 64, 4, 0, lambda c, two_level: 128)
    assert 1 < cluster <= _dispatch.DECODE_MAX_CLUSTER and splits % cluster == 0
    # clusters above 8 find no room: no count clusters past 8
    for longest in (4096, 32768):
        splits, _, cluster = _dispatch.decode_splits(8, longest, None, 132, 64, 4, 0, lambda c, two_level: 128 if c <= 8 else 0)
        assert cluster <= 8 and splits % cluster == 0
    # room for 96 blocks in clusters of 16 and none in smaller: one wave of 128 needs the global merge
    assert _dispatch.decode_splits(8, 32768, 16, 132, 64, 4, 0, lambda c, two_level: 96 if c == 16 else 0)[2] == 1
    # forced counts are taken as given, merged where it costs less: 5 in one cluster, 17 (a
    # prime past the largest cluster) through global memory, 32 in clusters and then there
    assert _dispatch.decode_splits(8, 4096, 5, 132, 64, 4, 0, lambda c, two_level: 128) == (5, 832, 5)
    assert _dispatch.decode_splits(8, 32768, 17, 132, 64, 4, 0, lambda c, two_level: 1024)[::2] == (17, 1)
    splits, _, cluster = _dispatch.decode_splits(8, 32768, 32, 132, 64, 4, 0, lambda c, two_level: 1024)
    assert splits == 32 and 1 < cluster < 32 and 32 % cluster == 0
    # the room asked for is the kernel's that would run: where the two-level kernel finds
    # none, no count takes several clusters per row group
    for longest, forced in ((32768, 32), (32768, None), (131072, None)):
        splits, _, cluster = _dispatch.decode_splits(8, longest, forced, 132, 64, 4, 0,
                                                     lambda c, two_level: 0 if two_level else 1024)
        assert cluster in (1, splits)


def test_decode_splits_count_blocks_that_share_a_multiprocessor():
    """Blocks two to a multiprocessor share its reading: the plan counts a wave that doubles up
    as slower per block, not as free. 64 row groups of 4K keys over pages read run by run, two
    blocks per SM fitting (264 slots on 132 SMs), clusters of one block per SM: counted as free,
    4 splits through global memory win; counted as shared, 2 splits merged in clusters."""
    from cuflash import _dispatch

    def room(c, two_level):
        return 128

    assert _dispatch.decode_splits(64, 4096, None, 264, 128, 4, 256, room) == (4, 1024, 1)
    assert _dispatch.decode_splits(64, 4096, None, 264, 128, 4, 256, room, 132) == (2, 2048, 2)
    # one block per SM (132 slots): nothing shares, nothing changes
    for longest in (4096, 32768):
        assert _dispatch.decode_splits(8, longest, None, 132, 64, 4, 0, room, 132) == \
            _dispatch.decode_splits(8, longest, None, 132, 64, 4, 0, room)
