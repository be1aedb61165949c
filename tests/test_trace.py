"""CPU tests of user-defined score and mask functions: tracing (cuflash._trace, cuflash._expr)
and the generated C++ (cuflash._codegen), compiled by the host compiler and by NVRTC.

No GPU and no CuPy needed. Random functions are random expression trees over the score, the
indices and three captured arrays, run by an interpreter closure: tracing it and evaluating the
DAG with NumPy must equal calling it on NumPy arrays; the host-compiled C++ must equal the DAG's
float32 evaluation; the symbolic derivative must equal finite differences.
"""

import ctypes
import dataclasses
import gc
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _codegen, _compile, _expr, _trace

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
BATCH, NQ, NK = (2, 3), 5, 6
RNG = np.random.default_rng(7)
TABLE = (RNG.standard_normal((5, 7)) * 2).astype(np.float32)   # read with two int expressions
IDS = RNG.integers(-3, 4, size=(6,)).astype(np.int32)             # one
FLAGS = RNG.random((4, 3)) < 0.5                                  # two


# ---------------------------------------------------------------------------------------------
# Random functions: expression trees run by an interpreter
# ---------------------------------------------------------------------------------------------


def floats(depth, smooth=False):
    """Float trees; ``smooth`` leaves out where, min, max and abs of the score (for finite
    differences)."""
    leaf = st.one_of(st.just(("score",)), st.tuples(st.just("const"), st.sampled_from([0.5, -1.25, 3.0])))
    if depth == 0:
        return leaf
    f, i = floats(depth - 1, smooth), ints(depth - 1)
    branches = [
        leaf,
        st.tuples(st.sampled_from(["add", "sub", "mul"]), f, st.one_of(f, i)),
        st.tuples(st.just("div"), f, st.tuples(st.just("const"), st.sampled_from([2.0, -0.5]))),
        st.tuples(st.sampled_from(["tanh", "neg", "exp_tanh", "sqrt_abs", "log1_abs", "square"]), f),
        st.tuples(st.just("table"), i, i),
    ]
    if not smooth:
        branches += [st.tuples(st.just("where"), bools(depth - 1), f, st.one_of(f, i)),
                     st.tuples(st.sampled_from(["min", "max"]), f, st.one_of(f, i)),
                     st.tuples(st.just("abs"), f)]
    return st.one_of(*branches)


def ints(depth, score=True):
    leaf = st.one_of(st.tuples(st.just("index"), st.integers(0, len(BATCH) + 1)),
                     st.tuples(st.just("const"), st.integers(-4, 9)))
    if depth == 0:
        return leaf
    i = ints(depth - 1, score)
    return st.one_of(
        leaf,
        st.tuples(st.sampled_from(["add", "sub", "mul", "floordiv", "mod", "min", "max"]), i, i),
        st.tuples(st.sampled_from(["neg", "abs", "square"]), i),
        st.tuples(st.just("ids"), i),
        st.tuples(st.just("where"), bools(depth - 1, score), i, i),
    )


def bools(depth, score=True):
    """Bool trees; without ``score``, for mask functions."""
    i = ints(max(depth - 1, 0), score)
    atoms = st.one_of(st.tuples(st.just("table"), i, i), st.tuples(st.just("const"), st.sampled_from([0.0, 1.5])),
                      *([st.just(("score",))] if score else []))
    leaf = st.one_of(st.tuples(st.sampled_from(["lt", "le", "gt", "ge", "eq", "ne"]), i, i),
                     st.tuples(st.sampled_from(["lt", "ge"]), atoms, atoms),   # exact in float32 and float64
                     st.tuples(st.just("flags"), i, i))
    if depth == 0:
        return leaf
    b = bools(depth - 1, score)
    return st.one_of(leaf, st.tuples(st.sampled_from(["and", "or", "xor"]), b, b), st.tuples(st.just("not"), b))


def make_function(tree, table, ids, flags, role="score_mod"):
    """A score (or mask) function computing ``tree`` that reads the three arrays from its
    closure, as users' functions do."""

    def ev(node, score, idx):
        op, *args = node
        sub = [ev(a, score, idx) if isinstance(a, tuple) else a for a in args]
        if op == "score":
            return score
        if op == "const":   # integers as NumPy's, so that constant subtrees divide by 0 as NumPy does
            return np.int64(args[0]) if isinstance(args[0], int) else args[0]
        if op == "index":
            return idx[args[0]]
        if op == "table":
            return table[sub[0], sub[1]]
        if op == "ids":
            return ids[sub[0]]
        if op == "flags":
            return flags[sub[0], sub[1]]
        x = sub[0]
        unary = {"tanh": lambda: cuflash.tanh(x), "neg": lambda: -x, "abs": lambda: abs(x),
                 "exp_tanh": lambda: cuflash.exp(cuflash.tanh(x)), "sqrt_abs": lambda: cuflash.sqrt(abs(x)),
                 "log1_abs": lambda: cuflash.log(abs(x) + 1.0), "square": lambda: x ** 2,
                 "not": lambda: (not x) if isinstance(x, bool) else ~x}   # ~True is -2 in Python
        if op in unary:
            return unary[op]()
        if op == "where":
            return cuflash.where(*sub)
        y = sub[1]
        return {"add": lambda: x + y, "sub": lambda: x - y, "mul": lambda: x * y, "div": lambda: x / y,
                "floordiv": lambda: x // y, "mod": lambda: x % y, "min": lambda: cuflash.minimum(x, y),
                "max": lambda: cuflash.maximum(x, y), "lt": lambda: x < y, "le": lambda: x <= y,
                "gt": lambda: x > y, "ge": lambda: x >= y, "eq": lambda: x == y, "ne": lambda: x != y,
                "and": lambda: x & y, "or": lambda: x | y, "xor": lambda: x ^ y}[op]()

    if role == "mask_mod":
        return lambda *idx: ev(tree, None, idx)
    return lambda score, *idx: ev(tree, score, idx)


def inputs(seed=0, scale=2.0):
    rng = np.random.default_rng(seed)
    score = rng.standard_normal(BATCH + (NQ, NK)) * scale
    return score, _trace.index_grids(BATCH, np.arange(NQ) + 1, np.arange(NK))


# ---------------------------------------------------------------------------------------------
# Tracing and the NumPy evaluation of the DAG
# ---------------------------------------------------------------------------------------------


@settings(max_examples=150, **FAST)
@given(floats(3))
def test_traced_score_function_equals_the_function_on_numpy(tree):
    fn = make_function(tree, TABLE, IDS, FLAGS)
    traced = _trace.trace(fn, "score_mod", len(BATCH))
    score, grids = inputs()
    direct = np.broadcast_to(np.asarray(_trace.call(fn, score, *grids), dtype=np.float64), score.shape)
    arrays = _trace.captured_arrays(fn, traced)
    (dag,) = _trace.evaluate([traced.result], score, grids, arrays)
    np.testing.assert_array_equal(np.broadcast_to(dag, score.shape), direct)


@settings(max_examples=100, **FAST)
@given(bools(3, score=False))
def test_traced_mask_function_equals_the_function_on_numpy(tree):
    fn = make_function(tree, TABLE, IDS, FLAGS, role="mask_mod")
    traced = _trace.trace(fn, "mask_mod", len(BATCH))
    score, grids = inputs()
    (dag,) = _trace.evaluate([traced.result], score, grids, _trace.captured_arrays(fn, traced))
    assert np.asarray(dag).dtype == bool
    np.testing.assert_array_equal(np.broadcast_to(dag, score.shape),
                                  np.broadcast_to(_trace.call(fn, *grids), score.shape))


