"""CUDA C++ for traced score and mask functions (`cuflash._trace.Traced`).

Each function becomes ``CUFLASH_MOD_FN`` functions (``__host__ __device__ __forceinline__``
under a CUDA compiler, ``inline`` otherwise, so the host compiler can test them) in float32 and
64-bit integers, one ``const`` temporary per node. The text depends only on the trace, so the
same function and signature give the same source: `Source.key` is a hash of it.

Arguments: ``score`` (score functions), one ``long long`` per batch dim (``b0``, ``b1``, ...),
``q_idx``, ``kv_idx``, and ``arrays``, the captured arrays' descriptors (`PREAMBLE`'s
``cuflash_array``: data pointer, shape and strides in elements) in the trace's slot order. A
read clamps each index to ``[0, n - 1]`` of its dim, so it never leaves the array. Integer
arithmetic wraps (through unsigned arithmetic, as NumPy's int64 does); ``//`` and ``%`` floor
as in Python, and give 0 for a zero divisor, as NumPy's do.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from . import _expr
from ._expr import BOOL, FLOAT, INT
from ._trace import MAX_DIMS, Traced

PREAMBLE = r"""#ifndef CUFLASH_USER_MODS_PREAMBLE
#define CUFLASH_USER_MODS_PREAMBLE
#if defined(__CUDACC__)
#define CUFLASH_MOD_FN __host__ __device__ __forceinline__
#else
#define CUFLASH_MOD_FN inline
#endif
#define CUFLASH_MAX_DIMS %(max_dims)d
// A captured array: element (i0, i1, ...) is ptr[i0 * stride[0] + i1 * stride[1] + ...].
struct cuflash_array {
    const void* ptr;
    long long shape[CUFLASH_MAX_DIMS];
    long long stride[CUFLASH_MAX_DIMS];
};
CUFLASH_MOD_FN long long cf_clamp(long long i, long long n) { return i < 0 ? 0 : (i >= n ? n - 1 : i); }
// int64 arithmetic wraps, as NumPy's does (signed overflow is undefined in C++).
CUFLASH_MOD_FN long long cf_iadd(long long a, long long b) {
    return (long long)((unsigned long long)a + (unsigned long long)b);
}
CUFLASH_MOD_FN long long cf_isub(long long a, long long b) {
    return (long long)((unsigned long long)a - (unsigned long long)b);
}
CUFLASH_MOD_FN long long cf_imul(long long a, long long b) {
    return (long long)((unsigned long long)a * (unsigned long long)b);
}
CUFLASH_MOD_FN long long cf_ineg(long long a) { return (long long)(0ull - (unsigned long long)a); }
CUFLASH_MOD_FN long long cf_iabs(long long a) { return a < 0 ? cf_ineg(a) : a; }
CUFLASH_MOD_FN long long cf_imin(long long a, long long b) { return a < b ? a : b; }
CUFLASH_MOD_FN long long cf_imax(long long a, long long b) { return a > b ? a : b; }
// Python's floor division and modulo; 0 for a zero divisor (NumPy's result).
CUFLASH_MOD_FN long long cf_floordiv(long long a, long long b) {
    if (b == 0) return 0;
    if (b == -1) return cf_ineg(a);
    const long long q = a / b;
    return (a %% b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
CUFLASH_MOD_FN long long cf_mod(long long a, long long b) {
    if (b == 0 || b == -1) return 0;
    const long long r = a %% b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
CUFLASH_MOD_FN long long cf_ipow(long long a, long long n) {
    unsigned long long r = 1, x = (unsigned long long)a;
    for (; n > 0; n >>= 1, x *= x)
        if (n & 1) r *= x;
    return (long long)r;
}
// NaN-propagating minimum and maximum, as NumPy's.
CUFLASH_MOD_FN float cf_fmin(float a, float b) { return (a != a || a < b) ? a : b; }
CUFLASH_MOD_FN float cf_fmax(float a, float b) { return (a != a || a > b) ? a : b; }
CUFLASH_MOD_FN float cf_bits(unsigned int u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
#endif
}
// exp, log, tanh and division: the hardware's approximate forms in kernels of 16-bit inputs
// (CUFLASH_USER_FAST, defined for them, as the built-in softcap's tanh.approx there), the
// library's elsewhere (float32 kernels, the host).
CUFLASH_MOD_FN float cf_exp(float x) {
#if defined(__CUDA_ARCH__) && defined(CUFLASH_USER_FAST)
    return __expf(x);
#else
    return expf(x);
#endif
}
CUFLASH_MOD_FN float cf_log(float x) {
#if defined(__CUDA_ARCH__) && defined(CUFLASH_USER_FAST)
    return __logf(x);
#else
    return logf(x);
#endif
}
CUFLASH_MOD_FN float cf_tanh(float x) {
#if defined(__CUDA_ARCH__) && defined(CUFLASH_USER_FAST)
    float y;
    asm("tanh.approx.f32 %%0, %%1;" : "=f"(y) : "f"(x));
    return y;
#else
    return tanhf(x);
#endif
}
CUFLASH_MOD_FN float cf_div(float a, float b) {
#if defined(__CUDA_ARCH__) && defined(CUFLASH_USER_FAST)
    return __fdividef(a, b);
#else
    return a / b;
#endif
}
// x added to *at: atomically on the device (many threads add to one gradient), in turn on the host.
CUFLASH_MOD_FN void cf_add(float* at, float x) {
#if defined(__CUDA_ARCH__)
    atomicAdd(at, x);
#else
    *at += x;
#endif
}
CUFLASH_MOD_FN float cf_inf() { return cf_bits(0x7f800000u); }
CUFLASH_MOD_FN float cf_nan() { return cf_bits(0x7fc00000u); }
CUFLASH_MOD_FN float cf_bf16(unsigned short h) { return cf_bits((unsigned int)h << 16); }
CUFLASH_MOD_FN float cf_half(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const unsigned int exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0) {   // zero or subnormal: mantissa * 2^-24
        const float v = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (exponent == 31) return cf_bits(sign | 0x7f800000u | (mantissa << 13));
    return cf_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}
#endif
""" % {"max_dims": MAX_DIMS}

_TYPES = {FLOAT: "float", INT: "long long", BOOL: "bool"}

# How a read of each captured dtype becomes a float, a long long or a bool.
_READS = {
    "float32": "((const float*){p})[{o}]",
    "float16": "cf_half(((const unsigned short*){p})[{o}])",
    "bfloat16": "cf_bf16(((const unsigned short*){p})[{o}])",
    "int8": "(long long)((const signed char*){p})[{o}]",
    "uint8": "(long long)((const unsigned char*){p})[{o}]",
    "int16": "(long long)((const short*){p})[{o}]",
    "int32": "(long long)((const int*){p})[{o}]",
    "int64": "((const long long*){p})[{o}]",
    "bool": "(((const unsigned char*){p})[{o}] != 0)",
}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&&", "or": "||", "xor": "!="}
_INT_CALLS = {"add": "cf_iadd", "sub": "cf_isub", "mul": "cf_imul", "floordiv": "cf_floordiv", "mod": "cf_mod",
              "min": "cf_imin", "max": "cf_imax", "neg": "cf_ineg", "abs": "cf_iabs"}
_FLOAT_CALLS = {"min": "cf_fmin", "max": "cf_fmax", "abs": "fabsf", "exp": "cf_exp", "log": "cf_log", "tanh": "cf_tanh",
                "div": "cf_div", "sqrt": "sqrtf"}


@dataclass(frozen=True)
class Source:
    """Generated functions (without `PREAMBLE`) and the names of what they define."""

    text: str
    names: tuple
    key: str = field(init=False, compare=False)   # a stable hash of the text, for caches

    def __post_init__(self):
        object.__setattr__(self, "key", hashlib.sha256(self.text.encode()).hexdigest()[:20])


def float_literal(value: float) -> str:
    """A C++ float32 literal of ``value`` rounded to float32 (the shortest that round-trips)."""
    with np.errstate(over="ignore"):
        f = np.float32(value)
    if np.isnan(f):
        return "cf_nan()"
    if np.isinf(f):
        return "cf_inf()" if f > 0 else "(-cf_inf())"
    text = np.format_float_scientific(f, unique=True) + "f"
    return f"({text})" if text.startswith("-") else text


def int_literal(value: int) -> str:
    if value == _expr.INT64_MIN:
        return "(-9223372036854775807LL - 1)"
    return f"({value}LL)" if value < 0 else f"{value}LL"


def offset(node, names) -> str:
    """The element offset of a load node, its indices clamped to the array's shape."""
    a = f"arrays[{node.attr}]"
    terms = [f"cf_clamp({names[id(i)]}, {a}.shape[{d}]) * {a}.stride[{d}]" for d, i in enumerate(node.args)]
    return " + ".join(terms) or "0"


def flat_index(node, names) -> str:
    """The row-major index of a load node's element in an array of the read array's shape (a
    contiguous gradient of it), its indices clamped to the shape."""
    a = f"arrays[{node.attr}]"
    text = "0"
    for d, i in enumerate(node.args):
        clamped = f"cf_clamp({names[id(i)]}, {a}.shape[{d}])"
        text = clamped if d == 0 else f"({text}) * {a}.shape[{d}] + {clamped}"
    return text


def _expression(n, names, captures) -> str:
    args = [names[id(a)] for a in n.args]
    op = n.op
    if op == "const":
        if n.kind == BOOL:
            return "true" if n.attr else "false"
        return int_literal(n.attr) if n.kind == INT else float_literal(n.attr)
    if op == "score":
        return "score"
    if op == "index":
        return {"q": "q_idx", "kv": "kv_idx"}.get(n.attr, f"b{n.attr}")
    if op == "load":
        return _READS[captures[n.attr].dtype].format(p=f"arrays[{n.attr}].ptr", o=offset(n, names))
    if op == "where":
        return f"({args[0]} ? {args[1]} : {args[2]})"
    if op == "float":
        return f"((float){args[0]})"
    if op == "floor":
        return f"((long long)floorf({args[0]}))"
    if op == "ipow":
        return f"cf_ipow({args[0]}, {n.attr}LL)"
    if op == "pow":
        return f"({args[0]} * {args[0]})" if n.attr == 2.0 else f"powf({args[0]}, {float_literal(n.attr)})"
    if op == "not":
        return f"(!{args[0]})"
    if n.kind == INT and op in _INT_CALLS:
        return f"{_INT_CALLS[op]}({', '.join(args)})"
    if op in _FLOAT_CALLS:
        return f"{_FLOAT_CALLS[op]}({', '.join(args)})"
    if op == "neg":
        return f"(-{args[0]})"
    return f"({args[0]} {_INFIX[op]} {args[1]})"


def _body(roots, captures) -> tuple[list, dict]:
    """The statements computing ``roots``, and each computed node's expression (by id)."""
    names, lines = {}, []
    for n in _expr.topological(roots):
        text = _expression(n, names, captures)
        if n.args and n.op != "float":
            name = f"t{len(lines)}"
            lines.append(f"    const {_TYPES[n.kind]} {name} = {text};\n")
            text = name
        names[id(n)] = text
    return lines, names


def _params(traced: Traced, score: bool) -> str:
    params = (["float score"] if score else []) + [f"long long {name}" for name in traced.index_names]
    return ", ".join(params + ["const cuflash_array* arrays"])


def _function(ret: str, name: str, params: str, root, traced: Traced, read=None) -> str:
    """A function returning ``root``; with ``read`` (a load node), also storing the row-major
    index of the element it reads through the parameter ``at`` (`flat_index`)."""
    roots = [root] if read is None else [root, *read.args]
    lines, names = _body(roots, traced.captures)
    if read is not None:
        lines.append(f"    *at = {flat_index(read, names)};\n")
    unused = "".join(f"    (void){p};\n" for p in ("score", "arrays") if p in params)
    return f"CUFLASH_MOD_FN {ret} {name}({params}) {{\n{unused}{''.join(lines)}    return {names[id(root)]};\n}}\n"


def score_mod_source(traced: Traced, name: str = "cuflash_score_mod") -> Source:
    """``name``: the score function; ``name_dscore``: its derivative with respect to the score;
    ``name_read<k>`` for each of ``traced.reads``: d(result) / d(read k), with the row-major index
    of the element read stored through ``at`` (where it goes in a contiguous gradient of the
    array)."""
    assert traced.role == "score_mod"
    params = _params(traced, score=True)
    parts = [_function("float", name, params, traced.result, traced),
             _function("float", f"{name}_dscore", params, traced.dscore, traced)]
    names = [name, f"{name}_dscore"]
    for k, r in enumerate(traced.reads):
        names.append(f"{name}_read{k}")
        parts.append(_function("float", names[-1], f"{params}, long long* at", r.derivative, traced, r.node))
    return Source("\n".join(parts), tuple(names))


def user_mods_source(score: Traced | None, mask: Traced | None) -> Source:
    """The two functions the attention kernels call (kernels/user/user_scores.cuh), each for a
    flat batch entry ``entry`` (row-major) of a batch of shape ``shape``:
    ``cuflash_user_score(score, entry, shape, q_idx, kv_idx, arrays)``, the score function (the
    score itself without one), ``cuflash_user_dscore`` (the same arguments), its derivative with
    respect to the score (1 without one), and ``cuflash_user_mask(entry, shape, q_idx, kv_idx, arrays)``,
    the mask function (true without one), whose captured arrays follow the score function's in
    ``arrays``; ``cuflash_user_score_grads(score, ds, entry, shape, q_idx, kv_idx, arrays, grads)``,
    which adds ``ds`` (the gradient of the score function's result) times the derivative of
    each float read of the score function to ``grads[slot]`` (a contiguous float32 gradient of
    the array in that slot, or null: none asked) at the element it reads; and
    ``CUFLASH_USER_SCORE``, ``CUFLASH_USER_MASK`` and ``CUFLASH_USER_READS``: 1 where there is a
    score function, a mask function, and the number of reads a gradient reaches;
    ``CUFLASH_USER_ARRAYS``: the descriptors in ``arrays`` (`descriptors`: one without any)."""
    reads = () if score is None else score.reads
    slots = sum(len(t.captures) for t in (score, mask) if t is not None)
    text = (f"#define CUFLASH_USER_SCORE {int(score is not None)}\n#define CUFLASH_USER_MASK {int(mask is not None)}\n"
            f"#define CUFLASH_USER_READS {len(reads)}\n#define CUFLASH_USER_ARRAYS {max(slots, 1)}\n")
    indices = "long long q_idx, long long kv_idx, const cuflash_array* arrays"
    unused = "    (void)entry; (void)shape; (void)q_idx; (void)kv_idx; (void)arrays;\n"
    if score is not None:
        text += score_mod_source(score).text
    for name, fn, without in (("cuflash_user_score", "cuflash_score_mod", "score"),
                              ("cuflash_user_dscore", "cuflash_score_mod_dscore", "(void)score, 1.0f")):
        if score is None:
            body = f"{unused}    return {without};\n"
        else:
            batch = "".join(f"b{i}, " for i in range(score.batch_dims))
            body = (f"    (void)shape;\n{_unflatten(score.batch_dims)}"
                    f"{'' if score.batch_dims else '    (void)entry;' + chr(10)}"
                    f"    return {fn}(score, {batch}q_idx, kv_idx, arrays);\n")
        text += (f"CUFLASH_MOD_FN float {name}(float score, long long entry, const long long* shape, {indices}) "
                 f"{{\n{body}}}\n")
    grads = "    (void)score; (void)ds; (void)grads;\n"
    if reads:
        batch = "".join(f"b{i}, " for i in range(score.batch_dims))
        grads += f"    (void)shape;\n{_unflatten(score.batch_dims)}{'' if score.batch_dims else '    (void)entry;' + chr(10)}"
        for k, r in enumerate(reads):
            grads += (f"    if (grads[{r.slot}]) {{\n        long long at;\n"
                      f"        const float d = cuflash_score_mod_read{k}(score, {batch}q_idx, kv_idx, arrays, &at);\n"
                      f"        cf_add(grads[{r.slot}] + at, ds * d);\n    }}\n")
    else:
        grads += unused
    text += (f"CUFLASH_MOD_FN void cuflash_user_score_grads(float score, float ds, long long entry, const long long* shape, "
             f"{indices}, float* const* grads) {{\n{grads}}}\n")
    if mask is None:
        body = f"{unused}    return true;\n"
    else:
        text += mask_mod_source(mask).text
        slots = 0 if score is None else len(score.captures)
        body = f"    return cuflash_mask_mod_entry(entry, shape, q_idx, kv_idx, arrays + {slots});\n"
    text += f"CUFLASH_MOD_FN bool cuflash_user_mask(long long entry, const long long* shape, {indices}) {{\n{body}}}\n"
    return Source(text, ("cuflash_user_score", "cuflash_user_dscore", "cuflash_user_score_grads", "cuflash_user_mask"))


def _unflatten(batch_dims: int) -> str:
    """Statements giving ``b0 ... b<batch_dims - 1>``, the indices of flat batch entry ``entry``
    (row-major) in a batch of shape ``shape``."""
    lines = []
    for i in reversed(range(batch_dims)):
        rest = "entry" if i == batch_dims - 1 else f"r{i}"
        if i == 0:
            lines.append(f"    const long long b0 = {rest};\n")
        else:
            lines.append(f"    const long long b{i} = {rest} % shape[{i}], r{i - 1} = {rest} / shape[{i}];\n")
    return "".join(lines)


def mask_mod_source(traced: Traced, name: str = "cuflash_mask_mod") -> Source:
    """``name``: the mask function, true where the key may be attended; ``name_entry``: the same
    for flat batch entry ``entry`` (row-major) of a batch of shape ``shape``,
    ``name_entry(entry, shape, q_idx, kv_idx, arrays)``, for code that holds the entry rather than
    its indices (kernels/user/block_mask.cuh)."""
    assert traced.role == "mask_mod"
    batch = "".join(f"b{i}, " for i in range(traced.batch_dims))
    entry = (f"CUFLASH_MOD_FN bool {name}_entry(long long entry, const long long* shape, long long q_idx, "
             f"long long kv_idx, const cuflash_array* arrays) {{\n    (void)shape;\n{_unflatten(traced.batch_dims)}"
             f"{'' if traced.batch_dims else '    (void)entry;' + chr(10)}"
             f"    return {name}({batch}q_idx, kv_idx, arrays);\n}}\n")
    text = _function("bool", name, _params(traced, score=False), traced.result, traced) + entry
    return Source(text, (name, f"{name}_entry"))


# `PREAMBLE`'s cuflash_array as NumPy lays it out, for the descriptors a kernel reads
DESCRIPTOR = np.dtype([("ptr", "<u8"), ("shape", "<i8", (MAX_DIMS,)), ("stride", "<i8", (MAX_DIMS,))])


def data_pointer(a) -> int:
    """The address of a CuPy or NumPy array's first element."""
    return a.data.ptr if type(a).__module__.split(".")[0] == "cupy" else a.ctypes.data


def descriptors(arrays) -> np.ndarray:
    """The descriptors of captured arrays (CuPy or NumPy: a data pointer, shape and strides in
    elements), one per slot; one zeroed where there are none (a kernel takes a valid pointer)."""
    out = np.zeros(max(len(arrays), 1), dtype=DESCRIPTOR)
    for i, a in enumerate(arrays):
        out["ptr"][i] = data_pointer(a)
        out["shape"][i, :a.ndim] = a.shape
        out["stride"][i, :a.ndim] = [st // a.itemsize for st in a.strides]
    return out
