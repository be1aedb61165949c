"""Argument errors that need no GPU (CuPy installed or not)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GPU_MISSING, requires_gpu

import cuflash
from cuflash import _checks


@requires_gpu
def test_numpy_input_says_how_to_convert():
    q = np.ones((4, 8), dtype=np.float16)
    with pytest.raises(TypeError, match=r"q must be a cupy.ndarray.*cupy.asarray\(q\)"):
        cuflash.attention(q, q, q)


@pytest.mark.skipif(GPU_MISSING is None, reason="a GPU is present")
def test_without_gpu_says_what_is_missing():
    pytest.importorskip("cupy")
    q = np.ones((4, 8), dtype=np.float16)
    with pytest.raises(RuntimeError, match="need an NVIDIA GPU.*cuflash.reference"):
        cuflash.attention(q, q, q)


def test_without_cupy_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now raises ImportError
    q = np.ones((4, 8), dtype=np.float16)
    with pytest.raises(ImportError, match=r"need CuPy: pip install 'cuflash\[cuda12\]'"):
        cuflash.attention(q, q, q)
    assert cuflash.reference.attention(q, q, q).shape == (4, 8)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((8,), (4, 8), (4, 8)), "q must have at least 2 dims"),
        (((4, 8), (4, 16), (4, 8)), "same head dim"),
        (((4, 8), (4, 8), (5, 8)), "same number of keys"),
        (((2, 4, 8), (3, 4, 8), (3, 4, 8)), "must broadcast"),
    ],
)
def test_shape_errors(shapes, match):
    with pytest.raises(ValueError, match=match):
        _checks.check_shapes(*shapes)


def test_broadcast_batch_shape():
    assert _checks.check_shapes((2, 3, 4, 5, 8), (2, 3, 1, 7, 8), (3, 1, 7, 16)) == (2, 3, 4)


@pytest.mark.parametrize("d", [4, 12, 264, 512])
def test_unsupported_head_dim(d):
    with pytest.raises(ValueError, match=f"head dim.* {d}"):
        _checks.check_head_dim("q", "head dim (last axis)", d)


@pytest.mark.parametrize("scale, exc", [(float("nan"), ValueError), (float("inf"), ValueError), ("1", TypeError), (True, TypeError)])
def test_bad_scale(scale, exc):
    with pytest.raises(exc, match="scale"):
        _checks.check_scale(scale, 64)


def test_default_scale():
    assert _checks.check_scale(None, 64) == 0.125