@settings(max_examples=100, **FAST)
@given(floats(3, smooth=True))
def test_derivative_equals_finite_differences(tree):
    fn = make_function(tree, TABLE, IDS, FLAGS)
    traced = _trace.trace(fn, "score_mod", len(BATCH))
    score, grids = inputs(scale=1.0)
    (d,) = _trace.evaluate([traced.dscore], score, grids, _trace.captured_arrays(fn, traced))
    d = np.broadcast_to(d, score.shape)

    def fd(h):
        f = [np.broadcast_to(_trace.call(fn, score + e, *grids), score.shape) for e in (h, -h)]
        return (f[0] - f[1]) / (2 * h)

    coarse, fine = fd(1e-4), fd(1e-5)
    # Where the two steps disagree the function is not smooth there (sqrt or log at |x| = 0);
    # where the chain rule meets such a point with a zero factor (sqrt(0 * score)), the derivative
    # is 0 * inf = NaN, as in autograd (docs/contract.md), while the differences see a constant.
    smooth = np.isfinite(coarse) & np.isclose(coarse, fine, rtol=1e-4, atol=1e-6) & np.isfinite(d)
    assume(smooth.mean() > 0.8)   # (a function singular on much of the grid says little)
    np.testing.assert_allclose(d[smooth], fine[smooth], rtol=1e-4, atol=1e-5)


def test_reads_the_gradient_reaches_are_marked_additive_or_not():
    rel = np.arange(12, dtype=np.float32).reshape(3, 4)
    bias = np.ones(4, dtype=np.float32)

    def fn(score, h, q, k):
        return score + rel[h, q - k] + bias[k] * score + rel[h, 0] * 0.5

    traced = _trace.trace(fn, "score_mod", 1)
    found = {(r.slot, r.node.args[-1].op, r.additive) for r in traced.reads}
    assert found == {(0, "sub", True), (1, "index", False), (0, "const", False)}


def test_a_trace_is_cached_per_signature_and_follows_captured_numbers():
    table = np.zeros(4, dtype=np.float32)
    offset = 1

    def fn(score, q, k):
        return score + table[q + offset]

    first = _trace.trace(fn, "score_mod", 0)
    assert _trace.trace(fn, "score_mod", 0) is first
    offset = 2   # noqa: F841 - read by fn through its closure
    second = _trace.trace(fn, "score_mod", 0)
    assert second is not first
    assert _codegen.score_mod_source(second).key != _codegen.score_mod_source(first).key
    table = np.ones(4, dtype=np.float32)   # same dtype and shape: the same trace, the new data
    assert _trace.trace(fn, "score_mod", 0) is second
    assert _trace.captured_arrays(fn, second)[0] is table


def test_a_repeat_call_skips_the_walk_and_sees_what_changed(monkeypatch):
    """A call whose function's places (closure cells, the globals its code and the functions it
    calls name) hold the objects of the last call, and whose arrays have its dtypes and shapes,
    does not walk the function again (`_captured`); a rebound closure variable, an array
    reshaped in place, a rebound global number or helper function, new code, or a value the walk
    passed over that is now a number is seen at the next call. A function that breaks the rules
    raises at every call."""
    walks = []
    captured = _trace._captured
    monkeypatch.setattr(_trace, "_captured", lambda fn: (walks.append(fn), captured(fn))[1])
    space = {"scale": 2.0, "mode": "as given"}
    exec(textwrap.dedent("""
        def helper(k):
            return k * scale

        def make(table):
            def fn(score, q, k):
                return score + table[q] + helper(k) * (1.0 if isinstance(mode, str) else mode)

            def rebind(new):
                nonlocal table
                table = new
            return fn, rebind

        def other_code(table):
            return lambda score, q, k: score - table[q]
    """), space)
    table = np.arange(4, dtype=np.float32)
    fn, rebind = space["make"](table)

    def call():
        traced, arrays = _trace.trace_call(fn, "score_mod", 0)
        return traced, arrays[0]

    first, read = call()
    assert read is table and len(walks) == 1
    assert call() == (first, table) and len(walks) == 1   # (no walk)
    rebind(other := np.ones(4, dtype=np.float32))   # same dtype and shape: the trace, the new array
    assert call() == (first, other) and len(walks) == 2
    other.shape = (2, 2)   # in place: read with one index, refused at every call (one walk)
    for _ in range(2):
        with pytest.raises(TypeError, match="has 2 dims but is read with 1"):
            call()
    other.shape = (4,)
    assert call() == (first, other) and len(walks) == 4
    sources = {_codegen.score_mod_source(first).text}
    for change in (lambda: space.update(scale=3.0), lambda: space.update(helper=lambda k: k - 1),
                   lambda: space.update(mode=0.5),
                   lambda: setattr(fn, "__code__", space["other_code"](table).__code__)):
        change()
        traced, read = call()
        assert _codegen.score_mod_source(traced).text not in sources and read is other
        sources.add(_codegen.score_mod_source(traced).text)
        assert call()[0] is traced


def test_a_walk_keeps_nothing_alive():
    """What a trace keeps of its function's last walk holds no captured array and not the
    function: an array rebound away, and the function itself, can be freed."""
    table = np.zeros(4, dtype=np.float32)

    def fn(score, q, k):
        return score + table[q]

    _trace.trace_call(fn, "score_mod", 0)
    gone = weakref.ref(table)
    table = np.ones(4, dtype=np.float32)
    gc.collect()
    assert gone() is None
    assert _trace.trace_call(fn, "score_mod", 0)[1][0] is table
    gone = weakref.ref(fn)
    del fn
    gc.collect()
    assert gone() is None


def test_two_names_of_one_array_read_one_slot_until_they_part():
    """An array a function reads under two names is one slot of its trace; once the names hold
    two arrays (of the same dtype and shape), a new trace reads each."""
    a = b = np.zeros(4, dtype=np.float32)

    def fn(score, q, k):
        return score + a[q] * b[k]

    one, arrays = _trace.trace_call(fn, "score_mod", 0)
    assert len(one.captures) == 1 and len(arrays) == 1 and arrays[0] is a
    b = np.ones(4, dtype=np.float32)
    two, arrays = _trace.trace_call(fn, "score_mod", 0)
    assert len(two.captures) == 2 and arrays[0] is a and arrays[1] is b


def test_a_function_that_breaks_the_rules_raises_at_every_call():
    """The tracer's TypeErrors come at every call, not only the first: nothing is kept of a
    function it refuses that would let a later call through."""
    from cuflash import _user

    wide = np.zeros(4)   # float64

    def branches(score, q, k):
        if score > 0:
            return score
        return -score

    for fn, message in ((branches, "Python `if`"), (lambda s, q, k: s + wide[q], "float64"),
                        (len, "must be a Python function")):
        for _ in range(3):
            with pytest.raises(TypeError, match=message):
                _user.trace(fn, None, 0)


def test_the_same_function_gives_the_same_source():
    def make():
        rel = np.zeros((4, 9), dtype=np.float16)
        return lambda s, h, q, k: cuflash.where(q >= k, s + rel[h, q - k + 4], -float("inf"))

    a, b = (_codegen.score_mod_source(_trace.trace(make(), "score_mod", 1)) for _ in range(2))
    assert a.text == b.text and a.key == b.key


