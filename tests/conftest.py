"""Shared test machinery: the GPU skip marker, poisoned allocations, the accuracy criterion."""

from __future__ import annotations

import contextlib
import functools
import os
import re

import numpy as np
import pytest

from cuflash import _gpu


def pytest_report_header(config):
    import cuflash

    where = os.path.dirname(cuflash.__file__)
    return f"cuflash {cuflash.__version__} from {where}; GPU tests: {'run' if GPU_MISSING is None else 'skipped'}"


# Why the GPU tests cannot run here (no CuPy, no driver, no GPU...), or None: the same
# sentence cuflash's own errors give.
GPU_MISSING = _gpu.problem()
requires_gpu = pytest.mark.skipif(GPU_MISSING is not None, reason=f"needs a CUDA GPU: {GPU_MISSING}")


@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation inside is filled with 0xFF bytes (NaN in every float dtype),
    so an output element a kernel fails to write shows up as NaN."""
    import cupy

    pool = cupy.get_default_memory_pool()

    def malloc(size):
        mem = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(malloc)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(pool.malloc)


def random_array(rng, shape, dtype, scale=1.0):
    """Standard-normal CuPy array of `dtype`, times `scale` (drawn in float32, then cast)."""
    import cupy

    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(dtype)


def eps(dtype) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(dtype).eps)


def assert_close_to_reference(name, result, naive, ref, dtype, c, term_scale=0.0):
    """The accuracy criterion (docs/contract.md): max|result - ref| <= c * max|naive - ref| + atol,
    atol a few ulps.

    The ulps are taken at unit scale, or at the scale of the result, or at `term_scale`, the
    size of intermediate terms that cancel in the result, whichever is largest.
    """
    result = np.asarray(result, dtype=np.float64)
    naive = np.asarray(naive, dtype=np.float64)
    assert result.shape == ref.shape, f"{name}: shape {result.shape} != {ref.shape}"
    assert np.isfinite(result).all(), f"{name}: {np.count_nonzero(~np.isfinite(result))} non-finite elements"
    if ref.size == 0:
        return
    err = np.abs(result - ref).max()
    naive_err = np.abs(naive - ref).max()
    atol = 4 * eps(dtype) * max(1.0, np.abs(ref).max(), term_scale)
    assert err <= c * naive_err + atol, (
        f"{name}: max error {err:.3g} > {c} x naive error {naive_err:.3g} + atol {atol:.3g}"
    )


def finite_difference(loss, x, h):
    """Central differences of ``loss()`` at every element of the array ``x`` (changed in place
    and restored); the step actually taken is what ``x``'s dtype holds, so float32 works too."""
    grad = np.zeros(x.shape)
    for idx in np.ndindex(*x.shape):
        orig = x[idx]
        x[idx] = orig + h
        up, hi = loss(), float(x[idx])
        x[idx] = orig - h
        down, lo = loss(), float(x[idx])
        x[idx] = orig
        grad[idx] = (up - down) / (hi - lo)
    return grad


def assert_lse_close(lse, ref_lse):
    lse = np.asarray(lse, dtype=np.float64)
    assert lse.shape == ref_lse.shape
    finite = np.isfinite(ref_lse)
    assert np.array_equal(lse[~finite], ref_lse[~finite]), "lse must be -inf exactly on rows that see no key"
    assert np.isfinite(lse[finite]).all(), "lse is not finite on a row that sees keys"
    if finite.any():
        assert np.abs(lse[finite] - ref_lse[finite]).max() <= 1e-3


# One thread spinning on the SM clock: keeps a stream busy for a known time, so that a test
# can tell whether later work was ordered after it on the same stream.
_SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""


@functools.cache
def _spin_kernel():
    import cupy

    return cupy.RawKernel(_SPIN_SOURCE, "spin")


def spin(seconds: float) -> None:
    """Enqueues a kernel that keeps CuPy's current stream busy for about `seconds`."""
    import cupy

    runtime = cupy.cuda.runtime
    dev = cupy.cuda.Device().id
    khz = runtime.getDeviceProperties(dev).get("clockRate", 0)
    if not khz:  # CUDA 13 dropped clockRate from the properties; the attribute replaces it
        try:
            khz = runtime.deviceGetAttribute(runtime.cudaDevAttrClockRate, dev)
        except runtime.CUDARuntimeError:
            khz = 0
    cycles = int(seconds * (int(khz) or 2_000_000) * 1e3)
    _spin_kernel()((1,), (1,), (np.int64(cycles),))



@pytest.fixture(scope="session", autouse=True)
def every_kernel_launched_is_checked_in_ci():
    """After a GPU run: each kernel the tests launched is one CI compiles with --werror
    (tools/check_kernels.py: the library's specializations and the tuning candidates). A kernel
    with a call's own score and mask functions (that add the gradients of its arrays or not) counts
    as its twin whose tiles it takes, FullScores (the decoding kernel: ModifiedScores, the cache's
    other modified path); CI compiles such kernels after sample functions: test_trace.py."""
    if GPU_MISSING is not None:
        yield
        return
    from cuflash import _compile, _tiles

    launched = set()
    get_function = _compile.get_function

    def recording(name_expression, smem_bytes, user=None):
        twin = _tiles.MODIFIED if name_expression.startswith("cuflash::attn_decode") else _tiles.FULL
        launched.add(re.sub(r"cuflash::UserScores<\w+(, \w+)?>", _tiles.SCORE_PATHS[twin], name_expression))
        return get_function(name_expression, smem_bytes, user)

    _compile.get_function = recording
    try:
        yield
    finally:
        _compile.get_function = get_function
    arch = _compile.current_arch()
    checked = set(_tiles.all_specializations(arch)) | set(_tiles.candidate_specializations(arch))
    unchecked = sorted(launched - checked)
    assert not unchecked, f"kernels launched that CI does not compile: {unchecked}"
