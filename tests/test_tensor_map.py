"""Tensor maps for the bulk tensor copy engine: the host's checks of a map (CPU), and on
a Hopper GPU a box copied through a driver-encoded map, against the swizzled layout
computed in NumPy and against the same tile loaded by cp.async (kernels/arch/tma.cuh)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from conftest import GPU_MISSING, random_array

from cuflash import _launch, _tensor_map, _tiles
from cuflash._tensor_map import TileMap


def valid_map(**change) -> TileMap:
    fields = dict(dtype_name="float16", address=1 << 20, dims=(128, 100, 3), strides=(256, 256 * 100),
                  box=(64, 64, 1), swizzle=128)
    fields.update(change)
    return TileMap(**fields)


def test_a_valid_map_passes_the_checks():
    valid_map().check()
    valid_map(dtype_name="float32", box=(32, 64, 1)).check()
    valid_map(swizzle=0, box=(128, 64, 1)).check()


@pytest.mark.parametrize("change, words", [
    ({"dtype_name": "int8"}, "take"),
    ({"address": (1 << 20) + 8}, "16-byte aligned"),
    ({"strides": (200, 256 * 100)}, "multiples of 16"),
    ({"strides": (256,)}, "a stride per dim"),
    ({"box": (64, 257, 1)}, "1 to 256"),
    ({"box": (128, 64, 1)}, "does not fit a 128-byte swizzle"),
    ({"box": (4, 64, 1)}, "multiple of 16 bytes"),
    ({"dims": (128, 0, 3)}, "dims must be"),
    ({"swizzle": 256}, "swizzle spans"),
])
def test_the_checks_refuse_what_the_driver_would(change, words):
    with pytest.raises(ValueError, match=words):
        valid_map(**change).check()


# A kernel of the test alone, compiled with the library's headers: one block copies the box
# at (row0, entry) of a (entries, n, d) float16 tensor twice, through the map and by cp.async
# into PanelTile, and writes both tiles out as they lie in shared memory.
TEST_SOURCE = r"""
struct TmaCopyParams {
    cuflash::TensorMap map;
    const unsigned short* src;
    unsigned short* out;
    long long row_stride, entry_stride;
    int entry, row0, rows_valid, cols;
};