def test_functions_called_by_the_function_have_their_arrays_captured():
    doc = np.array([0, 0, 1, 1, 1], dtype=np.int64)

    def same_doc(q, k):
        return doc[q] == doc[k]

    traced = _trace.trace(lambda b, q, k: same_doc(q, k) & (q >= k), "mask_mod", 1)
    assert [c.path for c in traced.captures] == ["test_functions_called_by_the_function_have_their_arrays_captured"
                                                 ".<locals>.same_doc.doc"]


def test_integer_division_and_modulo_floor_like_python():
    traced = _trace.trace(lambda q, k: (q - 3) // (k - 2) + (q - 3) % (k - 2) * 100 == 0, "mask_mod", 0)
    q, k = np.meshgrid(np.arange(7), np.arange(5), indexing="ij")
    quotient = _expr.evaluate([traced.result.args[0]], {"q": q, "kv": k}, np.float64)[0]
    with np.errstate(all="ignore"):
        want = (q - 3) // (k - 2) + (q - 3) % (k - 2) * 100
    np.testing.assert_array_equal(quotient, want)
    assert quotient[0, 0] == (-3) // (-2) + (-3) % (-2) * 100   # Python's rule on negatives


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


def python_if(score, b, q, k):
    if score > 0:
        return score
    return -score


@pytest.mark.parametrize("fn, role, words", [
    (python_if, "score_mod", ["Python `if`", "if score > 0:"]),
    (lambda s, b, q, k: math.exp(s), "score_mod", ["math module", "math.exp(s)"]),
    (lambda s, b, q, k: np.exp(s), "score_mod", ["numpy.exp"]),
    (lambda s, b, q, k: max(s, 0.0), "score_mod", ["max()"]),
    (lambda s, b, q, k: math.floor(s), "score_mod", ["math.floor"]),
    (lambda b, q, k: q * 1.5, "mask_mod", ["mask_mod returned a float"]),
    (lambda b, q, k: q - k, "mask_mod", ["mask_mod returned a int"]),
    (lambda s, b, q, k: s > 0, "score_mod", ["score_mod returned a bool"]),
    (lambda s, b, q, k: s + (q > k), "score_mod", ["`+` of a bool"]),
    (lambda s, b, q, k: s // 2, "score_mod", ["`//` takes integer"]),
    (lambda s, b, q, k: 2 ** s, "score_mod", ["`**` with a traced exponent"]),
    (lambda s, b, q, k: s + [1.0, 2.0][q], "score_mod", ["use as a Python int"]),
    (lambda s, b, q, k: s + "x", "score_mod", ["unsupported operand"]),
    (lambda b, q, k: ~(q > 1) & q, "mask_mod", ["`&` takes bool"]),
])
def test_refused_operations_raise_type_error_naming_them(fn, role, words):
    with pytest.raises(TypeError) as info:
        _trace.trace(fn, role, 1)
    for w in words:
        assert w in str(info.value)


NOT_CAPTURED = [np.zeros(3, dtype=np.float32)]


@pytest.mark.parametrize("make, error, words", [
    (lambda: (lambda s, q, k: s + NOT_CAPTURED[0][q]), TypeError, ["not one it reads"]),
    (lambda: (lambda t=np.zeros(3): lambda s, q, k: s + t[q])(), TypeError, ["dtype float64"]),
    (lambda: (lambda t=np.zeros(3, np.uint32): lambda s, q, k: s + t[q])(), TypeError, ["dtype uint32"]),
    (lambda: (lambda t=np.zeros((3, 2), np.float32): lambda s, q, k: s + t[q])(), TypeError, ["2 dims"]),
    (lambda: (lambda t=np.zeros(3, np.float32): lambda s, q, k: s + t[0:2])(), TypeError, ["type slice"]),
    (lambda: (lambda t=np.zeros(3, np.float32): lambda s, q, k: s + t[q * 0.5])(), TypeError, ["float expression"]),
    (lambda: (lambda t=np.zeros(0, np.float32): lambda s, q, k: s + t[q])(), ValueError, ["no element"]),
    (lambda: (lambda t=np.zeros(3, np.float32): lambda s, q, k: s + t.sum())(), TypeError, [".sum"]),
])
def test_captured_array_misuse_is_refused(make, error, words):
    with pytest.raises(error) as info:
        _trace.trace(make(), "score_mod", 0)
    for w in words:
        assert w in str(info.value)


def test_only_python_functions_are_traced():
    with pytest.raises(TypeError, match="must be a Python function"):
        _trace.trace(np.exp, "score_mod", 0)


def test_namespace_functions_work_on_numpy_and_on_traced_values():
    x = np.array([-1.5, 0.25, 2.0])
    assert np.array_equal(cuflash.floor(x), [-2, 0, 2]) and cuflash.floor(x).dtype == np.int64
    np.testing.assert_array_equal(cuflash.where(x > 0, x, 0.0), [0.0, 0.25, 2.0])
    np.testing.assert_array_equal(cuflash.maximum(x, 0.0), np.maximum(x, 0.0))
    traced = _trace.trace(lambda s, q, k: cuflash.sqrt(cuflash.abs(s)) + cuflash.floor(s), "score_mod", 0)
    assert {n.op for n in _expr.topological([traced.result])} >= {"sqrt", "abs", "floor"}


# ---------------------------------------------------------------------------------------------
# Generated C++ on the host compiler, and on NVRTC
# ---------------------------------------------------------------------------------------------

CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")
requires_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++, c++ or clang++) on PATH")


def host_library(tmp_path, source, runners):
    """Compiles `PREAMBLE`, ``source`` and ``runners`` into a shared library."""
    path = tmp_path / "mods.cpp"
    path.write_text("#include <math.h>\n" + _codegen.PREAMBLE + source + runners)
    lib = tmp_path / "mods.so"
    subprocess.run([CXX, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror", "-Wno-unused-parameter",
                    str(path), "-o", str(lib)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(lib))


def runner(name, nidx, ret="float", score=True, offset=False):
    call = ", ".join((["score[e]"] if score else []) + [f"x[{i}]" for i in range(nidx)] + ["arrays"]
                     + (["&offsets[e]"] if offset else []))
    return textwrap.dedent(f"""
        extern "C" void run_{name}(long long n, const float* score, const long long* idx,
                                   const cuflash_array* arrays, {ret}* out, long long* offsets) {{
            (void)score; (void)offsets;
            for (long long e = 0; e < n; ++e) {{
                const long long* x = idx + e * {nidx};
                out[e] = {name}({call});
            }}
        }}
    """)


def run_host(lib, name, score, grids, arrays, dtype=np.float32):
    shape = score.shape
    idx = np.stack([np.broadcast_to(g, shape).ravel() for g in grids], axis=-1).astype(np.int64)
    out = np.zeros(score.size, dtype=dtype)
    offsets = np.zeros(score.size, dtype=np.int64)
    s32 = np.ascontiguousarray(score, dtype=np.float32).ravel()
    pointers = (ctypes.c_void_p(a.ctypes.data) for a in (s32, idx))
    descriptors = _codegen.descriptors(arrays)   # (kept alive through the call)
    getattr(lib, f"run_{name}")(ctypes.c_longlong(score.size), *pointers, ctypes.c_void_p(descriptors.ctypes.data),
                                ctypes.c_void_p(out.ctypes.data), ctypes.c_void_p(offsets.ctypes.data))
    return out.reshape(shape), offsets.reshape(shape)


def assert_float32_close(actual, expected, what):
    expected = np.broadcast_to(expected, actual.shape).astype(np.float64)
    same_nonfinite = (~np.isfinite(expected) & (actual == expected)) | (np.isnan(expected) & np.isnan(actual))
    ok = same_nonfinite | np.isclose(actual, expected, rtol=2e-5, atol=2e-5 * (1 + np.nanmax(
        np.abs(np.where(np.isfinite(expected), expected, 0)))))
    assert ok.all(), f"{what}: {np.count_nonzero(~ok)} of {ok.size} differ, e.g. {actual[~ok][:3]} vs {expected[~ok][:3]}"


@requires_cxx
@settings(max_examples=12, **FAST)
@given(st.lists(floats(3), min_size=4, max_size=4), bools(2, score=False))
def test_generated_cpp_equals_numpy_in_float32(tmp_path_factory, trees, mask_tree):
    tmp_path = tmp_path_factory.mktemp("cpp")
    fns = [make_function(t, TABLE, IDS, FLAGS) for t in trees]
    traces = [_trace.trace(f, "score_mod", len(BATCH)) for f in fns]
    mask_fn = make_function(mask_tree, TABLE, IDS, FLAGS, role="mask_mod")
    mask = _trace.trace(mask_fn, "mask_mod", len(BATCH))
    nidx = len(BATCH) + 2
    source, runners = "", ""
    for n, t in enumerate(traces):
        s = _codegen.score_mod_source(t, f"mod{n}")
        source += s.text
        runners += runner(f"mod{n}", nidx) + runner(f"mod{n}_dscore", nidx)
        runners += "".join(runner(f"mod{n}_read{r}", nidx, offset=True) for r in range(len(t.reads)))
    source += _codegen.mask_mod_source(mask, "mask").text
    runners += runner("mask", nidx, ret="bool", score=False)
    lib = host_library(tmp_path, source, runners)
    score, grids = inputs(seed=3)
    score = score.astype(np.float32)
    for n, (fn, t) in enumerate(zip(fns, traces)):
        arrays = _trace.captured_arrays(fn, t)
        want, dwant = _trace.evaluate([t.result, t.dscore], score, grids, arrays, np.float32)
        assert_float32_close(run_host(lib, f"mod{n}", score, grids, arrays)[0], want, f"mod{n}")
        assert_float32_close(run_host(lib, f"mod{n}_dscore", score, grids, arrays)[0], dwant, f"mod{n} dscore")
        for r, read in enumerate(t.reads):
            d, offsets = run_host(lib, f"mod{n}_read{r}", score, grids, arrays)
            dv, *index = _trace.evaluate([read.derivative, *read.node.args], score, grids, arrays, np.float32)
            assert_float32_close(d, dv, f"mod{n} read{r}")
            table = arrays[read.slot]
            clamped = [np.clip(np.broadcast_to(i, score.shape), 0, m - 1) for i, m in zip(index, table.shape)]
            np.testing.assert_array_equal(offsets, np.ravel_multi_index(clamped, table.shape))   # (a gradient's index)
    arrays = _trace.captured_arrays(mask_fn, mask)
    got = run_host(lib, "mask", score, grids, arrays, dtype=np.bool_)[0]
    (want,) = _trace.evaluate([mask.result], score, grids, arrays, np.float32)
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))


