"""Tensor maps for the bulk tensor copy engine: the host's checks of a map (CPU), and on
a Hopper GPU a box copied through a driver-encoded map, against the swizzled layout
computed in NumPy and against the same tile loaded by cp.async (kernels/arch/tma.cuh)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GPU_MISSING, random_array

from cuflash import _tensor_map
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