template <int ROWS, int COLS>
__global__ void __launch_bounds__(128) tma_copy_tile(const __grid_constant__ TmaCopyParams p) {
    using namespace cuflash;
    using Tile = PanelTile<unsigned short, ROWS, COLS>;
    extern __shared__ unsigned char smem[];
    const u32 base = (smem_address(smem) + 1023u) & ~1023u;   // the 128-byte swizzle's atoms
    const u32 s_tma = base, s_ref = base + Tile::BYTES, s_bar = base + 2 * Tile::BYTES;
    if (threadIdx.x == 0) {
        mbarrier_init(s_bar, 1);
        mbarrier_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        tma_prefetch(p.map);
        mbarrier_arrive_expect_bytes(s_bar, Tile::BYTES);
        for (int panel = 0; panel < COLS / 64; ++panel)
            tma_load(s_tma + panel * Tile::PANEL_BYTES, p.map, s_bar, panel * 64, p.row0, p.entry);
    }
    load_tile_async<Tile, 128>(s_ref, p.src + p.entry * p.entry_stride + p.row0 * p.row_stride, p.row_stride,
                               p.rows_valid, p.cols);
    cp_async_commit();
    cp_async_wait<0>();
    mbarrier_wait(s_bar, 0);
    __syncthreads();
    const unsigned char* tiles = smem + (base - smem_address(smem));
    for (int i = threadIdx.x; i < 2 * Tile::BYTES / 4; i += blockDim.x)
        reinterpret_cast<u32*>(p.out)[i] = reinterpret_cast<const u32*>(tiles)[i];
}
"""


def panel_layout(tile: np.ndarray) -> np.ndarray:
    """A (rows, cols) float16 tile as PanelTile stores it, as uint16: 64-column panels of
    128-byte rows, chunk c of row r at chunk c ^ (r % 8)."""
    rows, cols = tile.shape
    out = np.zeros((cols // 64, rows, 8, 8), dtype=np.uint16)
    bits = tile.view(np.uint16).reshape(rows, cols // 64, 8, 8)
    for r in range(rows):
        for c in range(8):
            out[:, r, c ^ (r % 8)] = bits[r, :, c]
    return out.reshape(-1)


def sm90_or_skip():
    if GPU_MISSING is not None:
        pytest.skip(f"needs a CUDA GPU: {GPU_MISSING}")
    from cuflash import _compile

    if _compile.current_arch() != "sm_90a":
        pytest.skip("the bulk tensor copy engine needs a Hopper GPU with an sm_90a build")


@pytest.mark.parametrize("d, cols", [(64, 64), (128, 128), (96, 128)])
@pytest.mark.parametrize("row0", [0, 64])
@pytest.mark.parametrize("strided", [False, True])
def test_a_box_through_the_map_lands_as_panel_tile(d, cols, row0, strided):
    sm90_or_skip()
    import cupy
    from cupy_backends.cuda.api import driver

    from cuflash import _compile

    entries, n, rows = 3, 100, 64
    rng = np.random.default_rng(d + row0 + strided)
    wide = random_array(rng, (entries, n, d + 40 if strided else d), "float16")
    x = wide[..., :d]   # a strided view when wider: rows 2 * (d + 40) bytes apart
    row_stride, entry_stride = x.strides[1] // 2, x.strides[0] // 2
    tile = TileMap("float16", x.data.ptr, (d, n, entries), (x.strides[1], x.strides[0]), (64, rows, 1), 128)
    encoded = _tensor_map.encode(tile)
    assert len(encoded) == _tensor_map.MAP_BYTES

    module = cupy.RawModule(code=_compile.kernel_source() + TEST_SOURCE,
                            options=_compile._module_options(_compile.current_arch()),
                            name_expressions=(f"tma_copy_tile<{rows}, {cols}>",))
    fn = module.get_function(f"tma_copy_tile<{rows}, {cols}>")
    tile_bytes = rows * cols * 2
    smem = 2 * tile_bytes + 1024 + 64
    fn.max_dynamic_shared_size_bytes = smem
    out = cupy.full(tile_bytes, 0xFFFF, dtype=cupy.uint16)   # poisoned: two tiles of uint16
    entry, rows_valid = 2, min(rows, n - row0)
    storage = np.zeros(192 // 8 + 8, dtype=np.uint64)   # TmaCopyParams (192 bytes), 64-byte aligned in it
    start = (-storage.ctypes.data % 64) // 8
    body = storage[start:start + 192 // 8].view(np.uint8)
    body[:128] = np.frombuffer(encoded, dtype=np.uint8)
    body[128:176].view(np.uint64)[:] = (x.data.ptr, out.data.ptr, row_stride, entry_stride, 0, 0)
    body[160:176].view(np.int32)[:] = (entry, row0, rows_valid, d)
    kernel_params = np.array([body.ctypes.data], dtype=np.uint64)   # (void **) for cuLaunchKernel
    driver.launchKernel(fn.kernel.ptr, 1, 1, 1, 128, 1, 1, smem, cupy.cuda.get_current_stream().ptr,
                        kernel_params.ctypes.data, 0)
    got = cupy.asnumpy(out).reshape(2, -1)

    box = np.zeros((rows, cols), dtype=np.float16)
    box[:rows_valid, :d] = cupy.asnumpy(x[entry, row0:row0 + rows_valid])
    expected = panel_layout(box)
    np.testing.assert_array_equal(got[0], expected)   # through the map (zeros past the rows and columns)
    np.testing.assert_array_equal(got[1], expected)   # by cp.async, for the same layout


# The forward's maps (_tensor_map.attention_maps), on the CPU: each map must address, for
# every batch entry, the element the kernel's own strides do (attn_fwd_sm90_ws.cuh: MapEntry).

def layout_of(q, k, v, packed=None):
    """What attention_maps reads of _checks.AttnInputs, from NumPy arrays as the checks lay them out."""
    from types import SimpleNamespace

    from cuflash import _checks

    batch_shape = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    shape, strides = _checks.kernel_batch_layout(batch_shape, (q, k, v))
    return SimpleNamespace(
        packed=packed, dtype_name=q.dtype.name, kernel_batch_shape=shape, kernel_batch_strides=strides,
        row_strides=tuple(x.strides[-2] // x.itemsize for x in (q, k, v)), d=q.shape[-1], dv=v.shape[-1],
        nq=q.shape[-2], nk=k.shape[-2], batch_size=int(np.prod(batch_shape)))


def entry_coordinates(shape, b):
    """MapEntry's indices of flat entry b over a padded batch shape, innermost first."""
    idx = []
    for n in reversed(shape):
        idx.append(b % n)
        b //= n
    return idx