BLOCK_MASK_RUNNER = """
extern "C" void run_tiles(const cf_tiling* s, const cuflash_array* arrays, signed char* kinds, long long tiles,
                          long long threads) {
    for (long long t = 0; t < tiles; ++t) {   // `threads` parts of each tile, as the kernel's threads take them
        bool some = false, all = true;
        for (long long first = 0; first < threads; ++first) {
            bool part_some, part_all;
            cf_tile_part(*s, t, first, threads, arrays, &part_some, &part_all);
            some = some || part_some;
            all = all && part_all;
        }
        kinds[t] = cf_tile_kind(some, all);
    }
}
"""


def block_mask_header() -> str:
    return (_compile.kernel_dir() / "user" / "block_mask.cuh").read_text()


@requires_cxx
@settings(max_examples=6, **FAST)
@given(bools(2, score=False), st.lists(st.tuples(st.integers(0, 13), st.integers(0, 13), st.integers(1, 6),
                                                 st.integers(1, 6), st.integers(1, 5)), min_size=4, max_size=4))
def test_block_mask_header_classifies_tiles_as_the_reference(tmp_path_factory, mask_tree, cases):
    """kernels/user/block_mask.cuh on the host compiler, each tile split among 1 to 5 "threads"
    as the kernel splits it: the kinds of cuflash.reference.block_mask, ragged tiles and empty
    sequences included."""
    from cuflash import reference

    mask_fn = make_function(mask_tree, TABLE, IDS, FLAGS, role="mask_mod")
    with np.errstate(all="ignore"):   # constant subtrees of NumPy ints, folded by NumPy (x % 0)
        traced = _trace.trace(mask_fn, "mask_mod", len(BATCH))
    lib = host_library(tmp_path_factory.mktemp("tiles"), _codegen.mask_mod_source(traced).text + block_mask_header(),
                       BLOCK_MASK_RUNNER)
    arrays = _trace.captured_arrays(mask_fn, traced)
    for nq, nk, rows, keys, threads in cases:
        want = reference.block_mask(mask_fn, BATCH, nq, nk, block=(rows, keys)).kinds
        tiling = np.zeros(_trace.MAX_DIMS + 6, dtype=np.int64)
        tiling[:len(BATCH)] = BATCH
        tiling[_trace.MAX_DIMS:] = (nq, nk, rows, keys) + want.shape[-2:]
        got = np.full(want.shape, -1, dtype=np.int8)
        descriptors = _codegen.descriptors(arrays)   # (kept alive through the call)
        lib.run_tiles(ctypes.c_void_p(tiling.ctypes.data), ctypes.c_void_p(descriptors.ctypes.data),
                      ctypes.c_void_p(got.ctypes.data), ctypes.c_longlong(got.size), ctypes.c_longlong(threads))
        np.testing.assert_array_equal(got, want, err_msg=f"nq {nq}, nk {nk}, block ({rows}, {keys})")


@requires_cxx
@pytest.mark.parametrize("batch", [(), (5,), (2, 3, 4)])
def test_mask_function_of_a_flat_entry_equals_it_at_the_entrys_indices(tmp_path, batch):
    """``cuflash_mask_mod_entry(entry, shape, q, k)``, which kernels call with a flat batch entry,
    against the function at that entry's row-major indices, for every entry of the batch."""
    def mask(*idx):
        *b, q, k = idx
        return (q + 3 * sum((i + 1) * x for i, x in enumerate(b))) % 4 != k % 3

    traced = _trace.trace(mask, "mask_mod", len(batch))
    runners = textwrap.dedent(f"""
        extern "C" void run_entries(long long entries, const long long* shape, const long long* idx, bool* out) {{
            for (long long e = 0; e < entries; ++e)
                for (long long q = 0; q < 4; ++q)
                    for (long long k = 0; k < 3; ++k)
                        out[(e * 4 + q) * 3 + k] = cuflash_mask_mod_entry(e, shape, q, k, nullptr);
            (void)idx;
        }}
    """)
    lib = host_library(tmp_path, _codegen.mask_mod_source(traced).text, runners)
    entries = int(np.prod(batch, dtype=np.int64))
    shape = np.zeros(_trace.MAX_DIMS, dtype=np.int64)
    shape[:len(batch)] = batch
    got = np.zeros((entries, 4, 3), dtype=np.bool_)
    lib.run_entries(ctypes.c_longlong(entries), ctypes.c_void_p(shape.ctypes.data), None, ctypes.c_void_p(got.ctypes.data))
    want = np.array([[[mask(*np.unravel_index(e, batch), q, k) for k in range(3)] for q in range(4)]
                     for e in range(entries)])
    np.testing.assert_array_equal(got, want)


