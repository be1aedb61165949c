"""cuflash.block_mask: a mask function's tiles classified on the GPU, tile for tile as
cuflash.reference.block_mask classifies them; its argument checks, which need no GPU."""

import os
import re
import sys

import numpy as np
import pytest
from conftest import requires_gpu

import cuflash
from cuflash import reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import score_functions as gallery  # noqa: E402


@pytest.mark.parametrize("block_mask", [cuflash.block_mask, reference.block_mask], ids=["gpu", "reference"])
@pytest.mark.parametrize("args, name", [
    (((2, 3), -1, 8), "nq"), (((2, 3), 8, 2.0), "nk"), (((2, True), 8, 8), "batch_shape[1]"),
    (((2, -3), 8, 8), "batch_shape[1]"),
])
def test_bad_sizes_raise_value_error_naming_them(block_mask, args, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        block_mask(gallery.causal(), *args)


@pytest.mark.parametrize("block_mask", [cuflash.block_mask, reference.block_mask], ids=["gpu", "reference"])
@pytest.mark.parametrize("block", [(0, 4), (4,), (4, 4, 4), 128, (4, None)])
def test_bad_blocks_raise_value_error(block_mask, block):
    with pytest.raises(ValueError, match="block"):
        block_mask(gallery.causal(), (2,), 8, 8, block=block)


def test_a_function_it_cannot_trace_raises_type_error_before_any_gpu_work():
    def branches(q, k):
        return q >= k if q > 3 else q < k   # Python `if` on a traced value

    with pytest.raises(TypeError, match="if"):
        cuflash.block_mask(branches, (), 8, 8)


def masks(cupy, batch, n, rng):
    """Gallery masks and one that reads a head index, with CuPy arrays captured where they read one."""
    docs = np.sort(rng.integers(0, 5, (batch[0], n)), axis=-1).astype(np.int32)
    prefixes = rng.integers(0, n + 1, batch[0]).astype(np.int32)
    return {
        "causal": gallery.causal(),
        "causal, offset": gallery.causal(offset=-17),
        "sliding window": gallery.sliding_window(37),
        "global tokens": gallery.sliding_window_with_global_tokens(20, 3),
        "prefix-LM": gallery.prefix_lm(cupy.asarray(prefixes)),
        "document": gallery.document(cupy.asarray(docs)),
        "document, both ways": gallery.document(cupy.asarray(docs), causal=False),
        "even heads see all": lambda b, h, q, k: (h % 2 == 0) | (q >= k),
        "nothing": lambda b, h, q, k: q < 0,
    }


@requires_gpu
@pytest.mark.parametrize("nq, nk, block", [
    (300, 257, (128, 128)),   # ragged last tiles
    (1, 1000, (64, 32)),
    (777, 333, (16, 64)),
    (2048, 2048, (8, 16)),    # 2 x 3 x 256 x 128 tiles: the grid strides
    (0, 5, (128, 128)),
])
def test_kinds_equal_the_reference(nq, nk, block):
    import cupy

    rng = np.random.default_rng(nq + nk)
    batch = (2, 3)
    shape = batch + (-(-nq // block[0]), -(-nk // block[1]))
    for name, mask_mod in masks(cupy, batch, max(nq, nk), rng).items():
        poison = cupy.full(shape, 77, dtype=cupy.int8)   # the pool hands this memory out next
        del poison
        got = cuflash.block_mask(mask_mod, batch, nq, nk, block=block)
        want = reference.block_mask(mask_mod, batch, nq, nk, block=block)
        assert isinstance(got.kinds, cupy.ndarray) and got.kinds.dtype == cupy.int8, name
        assert (got.block, got.shape) == (want.block, want.shape) == (block, (nq, nk)), name
        np.testing.assert_array_equal(got.kinds.get(), want.kinds, err_msg=name)


@requires_gpu
def test_a_captured_numpy_array_raises_type_error_naming_it():
    docs = np.zeros((1, 64), dtype=np.int32)
    with pytest.raises(TypeError, match="NumPy array"):
        cuflash.block_mask(gallery.document(docs), (1, 2), 64, 64)