LAYOUTS = {
    "contiguous": lambda: [np.zeros((2, 3, 100, 64), np.float16) for _ in range(3)],
    "(B, N, H, D) transposed": lambda: [np.zeros((2, 100, 3, 128), np.float16).transpose(0, 2, 1, 3)
                                        for _ in range(3)],
    "grouped K/V heads": lambda: [np.zeros((2, 4, 3, 50, 64), np.float16), np.zeros((2, 4, 1, 70, 64), np.float16),
                                  np.zeros((2, 4, 1, 70, 64), np.float16)],
    "K/V broadcast over the batch": lambda: [np.zeros((5, 2, 30, 64), np.float16), np.zeros((2, 40, 64), np.float16),
                                             np.zeros((2, 40, 64), np.float16)],
    "one problem": lambda: [np.zeros((300, 96), np.float16) for _ in range(3)],
    "strided rows": lambda: [np.zeros((2, 3, 100, 200), np.float16)[..., :128] for _ in range(3)],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_forward_maps_address_what_the_kernel_strides_do(name):
    q, k, v = LAYOUTS[name]()
    x = layout_of(q, k, v)
    maps = _tensor_map.attention_maps(x, 128, 128)
    assert maps is not None
    shape = maps.layout.shape
    assert len(shape) == _tensor_map.MAP_BATCH_DIMS and int(np.prod(shape)) == x.batch_size
    for tile, array, st, rows in zip(maps.maps, (q, k, v), maps.layout.strides, (x.nq, x.nk, x.nk)):
        assert tile.dims[:2] == (array.shape[-1], rows)
        assert tile.strides[0] == array.strides[-2]
        assert tile.box == (64, 128, 1, 1, 1)
        for b in range(x.batch_size):
            idx = entry_coordinates(shape, b)
            coords = [i if s else 0 for i, s in zip(idx, reversed(st))]
            assert all(0 <= c < n for c, n in zip(coords, tile.dims[2:]))
            through_map = sum(c * s for c, s in zip(coords, tile.strides[1:]))
            by_strides = sum(i * s for i, s in zip(idx, reversed(st))) * array.itemsize
            assert through_map == by_strides, (name, b)


def test_no_forward_maps_where_a_map_cannot_describe_the_inputs():
    q = k = v = np.zeros((2, 3, 100, 64), np.float16)
    assert _tensor_map.attention_maps(layout_of(q, k, v, packed=object()), 128, 128) is None
    f32 = np.zeros((2, 3, 100, 64), np.float32)
    assert _tensor_map.attention_maps(layout_of(f32, f32, f32), 128, 128) is None
    # four batch dims that do not merge: each a part of a wider one
    four = np.zeros((2, 3, 3, 3, 40, 64), np.float16)[:, :2, :2, :2]
    x = layout_of(four, four, four)
    assert len(x.kernel_batch_shape) > _tensor_map.MAP_BATCH_DIMS
    assert _tensor_map.attention_maps(x, 128, 128) is None


def test_the_ws_record_holds_the_maps_after_attn_params():
    from cuflash import _params

    dtype = _params.WS_PARAMS_DTYPE
    assert dtype.fields["q_map"][1] == _params.WS_MAPS_OFFSET and _params.WS_MAPS_OFFSET % 64 == 0
    assert _params.WS_MAPS_OFFSET >= _params.PARAMS_DTYPE.itemsize
    # then the tile counter's pointer, the record padded to the maps' 64-byte alignment
    assert dtype.fields["tile_counter"][1] == _params.WS_COUNTER_OFFSET == _params.WS_MAPS_OFFSET + 3 * _params.MAP_BYTES
    assert dtype.itemsize == -(-(_params.WS_COUNTER_OFFSET + 8) // 64) * 64
    for name in _params.PARAMS_DTYPE.names:   # AttnParams first, field for field
        assert dtype.fields[name][1] == _params.PARAMS_DTYPE.fields[name][1]
    record = _params.Record(np.zeros(1, dtype=dtype))
    maps = bytes(range(256)) + bytes(range(128))
    record.write(_params.WS_MAPS_OFFSET, maps)
    pointers = [0x1000 * (i + 1) for i in range(len(_launch.WS_FWD_FIELDS))]
    record.fill(pointers)
    view = record.view()
    assert bytes(view["q_map"]) + bytes(view["k_map"]) + bytes(view["v_map"]) == maps
    assert [int(view[name]) for name in _params.PARAMS_DTYPE.names[:_params.FWD_POINTERS]] == pointers[:-1]
    assert int(view["tile_counter"]) == pointers[-1]
    assert view["nq"] == 0 and record.buffer[0] == record.kernel_params + 8


def test_the_maps_are_encoded_once_per_address_triple(monkeypatch):
    calls = []

    def fake_encode(tile):
        calls.append(tile.address)
        return tile.address.to_bytes(8, "little") * 16

    monkeypatch.setattr(_tensor_map, "encode", fake_encode)
    q = k = v = np.zeros((2, 3, 100, 64), np.float16)
    maps = _tensor_map.attention_maps(layout_of(q, k, v), 128, 128)
    first = maps.encoded(16, 32, 48)
    assert calls == [16, 32, 48] and len(first) == 3 * _tensor_map.MAP_BYTES
    assert maps.encoded(16, 32, 48) == first and calls == [16, 32, 48]   # kept
    for i in range(_tensor_map.KEPT_ADDRESSES):
        maps.encoded(1 << 20, 16 * (i + 1), 48)
    assert len(maps.kept) == _tensor_map.KEPT_ADDRESSES and (16, 32, 48) not in maps.kept   # the oldest went first


def gpu_layout(name, dtype, d, rng):
    """q, k, v on the GPU in one of the forward's layouts, random, ragged row counts."""
    nq, nk = 300, 333
    if name == "contiguous":
        return [random_array(rng, (2, 3, n, d), dtype) for n in (nq, nk, nk)]
    if name == "(B, N, H, D) transposed":
        return [random_array(rng, (2, n, 3, d), dtype).transpose(0, 2, 1, 3) for n in (nq, nk, nk)]
    if name == "grouped K/V heads":
        return [random_array(rng, (2, 2, 3, nq, d), dtype)] + [random_array(rng, (2, 2, 1, nk, d), dtype) for _ in "kv"]
    if name == "strided rows":
        return [random_array(rng, (2, 3, n, d + 64), dtype)[..., :d] for n in (nq, nk, nk)]
    if name == "four batch dims":   # not mergeable: the cp.async loader
        return [random_array(rng, (2, 3, 3, 3, n, d), dtype)[:, :2, :2, :2] for n in (nq, nk, nk)]
    raise ValueError(name)


@pytest.mark.parametrize("name", ["contiguous", "(B, N, H, D) transposed", "grouped K/V heads", "strided rows",
                                  "four batch dims"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_the_loading_warpgroup_forward_through_maps(name, dtype, d, causal):
    """The forward where tensor maps describe the inputs loads through them (and by cp.async
    where they do not), and both match the reference."""
    sm90_or_skip()
    import cupy
    from conftest import assert_close_to_reference, assert_lse_close, poisoned_allocations

    import cuflash
    from cuflash import _plans, _tiles, naive, reference

    rng = np.random.default_rng(d + causal + len(name))
    q, k, v = gpu_layout(name, dtype, d, rng)
    q = q * 4   # large logits
    plan, _ = _plans.forward(q, k, v, causal, None, None)
    (main,) = [r for r in plan.launches.runs if hasattr(r, "maps")]
    ws = _tiles.sm90_ws_fwd_tiles(dtype, _tiles.head_dim_bucket(d, d), 333) is not None
    assert (main.maps is not None) == (ws and name != "four batch dims")
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    again = cuflash.attention(q, k, v, causal=causal)   # the plan kept, the maps kept for these addresses
    n_out, _ = naive.attention(q, k, v, causal=causal, return_lse=True)
    r_out, r_lse = reference.attention(*(cupy.asnumpy(x) for x in (q, k, v)), causal=causal, return_lse=True)
    assert_close_to_reference("out", cupy.asnumpy(out), cupy.asnumpy(n_out), r_out, dtype, c=2)
    assert_lse_close(cupy.asnumpy(lse), r_lse)
    assert bool((again == out).all())   # deterministic, through the kept maps


@contextlib.contextmanager
def forced_ws_tiles(monkeypatch, tiles, loader):
    """Forwards inside run the loading-warpgroup kernel on `tiles`, loading through tensor maps
    ("tma") or by cp.async; the launch plans made with them are dropped on the way out."""
    from cuflash import _dispatch, _plans

    monkeypatch.setattr(_dispatch, "hopper_fwd_tiles", lambda *args: tiles)
    if loader == "cp.async":
        monkeypatch.setattr(_tensor_map, "attention_maps", lambda *args: None)
    _plans.clear()
    try:
        yield
    finally:
        _plans.clear()


# (head dim, tiles, loader): the tuner's loading-warpgroup candidates by each loader they take,
# and the head-dim-256 ones at head dim 200 too (zero-filled columns)
WS_VARIANTS = [(d, tiles, "tma" if tma else "cp.async")
               for d in (64, 128, 256, 200)
               for tiles in _tiles.SM90_WS_FWD_CANDIDATES[_tiles.head_dim_bucket(d, d)]
               for tma in _tiles.ws_fwd_loaders(tiles)]


@pytest.mark.parametrize("d, tiles, loader", WS_VARIANTS)
@pytest.mark.parametrize("causal", [False, True])
def test_the_loading_warpgroup_variants_match_the_reference(monkeypatch, d, tiles, loader, causal):
    """The shapes bench/tune_tiles.py may time (one Q buffer and 64- or 80-key blocks at head
    dim 256, 176-key blocks at 128, three computing warpgroups and two or three K/V stages at
    64), by either loader where it fits, on a problem of more tiles than blocks."""
    sm90_or_skip()
    import cupy
    from conftest import assert_close_to_reference, assert_lse_close, poisoned_allocations

    import cuflash
    from cuflash import _plans, naive, reference

    with forced_ws_tiles(monkeypatch, tiles, loader):
        rng = np.random.default_rng(d + 7 * tiles.block_n + 3 * tiles.stages + causal)
        nq = 700 if tiles.consumers == 2 else 1000   # 192 tiles either way: blocks run two in turn
        q, k, v = (random_array(rng, (4, 8, n, d), "bfloat16") for n in (nq, 650, 650))
        q = q * 4
        with poisoned_allocations():
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        (main,) = [r for r in _plans.forward(q, k, v, causal, None, None)[0].launches.runs if hasattr(r, "maps")]
        assert (main.maps is not None) == (loader == "tma")
    n_out, _ = naive.attention(q, k, v, causal=causal, return_lse=True)
    r_out, r_lse = reference.attention(*(cupy.asnumpy(x) for x in (q, k, v)), causal=causal, return_lse=True)
    assert_close_to_reference("out", cupy.asnumpy(out), cupy.asnumpy(n_out), r_out, "bfloat16", c=2)
    assert_lse_close(cupy.asnumpy(lse), r_lse)


# (d, block_n, q_buffers, consumers, loader): the loading-warpgroup forward's shapes, each block
# running tiles in turn
TURN_VARIANTS = [(128, 128, 2, 2, "tma"), (128, 176, 1, 2, "tma"), (64, 128, 2, 2, "tma"),
                 (128, 128, 2, 2, "cp.async"), (64, 128, 2, 3, "tma")]


@pytest.mark.parametrize("d, block_n, q_buffers, consumers, loader", TURN_VARIANTS)
def test_blocks_running_tiles_in_turn_past_tiles_without_keys(monkeypatch, d, block_n, q_buffers, consumers,
                                                               loader):
    """A block runs tile after tile, some of them tiles whose rows see no key (1300 queries
    against 400 keys under a causal mask: the first 900 rows), between and after tiles with
    keys. Every row matches the reference, the keyless ones with out exactly 0 and lse
    exactly -inf."""
    sm90_or_skip()
    import cupy
    from conftest import assert_close_to_reference, assert_lse_close, poisoned_allocations

    import cuflash
    from cuflash import _tiles, naive, reference

    tiles = _tiles.Sm90WsFwdTiles(d, block_n, 2, q_buffers=q_buffers, consumers=consumers)
    with forced_ws_tiles(monkeypatch, tiles, loader):
        rng = np.random.default_rng(d + block_n + consumers)
        q, k, v = (random_array(rng, (4, 8, n, d), "float16") for n in (1300, 400, 400))
        with poisoned_allocations():
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    out, lse = cupy.asnumpy(out), cupy.asnumpy(lse)
    assert np.all(out[:, :, :900] == 0) and np.all(lse[:, :, :900] == -np.inf)
    n_out, _ = naive.attention(q, k, v, causal=True, return_lse=True)
    r_out, r_lse = reference.attention(*(cupy.asnumpy(x) for x in (q, k, v)), causal=True, return_lse=True)
    assert_close_to_reference("out", out, cupy.asnumpy(n_out), r_out, "float16", c=2)
    assert_lse_close(lse, r_lse)


# (causal, window, keys, the key block picked)
D128_DEFAULTS = [(True, None, 8300, 176), (True, None, 8000, 128), (False, None, 2100, 176), (False, None, 2000, 128),
                 (False, (4000, 100), 8300, 128)]


@pytest.mark.parametrize("causal, window, keys, block_n", D128_DEFAULTS)
def test_the_defaults_at_head_dim_128_by_mask_and_keys(causal, window, keys, block_n):
    """At head dim 128 a forward takes 176-key blocks with one Q buffer through maps without
    a mask from 2048 keys per tile and under a causal mask from 8192 (a windowed one keeps
    128-key blocks and two Q buffers), and matches the reference either way."""
    sm90_or_skip()
    import cupy
    from conftest import assert_close_to_reference, assert_lse_close, poisoned_allocations

    import cuflash
    from cuflash import _plans, _tiles, naive, reference

    _plans.clear()
    rng = np.random.default_rng(keys + causal)
    q, k, v = (random_array(rng, (1, 2, n, 128), "float16") for n in (300, keys, keys))
    q = q * 4
    with poisoned_allocations():
        out, lse = cuflash.attention(q, k, v, causal=causal, window=window, return_lse=True)
    (main,) = [r for r in _plans.forward(q, k, v, causal, window, None)[0].launches.runs if hasattr(r, "maps")]
    picked = _tiles.Sm90WsFwdTiles(128, block_n, 2, q_buffers=1 if block_n == 176 else 2)
    assert main.maps is not None and main.smem == picked.smem_bytes(2)
    n_out, _ = naive.attention(q, k, v, causal=causal, window=window, return_lse=True)
    r_out, r_lse = reference.attention(*(cupy.asnumpy(x) for x in (q, k, v)), causal=causal, window=window,
                                       return_lse=True)
    assert_close_to_reference("out", cupy.asnumpy(out), cupy.asnumpy(n_out), r_out, "float16", c=2)
    assert_lse_close(cupy.asnumpy(lse), r_lse)
