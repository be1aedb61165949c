"""The errors of docs/contract.md: every bad input raises TypeError or ValueError before any kernel launch,
naming the argument, what was expected and what was given.

The first part needs no GPU (it runs in CI): the public API with non-CuPy inputs, and the
pure rules behind the other checks. The GPU part drives every error through the public API
with real CuPy arrays and checks that no kernel was launched.
"""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import GPU_MISSING, poisoned_allocations, requires_gpu

import cuflash
from cuflash import _checks, _launch, reference
from cuflash._mask import normalize_window


def has(*parts):
    """A `match` pattern: every part, literally, in this order."""
    return "(?s)" + ".*".join(re.escape(p) for p in parts)


# ---- non-CuPy inputs: a TypeError saying how to convert, before the GPU is looked for ----


class DLPackArray:
    """Stands in for a JAX (or other) array: only the DLPack protocol."""

    def __dlpack__(self, stream=None):
        raise NotImplementedError

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0


class CudaArrayInterfaceArray:
    """Stands in for a Numba device array: only __cuda_array_interface__."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": (4, 8), "typestr": "<f2", "data": (0, False), "version": 3}


@pytest.fixture
def no_gpu_lookup(monkeypatch):
    """cupy installed; looking for the GPU fails the test (type errors must come first)."""
    pytest.importorskip("cupy")

    def looked():
        raise AssertionError("looked for the GPU before checking the argument types")

    monkeypatch.setattr(_checks, "require_gpu", looked)


@pytest.mark.parametrize(
    "make, given, hint",
    [
        (lambda: np.ones((4, 8), np.float16), "numpy.ndarray", "cupy.asarray(q)"),
        (lambda: [[1.0] * 8] * 4, "list", "cupy.asarray(q)"),
        (lambda: 1.5, "float", "cupy.asarray(q)"),
        (lambda: np.float16(1.5), "numpy.float16", "cupy.asarray(q)"),
        (DLPackArray, "DLPackArray", "cupy.from_dlpack(q) (zero-copy)"),
        (CudaArrayInterfaceArray, "CudaArrayInterfaceArray", "cupy.asarray(q) (zero-copy)"),
    ],
    ids=["numpy", "list", "scalar", "numpy-scalar", "dlpack", "cuda-array-interface"],
)
def test_non_cupy_input_says_how_to_convert(no_gpu_lookup, make, given, hint):
    q = make()
    with pytest.raises(TypeError, match=has("q must be a cupy.ndarray, got ", given, "convert it with " + hint)):
        cuflash.attention(q, q, q)


def test_torch_tensor_says_from_dlpack(no_gpu_lookup):
    torch = pytest.importorskip("torch")
    q = torch.ones(4, 8, dtype=torch.float16)
    with pytest.raises(
        TypeError, match=has("q must be a cupy.ndarray, got torch.Tensor", "cupy.from_dlpack(q) (zero-copy", "q.cuda()")
    ):
        cuflash.attention(q, q, q)


def test_backward_non_cupy_input_says_how_to_convert(no_gpu_lookup):
    x = np.ones((4, 8), np.float16)
    with pytest.raises(TypeError, match=has("q must be a cupy.ndarray, got numpy.ndarray", "cupy.asarray(q)")):
        cuflash.attention_backward(x, x, x, x, x, x[:, 0].astype(np.float32))


@pytest.mark.parametrize("deterministic", ["yes", None, 1])
def test_deterministic_must_be_a_bool(no_gpu_lookup, deterministic):
    x = np.ones((4, 8), np.float16)
    with pytest.raises(TypeError, match=has(f"deterministic must be True or False, got {deterministic!r}")):
        cuflash.attention_backward(x, x, x, x, x, x[:, 0].astype(np.float32), deterministic=deterministic)
    with pytest.raises(TypeError, match=has(f"deterministic must be True or False, got {deterministic!r}")):
        reference.attention_backward(x, x, x, x, x, x[:, 0].astype(np.float32), deterministic=deterministic)


@pytest.mark.parametrize("name", ["q", "k", "v", "dout", "out", "lse"])
def test_non_cupy_argument_is_named(name):
    cupy = pytest.importorskip("cupy")
    with pytest.raises(TypeError, match=has(f"{name} must be a cupy.ndarray", f"cupy.asarray({name})")):
        _checks.check_cupy(cupy, **{name: np.zeros(3)})


def test_without_cupy_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now raises ImportError
    q = np.ones((4, 8), dtype=np.float16)
    with pytest.raises(ImportError, match=r"need an NVIDIA GPU: CuPy is not installed: pip install 'cupy-cuda12x>=14' "):
        cuflash.attention(q, q, q)
    assert cuflash.reference.attention(q, q, q).shape == (4, 8)


@pytest.mark.skipif(GPU_MISSING is None, reason="a GPU is present")
def test_without_gpu_says_what_is_missing(monkeypatch):
    pytest.importorskip("cupy")
    # No CuPy array exists without a GPU: pretend these passed the type check.
    monkeypatch.setattr(_checks, "check_cupy", lambda cupy, **arrays: None)
    q = np.ones((4, 8), dtype=np.float16)
    with pytest.raises(RuntimeError, match="need an NVIDIA GPU.*cuflash.reference"):
        cuflash.attention(q, q, q)


# ---- dtypes ----


@pytest.mark.parametrize("dtype", ["float64", "int32", "bool", "complex64", "int8", "uint16"])
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_unsupported_dtype(name, dtype):
    dtypes = {"q": "float16", "k": "float16", "v": "float16", name: dtype}
    with pytest.raises(
        TypeError, match=has(f"{name} must have dtype float16, bfloat16 or float32, got {dtype}", f"{name}.astype(")
    ):
        _checks.check_dtypes(**dtypes)


@pytest.mark.parametrize(
    "q, k, v",
    [("float16", "float32", "float16"), ("float32", "float32", "float16"), ("float16", "bfloat16", "float16")],
)
def test_mixed_dtypes(q, k, v):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    as_dtype = {"bfloat16": ml_dtypes.bfloat16}.get
    dtypes = {name: as_dtype(dt, dt) for name, dt in (("q", q), ("k", k), ("v", v))}
    message = f"q, k and v must share one dtype, got q.dtype={q}, k.dtype={k}, v.dtype={v}"
    with pytest.raises(TypeError, match=has(message)):
        _checks.check_dtypes(**dtypes)


def test_supported_dtypes_pass():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dt in (np.float16, ml_dtypes.bfloat16, np.float32):
        assert _checks.check_dtypes(q=dt, k=dt, v=dt) == np.dtype(dt).name


# ---- shapes ----


@pytest.mark.parametrize(
    "shapes, parts",
    [
        (((8,), (4, 8), (4, 8)), ["q must have at least 2 dims (..., N, D), got shape (8,)"]),
        (((4, 8), (), (4, 8)), ["k must have at least 2 dims (..., N, D), got shape ()"]),
        (((4, 8), (4, 8), (8,)), ["v must have at least 2 dims (..., N, D), got shape (8,)"]),
        (((4, 8), (4, 16), (4, 8)), ["q and k must have the same head dim", "q.shape=(4, 8)", "k.shape=(4, 16)"]),
        (((4, 8), (4, 8), (5, 8)), ["k and v must have the same number of keys", "k.shape=(4, 8)", "v.shape=(5, 8)"]),
        (
            ((2, 4, 8), (3, 4, 8), (3, 4, 8)),
            ["of q, k and v must broadcast", "q.shape=(2, 4, 8)", "k.shape=(3, 4, 8)", "v.shape=(3, 4, 8)"],
        ),
    ],
    ids=["q-ndim", "k-ndim", "v-ndim", "head-dim-mismatch", "keys-mismatch", "batch-not-broadcastable"],
)
def test_shape_errors(shapes, parts):
    with pytest.raises(ValueError, match=has(*parts)):
        _checks.check_shapes(*shapes)


def test_broadcast_batch_shape():
    assert _checks.check_shapes((2, 3, 4, 5, 8), (2, 3, 1, 7, 8), (3, 1, 7, 16)) == (2, 3, 4)


@pytest.mark.parametrize("d", [257, 264, 512])
@pytest.mark.parametrize("name, axis", [("q", "head dim (last axis)"), ("v", "value head dim (last axis)")])
def test_unsupported_head_dim(name, axis, d):
    with pytest.raises(ValueError, match=has(f"{name} has {axis} {d}", "head dims up to 256")):
        _checks.check_head_dim(name, axis, d)


@pytest.mark.parametrize("d", [0, 1, 4, 7, 8, 12, 59, 64, 111, 255, 256])
def test_supported_head_dim(d):
    _checks.check_head_dim("q", "head dim (last axis)", d)


# ---- devices (stand-ins: two GPUs are needed for real arrays) ----


def test_arrays_on_different_devices():
    def on(device):
        return SimpleNamespace(device=SimpleNamespace(id=device))

    with pytest.raises(ValueError, match=has("all arrays must be on one device", "q on device 0", "k on device 1")):
        _checks.check_devices(q=on(0), k=on(1), v=on(0))
    _checks.check_devices(q=on(1), k=on(1), v=on(1))


# ---- mask and scale ----


@pytest.mark.parametrize(
    "causal, window, exc, parts",
    [
        (False, (-1, None), ValueError, ["window[0] (left) must be None or a non-negative int, got -1"]),
        (True, (4, -3), ValueError, ["window[1] (right) must be None or a non-negative int, got -3"]),
        (False, (1.5, None), TypeError, ["window[0] (left) must be None or a non-negative int, got 1.5 of type float"]),
        (False, (True, 2), TypeError, ["window[0] (left)", "got True of type bool"]),
        (False, (1, 2, 3), ValueError, ["window must be None or a pair (left, right)", "length 3"]),
        (False, 5, TypeError, ["window must be None or a pair (left, right)", "got 5 of type int"]),
        ("yes", None, TypeError, ["causal must be a bool, got 'yes' of type str"]),
    ],
)
def test_bad_mask(causal, window, exc, parts):
    with pytest.raises(exc, match=has(*parts)):
        normalize_window(causal, window)


@pytest.mark.parametrize(
    "scale, exc, parts",
    [
        (float("nan"), ValueError, ["scale must be finite, got nan"]),
        (float("inf"), ValueError, ["scale must be finite, got inf"]),
        ("1", TypeError, ["scale must be None or a real number, got '1' of type str"]),
        (True, TypeError, ["scale must be None or a real number, got True of type bool"]),
        (1j, TypeError, ["scale must be None or a real number, got 1j of type complex"]),
    ],
)
def test_bad_scale(scale, exc, parts):
    with pytest.raises(exc, match=has(*parts)):
        _checks.check_scale(scale, 64)


def test_default_scale():
    assert _checks.check_scale(None, 64) == 0.125


# ---- the backward's out, dout and lse ----


def backward_given(batch=(2, 3), nq=5, dv=16, dtype=np.float16, **changes):
    """Correct (shape, dtype) of out, dout and lse, with `changes` applied."""
    given = {
        "out": (batch + (nq, dv), dtype),
        "dout": (batch + (nq, dv), dtype),
        "lse": (batch + (nq,), np.float32),
    }
    return given | changes


def test_backward_arrays_that_fit_pass():
    _checks.check_backward_arrays((2, 3), 5, 16, np.float16, **backward_given())
    _checks.check_backward_arrays((0,), 0, 8, np.float32, **backward_given((0,), 0, 8, np.float32))


@pytest.mark.parametrize(
    "changes, parts",
    [
        (
            {"out": ((2, 3, 5, 8), np.float16)},
            ["out must have shape (2, 3, 5, 16) and dtype float16", "got shape (2, 3, 5, 8) and dtype float16"],
        ),
        (
            {"out": ((2, 3, 5, 16), np.float32)},
            ["out must have shape (2, 3, 5, 16) and dtype float16", "got shape (2, 3, 5, 16) and dtype float32"],
        ),
        (
            {"dout": ((3, 5, 16), np.float16)},
            ["dout must have shape (2, 3, 5, 16) and dtype float16", "got shape (3, 5, 16) and dtype float16"],
        ),
        (
            {"dout": ((2, 3, 5, 16), np.float64)},
            ["dout must have shape (2, 3, 5, 16) and dtype float16", "got shape (2, 3, 5, 16) and dtype float64"],
        ),
        (
            {"lse": ((2, 3, 5), np.float16)},
            ["lse must have shape (2, 3, 5) and dtype float32", "return_lse", "got shape (2, 3, 5) and dtype float16"],
        ),
        (
            {"lse": ((2, 3, 5, 1), np.float32)},
            ["lse must have shape (2, 3, 5) and dtype float32", "got shape (2, 3, 5, 1) and dtype float32"],
        ),
    ],
    ids=["out-shape", "out-dtype", "dout-shape", "dout-dtype", "lse-dtype", "lse-shape"],
)
def test_backward_wrong_out_dout_lse(changes, parts):
    with pytest.raises(ValueError, match=has(*parts)):
        _checks.check_backward_arrays((2, 3), 5, 16, np.float16, **backward_given(**changes))


def test_backward_shapes_follow_the_broadcast_batch():
    # q (2, 3, 5, 64) against k, v (3, 7, 64): out and lse carry the broadcast batch (2, 3)
    batch = _checks.check_shapes((2, 3, 5, 64), (3, 7, 64), (3, 7, 16))
    with pytest.raises(ValueError, match=has("out must have shape (2, 3, 5, 16)", "got shape (3, 5, 16)")):
        _checks.check_backward_arrays(batch, 5, 16, np.float16, **backward_given(out=((3, 5, 16), np.float16)))


# ---- score modifiers: a plan's key is taken before the checks, from any value ----


@pytest.mark.parametrize("softcap, slopes, sinks", [
    ([30.0], None, None), ("1", None, None), (None, [0.5, 0.25], None), (None, None, np.ones(3, np.float32)),
    (np.float64(30.0), "slopes", {"z": 1}),
])
def test_modifier_plan_key_takes_any_value(softcap, slopes, sinks):
    """The modifiers' part of a plan's signature is hashable whatever the values (the checks after it
    then raise naming the argument; an AttributeError or unhashable key would not)."""
    from cuflash import _mods

    hash(_mods.key(softcap, slopes, sinks))


# ---- on a GPU: every error through the public API, and no kernel launched ----


@pytest.fixture
def no_launch(monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(_launch.Launch, "run", launched)


def good(cupy, shape=(2, 5, 64), dtype="float16"):
    return cupy.zeros(shape, dtype=dtype)


def unsupported_dtype(names, dtype):
    """A FORWARD_CASES case: the arrays `names` (of "qkv") in `dtype`; the first of them is named."""
    return (
        lambda cp: {n: good(cp, dtype=dtype) for n in names},
        TypeError,
        [f"{names[0]} must have dtype float16, bfloat16 or float32, got {dtype}"],
    )


# Each case: a function of the cupy module giving the (q, k, v) changes and keyword arguments,
# the exception and the parts of its message.
FORWARD_CASES = {
    "k-numpy": (
        lambda cp: {"k": np.zeros((2, 5, 64), np.float16)},
        TypeError,
        ["k must be a cupy.ndarray", "numpy.ndarray", "cupy.asarray(k)"],
    ),
    "v-list": (
        lambda cp: {"v": [[0.0] * 64] * 5},
        TypeError,
        ["v must be a cupy.ndarray, got list", "cupy.asarray(v)"],
    ),
    "float64": unsupported_dtype("qkv", "float64"),
    "int32": unsupported_dtype("k", "int32"),
    "bool": unsupported_dtype("v", "bool"),
    "complex64": unsupported_dtype("q", "complex64"),
    "mixed": (
        lambda cp: {"k": good(cp, dtype="float32")},
        TypeError,
        ["q, k and v must share one dtype", "q.dtype=float16, k.dtype=float32, v.dtype=float16"],
    ),
    "ndim": (
        lambda cp: {"q": good(cp, (64,))},
        ValueError,
        ["q must have at least 2 dims", "got shape (64,)"],
    ),
    "head-dim-mismatch": (
        lambda cp: {"k": good(cp, (2, 5, 32))},
        ValueError,
        ["q and k must have the same head dim", "q.shape=(2, 5, 64)", "k.shape=(2, 5, 32)"],
    ),
    "keys-mismatch": (
        lambda cp: {"v": good(cp, (2, 6, 64))},
        ValueError,
        ["k and v must have the same number of keys", "k.shape=(2, 5, 64)", "v.shape=(2, 6, 64)"],
    ),
    "batch": (
        lambda cp: {"k": good(cp, (3, 5, 64)), "v": good(cp, (3, 5, 64))},
        ValueError,
        ["must broadcast", "q.shape=(2, 5, 64)", "k.shape=(3, 5, 64)"],
    ),
    "head-dim-264": (
        lambda cp: {n: good(cp, (2, 5, 264)) for n in "qkv"},
        ValueError,
        ["q has head dim (last axis) 264", "up to 256"],
    ),
    "value-head-dim": (
        lambda cp: {"v": good(cp, (2, 5, 257))},
        ValueError,
        ["v has value head dim (last axis) 257", "up to 256"],
    ),
    "negative-window": (
        lambda cp: {"window": (-1, None)},
        ValueError,
        ["window[0] (left) must be None or a non-negative int, got -1"],
    ),
    "float-window": (
        lambda cp: {"window": (None, 2.0)},
        TypeError,
        ["window[1] (right) must be None or a non-negative int, got 2.0"],
    ),
    "window-length": (
        lambda cp: {"window": (1,)},
        ValueError,
        ["window must be None or a pair (left, right)", "length 1"],
    ),
    "causal": (
        lambda cp: {"causal": 1},
        TypeError,
        ["causal must be a bool, got 1 of type int"],
    ),
    "scale-nan": (
        lambda cp: {"scale": float("nan")},
        ValueError,
        ["scale must be finite, got nan"],
    ),
    "scale-str": (
        lambda cp: {"scale": "0.1"},
        TypeError,
        ["scale must be None or a real number, got '0.1' of type str"],
    ),
}


def forward_call(cupy, changes):
    args = {"q": good(cupy), "k": good(cupy), "v": good(cupy)} | changes
    return (args.pop("q"), args.pop("k"), args.pop("v")), args


@requires_gpu
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_forward_errors_on_gpu(no_launch, case):
    import cupy

    make, exc, parts = FORWARD_CASES[case]
    (q, k, v), kwargs = forward_call(cupy, make(cupy))
    with pytest.raises(exc, match=has(*parts)):
        cuflash.attention(q, k, v, **kwargs)


@requires_gpu
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_backward_checks_its_inputs_like_the_forward(no_launch, case):
    import cupy

    make, exc, parts = FORWARD_CASES[case]
    (q, k, v), kwargs = forward_call(cupy, make(cupy))
    dout, out, lse = good(cupy), good(cupy), cupy.zeros((2, 5), dtype=cupy.float32)
    with pytest.raises(exc, match=has(*parts)):
        cuflash.attention_backward(dout, q, k, v, out, lse, **kwargs)


def mismatched(name, shape, dtype, want=((2, 5, 64), "float16")):
    """A BACKWARD_CASES case: `name` given with `shape` and `dtype` where `want` (shape, dtype) is due."""
    return (
        lambda cp: {name: good(cp, shape, dtype)},
        ValueError,
        [f"{name} must have shape {want[0]} and dtype {want[1]}", f"got shape {shape} and dtype {dtype}"],
    )


# (dout, out, lse) changes for q, k, v of shape (2, 5, 64) float16, broadcast against k, v (1, 5, 64)
BACKWARD_CASES = {
    "dout-numpy": (
        lambda cp: {"dout": np.zeros((2, 5, 64), np.float16)},
        TypeError,
        ["dout must be a cupy.ndarray", "cupy.asarray(dout)"],
    ),
    "out-list": (
        lambda cp: {"out": [[0.0] * 64] * 5},
        TypeError,
        ["out must be a cupy.ndarray, got list", "cupy.asarray(out)"],
    ),
    "lse-numpy": (
        lambda cp: {"lse": np.zeros((2, 5), np.float32)},
        TypeError,
        ["lse must be a cupy.ndarray", "cupy.asarray(lse)"],
    ),
    "out-shape": mismatched("out", (1, 5, 64), "float16"),
    "out-dtype": mismatched("out", (2, 5, 64), "float32"),
    "dout-shape": mismatched("dout", (2, 5, 32), "float16"),
    "dout-dtype": mismatched("dout", (2, 5, 64), "float64"),
    "lse-dtype": mismatched("lse", (2, 5), "float16", want=((2, 5), "float32")),
    "lse-shape": mismatched("lse", (2, 5, 1), "float32", want=((2, 5), "float32")),
}


@requires_gpu
@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_backward_errors_on_gpu(no_launch, case):
    import cupy

    make, exc, parts = BACKWARD_CASES[case]
    q, k, v = good(cupy), good(cupy, (1, 5, 64)), good(cupy, (1, 5, 64))
    args = {"dout": good(cupy), "out": good(cupy), "lse": cupy.zeros((2, 5), dtype=cupy.float32)} | make(cupy)
    with pytest.raises(exc, match=has(*parts)):
        cuflash.attention_backward(args["dout"], q, k, v, args["out"], args["lse"])


@requires_gpu
def test_non_cupy_backward_argument_found_before_shapes(no_launch):
    """A non-CuPy lse is reported even when q, k, v have other problems too."""
    import cupy

    q, k = good(cupy, dtype="float64"), good(cupy, (2, 5, 32))
    with pytest.raises(TypeError, match=has("lse must be a cupy.ndarray", "cupy.asarray(lse)")):
        cuflash.attention_backward(good(cupy), q, k, k, good(cupy), np.zeros((2, 5), np.float32))


# ---- on a GPU: zero-length dims give empty (or zero) gradients, with no kernel launched ----


@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(
    "q_shape, k_shape, dv",
    [
        ((0, 3, 5, 64), (0, 3, 7, 64), 32),  # empty batch
        ((3, 0, 5, 64), (3, 0, 7, 64), 64),  # empty inner batch dim
        ((2, 3, 0, 64), (2, 3, 7, 64), 64),  # no queries: dk, dv are zeros
        ((2, 3, 0, 64), (1, 7, 64), 32),  # no queries, k and v broadcast
        ((2, 3, 5, 64), (2, 3, 0, 64), 64),  # no keys: dq is zeros
        ((2, 3, 5, 64), (3, 0, 64), 128),  # no keys, k and v broadcast
        ((2, 3, 0, 64), (2, 3, 0, 64), 64),  # neither
    ],
)
def test_backward_zero_length_dims(no_launch, dtype, q_shape, k_shape, dv):
    import cupy
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    q = cupy.ones(q_shape, dtype=dtype)
    k = cupy.ones(k_shape, dtype=dtype)
    v = cupy.ones(k_shape[:-1] + (dv,), dtype=dtype)
    batch = np.broadcast_shapes(q_shape[:-2], k_shape[:-2])
    nq = q_shape[-2]
    # what the forward returns when no key is seen: out 0, lse -inf
    out = cupy.zeros(batch + (nq, dv), dtype=dtype)
    lse = cupy.full(batch + (nq,), -np.inf, dtype=cupy.float32)
    dout = cupy.ones(batch + (nq, dv), dtype=dtype)
    with poisoned_allocations():  # an element nothing writes reads as NaN
        grads = cuflash.attention_backward(dout, q, k, v, out, lse)
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert (cupy.asnumpy(g.astype(cupy.float32)) == 0).all(), f"{name} is not all zeros"


def test_lengths_whose_sum_overflows_int32_are_refused():
    """Nq + Nk >= 2**31 rows: the kernels' mask arithmetic is int32, so the shape check that the
    GPU functions and the reference share refuses it, naming the lengths; 2**31 - 1 is taken."""
    with pytest.raises(ValueError, match=r"Nq \+ Nk must be below 2\*\*31, got 1073741824 \+ 1073741824"):
        _checks.check_shapes((2**30, 8), (2**30, 8), (2**30, 8))
    assert _checks.check_shapes((2, 2**30, 8), (2**30 - 1, 8), (2**30 - 1, 8)) == (2,)