@requires_cxx
@pytest.mark.parametrize("with_score", [True, False])
def test_user_score_and_its_derivative_of_a_flat_entry(tmp_path, with_score):
    """``cuflash_user_score`` and ``cuflash_user_dscore(score, entry, shape, q, k)``, which the
    attention kernels call, against the function and its derivative (finite differences) at the
    entry's row-major indices; without a score function, the score itself and 1."""
    batch = (2, 3)

    def score_mod(s, b, h, q, k):
        return cuflash.tanh(s * (0.5 + 0.25 * h)) * 3.0 + s * s * 0.125 - 0.5 * cuflash.abs(q - k) + b

    traced = _trace.trace(score_mod, "score_mod", 2) if with_score else None
    runners = textwrap.dedent("""
        extern "C" void run(long long entries, const long long* shape, const float* scores, float* out) {
            for (long long e = 0; e < entries; ++e)
                for (long long i = 0; i < 5; ++i) {
                    const float s = scores[i];
                    out[(e * 5 + i) * 2] = cuflash_user_score(s, e, shape, i, 4 - i, nullptr);
                    out[(e * 5 + i) * 2 + 1] = cuflash_user_dscore(s, e, shape, i, 4 - i, nullptr);
                }
        }
    """)
    lib = host_library(tmp_path, _codegen.user_mods_source(traced, None).text, runners)
    shape = np.zeros(_trace.MAX_DIMS, dtype=np.int64)
    shape[:2] = batch
    scores = np.array([-3.0, -0.4, 0.0, 0.7, 2.5], dtype=np.float32)
    got = np.zeros((6, 5, 2), dtype=np.float32)
    lib.run(ctypes.c_longlong(6), ctypes.c_void_p(shape.ctypes.data), ctypes.c_void_p(scores.ctypes.data),
            ctypes.c_void_p(got.ctypes.data))
    for e in range(6):
        b, h = np.unravel_index(e, batch)
        for i, s in enumerate(scores.astype(np.float64)):
            if not with_score:
                assert tuple(got[e, i]) == (np.float32(s), 1.0)
                continue
            value = float(score_mod(s, b, h, i, 4 - i))
            slope = (float(score_mod(s + 1e-6, b, h, i, 4 - i)) - float(score_mod(s - 1e-6, b, h, i, 4 - i))) / 2e-6
            np.testing.assert_allclose(got[e, i], (value, slope), rtol=1e-5, atol=1e-5)


@requires_cxx
@settings(max_examples=10, **FAST)
@given(tree=floats(3, smooth=True), seed=st.integers(0, 2**31 - 1))
def test_user_score_grads_add_to_the_arrays_read(tmp_path_factory, tree, seed):
    """``cuflash_user_score_grads`` (what a backward calls per score with its gradient ds), run over
    every (entry, q, k) of a batch: each listed array's float32 gradient is the sum of ds times
    d(result) / d(read) at each element its reads reach (indices clamped), as the reference adds
    them (cuflash.reference.attention_backward's score_mod_grads); an unlisted array gets none."""
    fn = make_function(tree, TABLE, IDS, FLAGS)
    traced = _trace.trace(fn, "score_mod", len(BATCH))
    assume(traced.reads)
    arrays = _trace.captured_arrays(fn, traced)
    runners = textwrap.dedent("""
        extern "C" void run(long long entries, long long nq, long long nk, const long long* shape,
                            const float* scores, const float* ds, const cuflash_array* arrays, float* const* grads) {
            for (long long e = 0; e < entries; ++e)
                for (long long i = 0; i < nq; ++i)
                    for (long long j = 0; j < nk; ++j) {
                        const long long at = (e * nq + i) * nk + j;
                        cuflash_user_score_grads(scores[at], ds[at], e, shape, i, j, arrays, grads);
                    }
        }
    """)
    lib = host_library(tmp_path_factory.mktemp("grads"), _codegen.user_mods_source(traced, None).text, runners)
    score = inputs(seed=seed)[0].astype(np.float32)
    grids = _trace.index_grids(BATCH, np.arange(score.shape[-2]), np.arange(score.shape[-1]))   # (as the runner's)
    rng = np.random.default_rng(seed)
    ds = rng.standard_normal(score.shape).astype(np.float32)
    listed = {r.slot for r in traced.reads if rng.random() < 0.8} or {traced.reads[0].slot}
    grads = [np.zeros(a.shape, dtype=np.float32) if slot in listed else None for slot, a in enumerate(arrays)]
    pointers = (ctypes.c_void_p * max(len(arrays), 1))(*[None if g is None else g.ctypes.data for g in grads])
    shape = np.zeros(_trace.MAX_DIMS, dtype=np.int64)
    shape[:len(BATCH)] = BATCH
    descriptors = _codegen.descriptors(arrays)
    lib.run(ctypes.c_longlong(int(np.prod(BATCH))), ctypes.c_longlong(score.shape[-2]), ctypes.c_longlong(score.shape[-1]),
            ctypes.c_void_p(shape.ctypes.data), ctypes.c_void_p(np.ascontiguousarray(score).ctypes.data),
            ctypes.c_void_p(ds.ctypes.data), ctypes.c_void_p(descriptors.ctypes.data), pointers)
    for slot, got in enumerate(grads):
        if got is None:
            continue
        want = np.zeros(arrays[slot].shape)
        for r in traced.reads:
            if r.slot == slot:
                d, *index = _trace.evaluate([r.derivative, *r.node.args], score, grids, arrays, np.float32)
                index = [np.clip(np.broadcast_to(i, score.shape), 0, n - 1) for i, n in zip(index, want.shape)]
                np.add.at(want, tuple(index), (ds * np.broadcast_to(d, score.shape)).astype(np.float64))
        scale = 1 + np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale * score.size ** 0.5)


def every_dtype_function():
    """A score function that reads one captured array of each supported dtype (bfloat16 with
    ml_dtypes), transposed views and a 0-dim array among them."""
    rng = np.random.default_rng(1)
    tables = {name: (rng.standard_normal((3, 4)) * 3).astype(name) for name in ("float32", "float16")}
    try:
        import ml_dtypes
        tables["bfloat16"] = (rng.standard_normal((3, 4)) * 3).astype(ml_dtypes.bfloat16)
    except ImportError:
        pass
    tables.update({name: rng.integers(-5, 6, (4, 3)).astype(name).T for name in ("int8", "int16", "int32", "int64")})
    tables["uint8"] = rng.integers(0, 200, (3, 4)).astype(np.uint8)
    tables["bool"] = rng.random((3, 4)) < 0.5
    tables["scalar"] = np.array(0.75, dtype=np.float16)
    tables["half_specials"] = np.array([np.inf, -np.inf, 6e-8, -0.0, 65504.0], dtype=np.float16)
    t = list(tables.values())
    # Each table a global of the function's own, as the rules ask (not an item of a list).
    body = f"def fn(score, b0, b1, q, k):\n    total = score * t{len(t) - 2}[()] + t{len(t) - 1}[q - k]\n"
    for i, a in enumerate(t[:-2]):
        value = f"t{i}[b1 + q - 2, k - 1]"
        body += f"    total = total + {'cuflash.where(' + value + ', 1.0, -1.0)' if a.dtype == np.bool_ else value}\n"
    body += "    return total\n"
    scope = dict({f"t{i}": a for i, a in enumerate(t)}, cuflash=cuflash)
    exec(body, scope)   # noqa: S102 - a function whose globals are the tables
    return scope["fn"]


