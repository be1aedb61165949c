"""The kernels' host-and-device math on the host compiler, against cuflash.reference.

No GPU and no CuPy needed: kernels/attention/dropout.cuh's keep function (per element, and the
one or two Philox calls for a thread's 8 elements of a 16 x 16 fragment tile, queries or keys
in its rows) must equal cuflash.reference.dropout_keep bit for bit, over random seeds (all 64
bits), batch entries past 2**32, positions and dropout probabilities.
"""

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import _compile, reference

CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++, c++ or clang++) on PATH")

SHIM = r"""
#include "dropout.cuh"
using cuflash::Dropout;

static Dropout make(unsigned long long seed, unsigned threshold) {
    return Dropout{unsigned(seed), unsigned(seed >> 32), threshold, 1.f};
}
extern "C" void keep(unsigned long long seed, unsigned threshold, long long count, const unsigned long long* n,
                     const long long* i, const long long* j, unsigned char* out) {
    const Dropout dropout = make(seed, threshold);
    for (long long e = 0; e < count; ++e) out[e] = dropout.keep(n[e], i[e], j[e]);
}
// the 16 x 16 tile at (i0, j0) as the 32 threads of a warp hold it (kept bits of each thread's
// 8 elements, rows g + 8h, columns 8jb + 2t + b), written out row-major
template <class Bits>
static void tile(unsigned long long seed, unsigned threshold, unsigned char* out, Bits bits) {
    const Dropout dropout = make(seed, threshold);
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        const unsigned kept = bits(dropout, g, t);
        for (int h = 0; h < 2; ++h)
            for (int jb = 0; jb < 2; ++jb)
                for (int b = 0; b < 2; ++b)
                    out[(g + 8 * h) * 16 + 8 * jb + 2 * t + b] = (kept >> (4 * h + 2 * jb + b)) & 1;
    }
}
extern "C" void keep_tile(unsigned long long seed, unsigned threshold, unsigned long long n, long long i0,
                          long long j0, unsigned char* out) {
    tile(seed, threshold, out, [&](const Dropout& d, int g, int t) { return d.keep_tile(n, i0, j0, g, t); });
}
// keys in rows: out[key][query]
extern "C" void keep_tile_transposed(unsigned long long seed, unsigned threshold, unsigned long long n, long long i0,
                                     long long j0, unsigned char* out) {
    tile(seed, threshold, out, [&](const Dropout& d, int g, int t) { return d.keep_tile_transposed(n, i0, j0, g, t); });
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    where = tmp_path_factory.mktemp("device_math")
    (where / "shim.cpp").write_text(SHIM)
    subprocess.run([CXX, "-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Werror", "-Wno-unknown-pragmas",
                    "-I", str(_compile.kernel_dir() / "attention"), str(where / "shim.cpp"),
                    "-o", str(where / "shim.so")], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(where / "shim.so"))


def pointer(a):
    return ctypes.c_void_p(a.ctypes.data)


seeds = st.integers(0, 2**64 - 1)
probabilities = st.sampled_from([0.0, 1 / 65536, 0.1, 0.5, 0.9, 0.999])


@settings(max_examples=60, deadline=None)
@given(seed=seeds, p=probabilities, draw=st.integers(0, 2**32 - 1))
def test_keep_equals_the_reference(lib, seed, p, draw):
    rng = np.random.default_rng(draw)
    count = 4096
    n = rng.integers(0, 2**40, count, dtype=np.uint64)
    n[: count // 2] %= 64   # small entries too
    i = rng.integers(0, 1 << 20, count, dtype=np.int64)
    j = rng.integers(0, 1 << 20, count, dtype=np.int64)
    got = np.zeros(count, dtype=np.uint8)
    lib.keep(ctypes.c_ulonglong(seed), ctypes.c_uint(reference.dropout_threshold(p)), ctypes.c_longlong(count),
             pointer(n), pointer(i), pointer(j), pointer(got))
    want = reference.dropout_keep(seed, n, i, j, p)
    np.testing.assert_array_equal(got.astype(bool), want)
    if p:   # (p = 0 keeps all: a mask with nothing dropped would pass any function)
        assert 0 < np.count_nonzero(~want) or p < 0.01


@settings(max_examples=60, deadline=None)
@given(seed=seeds, p=probabilities, n=st.integers(0, 2**64 - 1), i0=st.integers(0, 2**16), j0=st.integers(0, 2**16))
def test_a_threads_tile_equals_the_reference(lib, seed, p, n, i0, j0):
    i0, j0 = 16 * i0, 16 * j0
    got = np.zeros((16, 16), dtype=np.uint8)
    lib.keep_tile(ctypes.c_ulonglong(seed), ctypes.c_uint(reference.dropout_threshold(p)), ctypes.c_ulonglong(n),
                  ctypes.c_longlong(i0), ctypes.c_longlong(j0), pointer(got))
    want = reference.dropout_keep(seed, np.uint64(n), i0 + np.arange(16)[:, None], j0 + np.arange(16), p)
    np.testing.assert_array_equal(got.astype(bool), want)
    lib.keep_tile_transposed(ctypes.c_ulonglong(seed), ctypes.c_uint(reference.dropout_threshold(p)),
                             ctypes.c_ulonglong(n), ctypes.c_longlong(i0), ctypes.c_longlong(j0), pointer(got))
    np.testing.assert_array_equal(got.astype(bool), want.T)


def test_kept_fraction_is_one_minus_p(lib):
    count = 1 << 16
    n, i, j = (np.arange(count, dtype=t) % m for t, m in ((np.uint64, 3), (np.int64, 257), (np.int64, 1 << 20)))
    for p in (0.1, 0.5):
        got = np.zeros(count, dtype=np.uint8)
        lib.keep(ctypes.c_ulonglong(1234), ctypes.c_uint(reference.dropout_threshold(p)), ctypes.c_longlong(count),
                 pointer(n), pointer(i), pointer(j), pointer(got))
        assert abs(got.mean() - (1 - p)) < 5 / np.sqrt(count)