@requires_cxx
def test_generated_cpp_reads_every_dtype_and_clamps_indices(tmp_path):
    fn = every_dtype_function()
    traced = _trace.trace(fn, "score_mod", 2)
    lib = host_library(tmp_path, _codegen.score_mod_source(traced, "mod").text, runner("mod", 4))
    score, grids = inputs(seed=5)
    score = score.astype(np.float32)
    arrays = _trace.captured_arrays(fn, traced)
    (want,) = _trace.evaluate([traced.result], score, grids, arrays, np.float32)
    assert_float32_close(run_host(lib, "mod", score, grids, arrays)[0], want, "every dtype")


NVRTC_SCRIPT = """
import sys
from cupy_backends.cuda.libs import nvrtc
source = sys.stdin.read()
prog = nvrtc.createProgram(source, "user_mods.cu", [], [])
try:
    nvrtc.compileProgram(prog, [f"--gpu-architecture={sys.argv[1] if len(sys.argv) > 1 else 'sm_80'}", "-std=c++17"])
finally:
    print(nvrtc.getProgramLog(prog))
"""


def nvrtc_python():
    """A Python that imports cupy_backends' NVRTC: this one, or the kernel check's venv."""
    try:
        from cupy_backends.cuda.libs import nvrtc  # noqa: F401
        return sys.executable
    except Exception:   # noqa: BLE001 - any failure to load NVRTC means: look elsewhere
        pass
    venv = os.environ.get("CUFLASH_NVRTC_PYTHON", "/tmp/ckvenv/bin/python")
    if os.path.exists(venv):
        probe = subprocess.run([venv, "-c", "from cupy_backends.cuda.libs import nvrtc; nvrtc.getVersion()"],
                               capture_output=True)
        if probe.returncode == 0:
            return venv
    return None


def test_generated_code_compiles_with_nvrtc():
    python = nvrtc_python()
    if python is None:
        pytest.skip("cupy_backends.cuda.libs.nvrtc is not importable here (nor in /tmp/ckvenv)")
    doc = np.zeros((2, 8), dtype=np.int32)
    rel = np.zeros((4, 64), dtype=np.float32)
    score = _trace.trace(every_dtype_function(), "score_mod", 2)
    extra = _trace.trace(lambda s, b, h, q, k: cuflash.where(q >= k, s + rel[h, q - k + 32] / 2, -float("inf"))
                         + cuflash.floor(s) // 3 + cuflash.minimum(s, 1.0) ** 1.5, "score_mod", 2)
    mask = _trace.trace(lambda b, h, q, k: (doc[b, q] == doc[b, k]) & ~(q < k) | (k % 4 == 0), "mask_mod", 2)
    source = _codegen.PREAMBLE + _codegen.score_mod_source(score, "mod").text \
        + _codegen.score_mod_source(extra, "extra").text + _codegen.mask_mod_source(mask, "mask").text + """
extern "C" __global__ void use(float* out, const cuflash_array* arrays, const cuflash_array* more,
                               const cuflash_array* docs) {
    long long offset;
    const long long i = threadIdx.x;
    out[i] = mod(out[i], 0, 1, i, 2, arrays) + mod_dscore(out[i], 0, 1, i, 2, arrays)
        + extra(out[i], 0, 1, i, 3, more) + extra_read0(out[i], 0, 1, i, 3, more, &offset) + (float)offset
        + (mask(1, 0, i, 3, docs) ? 1.0f : 0.0f);
}
"""
    result = subprocess.run([python, "-c", NVRTC_SCRIPT], input=source, capture_output=True, text=True)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_block_mask_kernel_compiles_with_nvrtc(arch):
    """cuflash.block_mask's kernel after a mask function that reads a captured array, for both
    targets, without a warning."""
    python = nvrtc_python()
    if python is None:
        pytest.skip("cupy_backends.cuda.libs.nvrtc is not importable here (nor in /tmp/ckvenv)")
    doc = np.zeros((2, 8), dtype=np.int32)
    mask = _trace.trace(lambda b, h, q, k: (doc[b, q] == doc[b, k]) & (q >= k), "mask_mod", 2)
    source = _codegen.PREAMBLE + _codegen.mask_mod_source(mask).text + block_mask_header()
    result = subprocess.run([python, "-c", NVRTC_SCRIPT, arch], input=source, capture_output=True, text=True)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout + result.stderr


NVRTC_NAMED_SCRIPT = """
import json, sys
from cupy_backends.cuda.libs import nvrtc
job = json.load(sys.stdin)
prog = nvrtc.createProgram(job["source"], "attention_user.cu", [], [])
for name in job["names"]:
    nvrtc.addNameExpression(prog, name)
try:
    nvrtc.compileProgram(prog, job["options"] + ["-Xptxas=-v"])
finally:
    print(nvrtc.getProgramLog(prog))
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_attention_kernels_compile_with_score_and_mask_functions(arch):
    """The forward, backward and decoding kernels' UserScores path (kernels/user/user_scores.cuh)
    after a score function that reads a table and a mask function that reads document ids (in the
    16-bit kernels' fast math, _codegen.PREAMBLE's CUFLASH_USER_FAST), dense and packed, with no
    warning; the forwards (the portable one, and on sm_90a the one with a loading warpgroup at
    head dims 64 and 128, through tensor maps and not) and the decoding kernels (64 and 128,
    contiguous and paged) with no spill, the backwards (portable, and on sm_90a the Hopper
    passes at 64 and 128, and the dq passes that add the table's gradient: the portable ones, and
    the Hopper one at 128) with at most 16 bytes. The Hopper, decoding and gradient-adding kernels
    in bfloat16 alone (float16's differ only in the element type), to keep CI's test step short."""
    import json

    from cuflash import _tiles

    python = nvrtc_python()
    if python is None:
        pytest.skip("cupy_backends.cuda.libs.nvrtc is not importable here (nor in /tmp/ckvenv)")
    docs, rel = np.zeros(64, dtype=np.int32), np.zeros((4, 64), dtype=np.float32)
    score = _trace.trace(lambda s, b, h, q, k: s + rel[h, q - k + 32] / 2, "score_mod", 2)
    mask = _trace.trace(lambda b, h, q, k: (docs[q] == docs[k]) & (q >= k), "mask_mod", 2)
    names = []
    for dtype in ("float16", "bfloat16"):
        for packed in (False, True):
            fwd = _tiles.fwd_name(dtype, _tiles.fwd_tiles(dtype, 64, packed, _tiles.FULL), packed, _tiles.FULL)
            bwd = _tiles.bwd_names(dtype, _tiles.bwd_tiles(dtype, 64, _tiles.FULL, packed), packed, _tiles.FULL)[1:]
            # (with a bias's and dropout's code: packed, and dense bfloat16 too)
            extras = (True,) if packed else (False, True) if dtype == "bfloat16" else (False,)
            names += [_tiles.user_name(name, bd) for name in (fwd, *bwd) for bd in extras]
            if dtype == "bfloat16":   # the dq pass that adds the table's gradient (score_mod_grads)
                names += [_tiles.user_name(bwd[1], bd, grads=True) for bd in extras]
            for head_dim in (64, 128) if arch == "sm_90a" and dtype == "bfloat16" else ():   # (Hopper: one type)
                ws = _tiles.sm90_ws_fwd_tiles(dtype, head_dim, scores=_tiles.FULL)
                loaders = [ws.without_maps()] + ([] if packed else [dataclasses.replace(ws, tma=True)])
                names += [_tiles.user_name(_tiles.sm90_ws_fwd_name(dtype, t, packed, _tiles.FULL), bd)
                          for t in loaders for bd in extras]
                hopper_bwd = _tiles.sm90_bwd_tiles(dtype, head_dim, scores=_tiles.FULL, packed=packed)
                names += [_tiles.user_name(n, bd) for n in _tiles.sm90_bwd_names(dtype, hopper_bwd, packed, _tiles.FULL)
                          for bd in extras]
                if _tiles.sm90_bwd_tiles(dtype, head_dim, scores=_tiles.FULL, packed=packed, score_grads=True):
                    dq = _tiles.sm90_bwd_names(dtype, hopper_bwd, packed, _tiles.FULL)[1]
                    names += [_tiles.user_name(dq, bd, grads=True) for bd in extras]
        for head_dim in (64, 128) if dtype == "bfloat16" else ():   # decoding: a contiguous cache, pages of 16
            for page in (None, 16):
                decode = _tiles.decode_tiles(head_dim, 4, 2, page)
                for two_level in (False, True) if arch == "sm_90a" else (False,):
                    names.append(_tiles.user_name(decode.name(dtype, head_dim, two_level, _tiles.FULL)))
    job = {"source": _compile.user_kernel_source(_codegen.user_mods_source(score, mask), fast=True), "names": names,
           "options": list(_compile.nvrtc_options(arch))}
    result = subprocess.run([python, "-c", NVRTC_NAMED_SCRIPT], input=json.dumps(job), capture_output=True, text=True)
    log = result.stdout + result.stderr
    assert result.returncode == 0 and "warning" not in log, log
    assert len(re.findall(r"Compiling entry function '_ZN7cuflash\d+attn_", log)) == len(names), log
    spills = [(kernel, int(n)) for kernel, n in re.findall(
        r"Compiling entry function '_ZN7cuflash\d+(attn_\w+?)I.*?(\d+) bytes spill stores", log, re.S)]
    assert len(spills) == len(names) and all(n == 0 for kernel, n in spills if not kernel.startswith("attn_bwd")), log
    # (the dense dq pass spills 12 bytes for sm_80: docs/design.md, "Score and mask functions")
    assert max(n for _, n in spills) <= 16, log


def fake_cupy(monkeypatch):
    """A stand-in for CuPy in `_user.arguments`: asarray keeps a copy of each array of words it
    is given (``copies``) and returns another; devices unchecked, no arguments kept before."""
    from cuflash import _user

    class FakeCupy:
        copies = []

        @classmethod
        def asarray(cls, words):
            cls.copies.append(words.copy())
            return words.copy()

    monkeypatch.setattr(_trace, "check_devices", lambda traced, arrays, device: None)
    monkeypatch.setattr(_user, "_arguments", {})
    return FakeCupy


def test_a_repeated_call_reuses_its_arguments_on_the_device(monkeypatch):
    """_user.arguments copies a call's words (batch shape, captured arrays' descriptors) to the
    device once: the same shape and arrays again reuse that array; another array (read by the
    call's trace, as each call makes it), another shape or another device make their own; past
    ARGUMENTS_KEPT each call copies its own."""
    from cuflash import _user

    FakeCupy = fake_cupy(monkeypatch)
    table = np.arange(12, dtype=np.float32).reshape(3, 4)

    def score_mod(score, b, h, q, k):
        return score + table[h, q - k]

    user = _user.trace(score_mod, None, 2)
    first = _user.arguments(FakeCupy, user, (2, 3), 0)
    assert _user.arguments(FakeCupy, user, (2, 3), 0) is first
    assert len(FakeCupy.copies) == 1
    np.testing.assert_array_equal(first[:_trace.MAX_DIMS], [2, 3] + [0] * (_trace.MAX_DIMS - 2))
    arrays = _trace.MAX_DIMS + _user.BLOCK_WORDS   # (no block mask: its words are 0)
    assert not first[_trace.MAX_DIMS:arrays].any() and first[arrays] == table.ctypes.data
    assert _user.arguments(FakeCupy, user, (2, 4), 0) is not first
    assert _user.arguments(FakeCupy, user, (2, 3), 1) is not first
    tables = [table]   # (each kept alive: a new array must not take a freed one's address)
    table = np.ones((3, 4), dtype=np.float32)   # the function now reads another array
    tables.append(table)
    assert _user.arguments(FakeCupy, user, (2, 3), 0) is first   # (the call that traced the old one)
    user = _user.trace(score_mod, None, 2)
    moved = _user.arguments(FakeCupy, user, (2, 3), 0)
    assert moved[arrays] == table.ctypes.data and len(FakeCupy.copies) == 4
    monkeypatch.setattr(_user, "ARGUMENTS_KEPT", len(_user._arguments))
    table = np.zeros((3, 4), dtype=np.float32)
    tables.append(table)
    user = _user.trace(score_mod, None, 2)
    assert _user.arguments(FakeCupy, user, (2, 3), 0) is not _user.arguments(FakeCupy, user, (2, 3), 0)
    assert len(FakeCupy.copies) == 6


def test_a_backward_with_score_mod_grads_passes_its_gradients_after_the_descriptors(monkeypatch):
    """_user.with_gradients takes the arrays of score_mod_grads by identity among the score
    function's (each slot once, their slots in the call's order) and refuses what has no
    gradient as the reference does; _user.arguments then puts a pointer per slot of the score
    function's arrays after every descriptor (the mask function's too: kernels/user/user_scores.cuh
    reads them at CUFLASH_USER_ARRAYS), 0 where none is asked, in words made for the call alone."""
    from types import SimpleNamespace

    from cuflash import _user

    FakeCupy = fake_cupy(monkeypatch)
    table, gain, ids = np.ones((3, 9), np.float32), np.ones(3, np.float16), np.arange(4, dtype=np.int32)
    docs = np.zeros(8, dtype=np.int32)

    def score_mod(score, b, h, q, k):
        return score * gain[h] + table[h, ids[q % 4] - k + 4]

    user = _user.trace(score_mod, lambda b, h, q, k: docs[q] == docs[k], 2)
    slots = {id(a): i for i, a in enumerate(user.arrays)}
    asked, wanted = _user.with_gradients(user, [table, gain, table])
    assert wanted == (slots[id(table)], slots[id(gain)], slots[id(table)])
    assert asked.grads == (slots[id(table)], slots[id(gain)]) and asked.source is user.source
    assert _user.with_gradients(user, None) == (user, None)
    with pytest.raises(TypeError, match=r"score_mod_grads\[0\] .* has dtype int32"):
        _user.with_gradients(user, [ids])
    with pytest.raises(TypeError, match=r"score_mod_grads\[1\] is not an array that score_mod reads"):
        _user.with_gradients(user, [table, docs])   # (the mask function's)
    with pytest.raises(TypeError, match="a sequence of arrays"):
        _user.with_gradients(user, table)
    with pytest.raises(ValueError, match="needs a score_mod"):
        _user.with_gradients(_user.trace(None, lambda b, h, q, k: q >= k, 2), [table])

    grads = [SimpleNamespace(data=SimpleNamespace(ptr=p)) for p in (0xA0, 0xB0)]
    words = _user.arguments(FakeCupy, asked, (2, 3), 0, grads=grads)
    assert _user.arguments(FakeCupy, asked, (2, 3), 0, grads=grads) is not words and not _user._arguments
    after = _trace.MAX_DIMS + _user.BLOCK_WORDS + len(user.arrays) * (_codegen.DESCRIPTOR.itemsize // 8)
    np.testing.assert_array_equal(words[:after], _user.arguments(FakeCupy, user, (2, 3), 0))
    pointers = np.zeros(len(user.score.captures), dtype=np.int64)
    pointers[[slots[id(table)], slots[id(gain)]]] = (0xA0, 0xB0)
    np.testing.assert_array_equal(words[after:], pointers)
    assert "#define CUFLASH_USER_ARRAYS 4" in user.source.text   # table, gain, ids; docs


def test_attention_vjp_asks_for_the_backward_compiles_once(monkeypatch):
    """attention_vjp starts the backward's compiles (`_compile_backward_soon`) at its first call
    with a function's source and shapes, not at each call: again only for another source, head
    dim, dtype, packing, a call with a bias or dropout (their code compiled in) or one that adds
    the gradients of the score function's arrays (its dq pass)."""
    from cuflash import _api, _dispatch

    class Device:
        id = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Array:
        def __init__(self, d=64, dtype=np.float16):
            self.device, self.dtype, self.shape, self.ndim = Device(), np.dtype(dtype), (1, 2, 8, d), 4

    asked = []
    monkeypatch.setattr(_dispatch, "compile_user_backward_soon", lambda *args: asked.append(args[:4]))
    monkeypatch.setattr(_api, "_backwards_asked", set())
    offset = 1.0

    def score_mod(score, b, h, q, k):
        return score + offset

    def soon(x=None, packed=False, bias_dropout=False, grads=False):
        x = Array() if x is None else x
        _api._compile_backward_soon(x, x, x, score_mod, None, None, packed, bias_dropout, grads)

    soon(), soon()
    assert asked == [("float16", 64, 64, False)]
    offset = 2.0   # noqa: F841 - read by score_mod: a new source
    soon(), soon(Array(128)), soon(Array(dtype=np.float32)), soon(packed=True), soon(bias_dropout=True), soon()
    soon(grads=True), soon(grads=True)
    assert len(asked) == 7


@requires_cxx
def test_a_kernel_tile_takes_the_kinds_of_the_blocks_it_touches(tmp_path):
    """cf_block_mask_tile (kernels/user/block_tiles.cuh, host-compiled) over the words of
    _user.block_layout: for random row and key ranges of random batch entries, EMPTY where every
    block they touch is, FULL where every one is, else PARTIAL, read at broadcast batch strides
    and through transposed kinds; PARTIAL without a block mask and for a range outside it."""
    from cuflash import _user
    from cuflash.reference import block_mask

    batch, nq, nk, block = (2, 3), 150, 190, (32, 48)
    docs = np.random.default_rng(3).integers(0, 3, (2, nq)).cumsum(axis=1) // 40

    def mask_mod(b, h, q, k):
        return (docs[b, q] >= docs[b, k % nq]) & (k <= q + 20 * h) | (h == 2) & (q < 7)

    cases = [block_mask(mask_mod, batch, nq, nk, block).kinds,
             block_mask(lambda b, h, q, k: mask_mod(b, 0, q, k), (2, 1), nq, nk, block).kinds,
             block_mask(lambda h, q, k: mask_mod(0, h, q, k), (3,), nq, nk, block).kinds]
    cases.append(np.ascontiguousarray(cases[0].swapaxes(-1, -2)).swapaxes(-1, -2))   # strides not row-major
    runner = textwrap.dedent("""
        extern "C" void run(const cf_block_mask* b, const long long* shape, long long n, const long long* ranges,
                            int* out) {
            for (long long t = 0; t < n; ++t) {
                const long long* r = ranges + 5 * t;
                out[t] = cf_block_mask_tile(*b, shape, (unsigned)r[0], r[1], r[2], r[3], r[4]);
            }
        }
    """)
    source = (_compile.kernel_dir() / "user" / "block_tiles.cuh").read_text()
    lib = host_library(tmp_path, source, runner)
    shape = np.zeros(_trace.MAX_DIMS, dtype=np.int64)
    shape[:2] = batch
    rng = np.random.default_rng(11)
    seen = set()
    for kinds in cases:
        r0, c0 = rng.integers(0, nq, 400), rng.integers(0, nk, 400)
        r1, c1 = r0 + 1 + rng.integers(0, 70, 400), c0 + 1 + rng.integers(0, 70, 400)
        r1, c1 = np.minimum(r1, nq), np.minimum(c1, nk)
        entries = rng.integers(0, 6, 400)
        ranges = np.stack([entries, r0, r1, c0, c1], axis=1).astype(np.int64)
        words = _user.block_layout(kinds.ctypes.data, kinds.shape, kinds.strides, block, batch)
        got = np.zeros(400, dtype=np.int32)
        lib.run(ctypes.c_void_p(words.ctypes.data), ctypes.c_void_p(shape.ctypes.data), ctypes.c_longlong(400),
                ctypes.c_void_p(ranges.ctypes.data), ctypes.c_void_p(got.ctypes.data))
        wide = np.broadcast_to(kinds, batch + kinds.shape[-2:])
        for (e, a, b, c, d), kind in zip(ranges, got):
            touched = wide[np.unravel_index(e, batch)][a // 32:(b - 1) // 32 + 1, c // 48:(d - 1) // 48 + 1]
            want = 2 if (touched == 2).all() else (0 if (touched == 0).all() else 1)
            assert kind == want, (e, a, b, c, d, touched)
            seen.add(want)
    assert seen == {0, 1, 2}
    none = np.zeros(_user.BLOCK_WORDS, dtype=np.int64)
    outside = _user.block_layout(cases[0].ctypes.data, cases[0].shape, cases[0].strides, block, batch)
    outside[3] = 2   # (two blocks down: rows from 64 on lie outside)
    ranges = np.array([[1, 0, 10, 0, 10], [1, 100, 120, 0, 10]], dtype=np.int64)
    for words, want in ((none, [1, 1]), (outside, [int(cases[0][1, 0, 0, 0]), 1])):
        got = np.zeros(2, dtype=np.int32)
        lib.run(ctypes.c_void_p(words.ctypes.data), ctypes.c_void_p(shape.ctypes.data), ctypes.c_longlong(2),
                ctypes.c_void_p(ranges.ctypes.data), ctypes.c_void_p(got.ctypes.data))
        assert list(got) == want
