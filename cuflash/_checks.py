"""Argument checking and broadcasting, before anything touches the GPU.

Every error names the argument, what was expected and what was given. The
shape and scale rules are shared with ``cuflash.reference``; the rest turns
CuPy arrays into what a kernel launch needs (``AttnInputs``).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np

from . import _gpu
from ._mask import normalize_window
from ._params import MAX_BATCH_DIMS

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
_SUPPORTED_NAMES: dict = {}   # the supported dtypes met so far, by dtype (dtype.name is slow)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8


def check_shapes(q_shape, k_shape, v_shape) -> tuple[int, ...]:
    """Checks the shapes of q, k, v against each other and the head dims against what the
    kernels take (the GPU functions and cuflash.reference alike); returns the broadcast batch shape."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., N, D), got shape {tuple(shape)}")
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(
            f"q and k must have the same head dim (last axis), got q.shape={tuple(q_shape)} "
            f"and k.shape={tuple(k_shape)}"
        )
    if k_shape[-2] != v_shape[-2]:
        raise ValueError(
            f"k and v must have the same number of keys (axis -2), got k.shape={tuple(k_shape)} "
            f"and v.shape={tuple(v_shape)}"
        )
    if q_shape[:-2] == k_shape[:-2] == v_shape[:-2]:
        batch = tuple(q_shape[:-2])
    else:
        try:
            batch = tuple(np.broadcast_shapes(q_shape[:-2], k_shape[:-2], v_shape[:-2]))
        except ValueError as err:
            raise ValueError(
                "the batch dims (all but the last two) of q, k and v must broadcast, got "
                f"q.shape={tuple(q_shape)}, k.shape={tuple(k_shape)}, v.shape={tuple(v_shape)}"
            ) from err
    check_head_dim("q", "head dim (last axis)", q_shape[-1])
    check_head_dim("v", "value head dim (last axis)", v_shape[-1])
    if q_shape[-2] + k_shape[-2] >= 2**31:   # the masks' sums of row and key indices are int32
        raise ValueError(f"Nq + Nk must be below 2**31, got {q_shape[-2]} + {k_shape[-2]}")
    return batch


def sum_to_shape(x, shape):
    """Sums ``x`` over the dims that broadcasting added or stretched, giving ``shape``.

    The adjoint of broadcasting an array of ``shape`` to ``x.shape``; works on
    NumPy and CuPy arrays alike.
    """
    extra = x.ndim - len(shape)
    if extra:
        x = x.sum(axis=tuple(range(extra)))
    stretched = tuple(ax for ax, n in enumerate(shape) if n == 1 and x.shape[ax] != 1)
    if stretched:
        x = x.sum(axis=stretched, keepdims=True)
    return x.reshape(shape)


def check_flag(name: str, value) -> None:
    """A keyword that must be a bool (NumPy's included)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _is_real(x) -> bool:
    """A real number (Python's or NumPy's), not a bool."""
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, (numbers.Real, np.floating, np.integer))


def check_scale(scale, d: int) -> float:
    """The softmax scale: ``1/sqrt(d)`` by default, else a finite real number."""
    if scale is None:
        # With d = 0 every score is 0 whatever the scale; avoid 1/sqrt(0).
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if not _is_real(scale):
        raise TypeError(f"scale must be None or a real number, got {scale!r} of type {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _broadcasts_to(shape, target) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` without enlarging it."""
    shape, target = tuple(shape), tuple(target)
    return len(shape) <= len(target) and all(a in (1, b) for a, b in zip(shape[::-1], target[::-1]))


def check_softcap(softcap) -> float:
    """The ``softcap`` keyword: 0.0 (off) for None or 0, else a finite number > 0."""
    if softcap is None:
        return 0.0
    if not _is_real(softcap):
        raise TypeError(f"softcap must be None or a real number (> 0, or 0 for off), got {softcap!r} "
                        f"of type {type(softcap).__name__}")
    value = float(softcap)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"softcap must be None, 0 (off) or a finite number > 0, got {value}")
    return value if value > 0 else 0.0


def check_per_entry(name: str, x, batch_shape) -> None:
    """``alibi_slopes`` or ``sinks`` (``name``): a float32 array (NumPy or CuPy: only its shape and
    dtype are read) of one value per batch entry, whose shape broadcasts to the broadcast batch
    dims ``batch_shape`` without enlarging them (usually (H,); (Hkv, G) for grouped queries)."""
    dtype = np.dtype(x.dtype)
    if dtype != np.float32:
        raise TypeError(f"{name} must be a float32 array, got dtype {dtype.name} "
                        f"(cast it with {name}.astype('float32'))")
    if not _broadcasts_to(x.shape, batch_shape):
        raise ValueError(f"{name} must have a shape that broadcasts to the batch dims {tuple(batch_shape)} "
                         f"(one value per batch entry, e.g. per head), got shape {tuple(x.shape)}")


def check_bias(bias, batch_shape, nq: int, nk: int, dtype_name: str | None) -> None:
    """The ``bias`` keyword (only its shape and dtype are read): the inputs' dtype ``dtype_name``
    or float32 (any dtype with ``dtype_name`` None: cuflash.reference, which checks its own), and
    a shape that broadcasts to ``batch_shape + (nq, nk)`` without enlarging it."""
    dtype = np.dtype(bias.dtype)
    if dtype_name is not None and dtype.name not in (dtype_name, "float32"):
        raise TypeError(f"bias must have the inputs' dtype ({dtype_name}) or float32, got dtype {dtype.name}")
    target = tuple(batch_shape) + (nq, nk)
    if not _broadcasts_to(bias.shape, target):
        raise ValueError(f"bias must have a shape that broadcasts to the batch dims + (Nq, Nk), {target} "
                         f"(it may have fewer dims, or 1 where it repeats), got shape {tuple(bias.shape)}")


def check_dropout_p(dropout_p) -> float:
    """The ``dropout_p`` keyword: a real number in [0, 1)."""
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {dropout_p!r} "
                        f"of type {type(dropout_p).__name__}")
    value = float(dropout_p)
    if not 0 <= value < 1:   # NaN fails too
        raise ValueError(f"dropout_p must be in [0, 1), got {value}")
    return value


def check_dropout(dropout_p, seed) -> tuple[float, int | None]:
    """``dropout_p`` (`check_dropout_p`) and ``seed``: None or an int (not a bool) with
    0 <= seed < 2**64, required when dropout_p > 0 and unused otherwise."""
    dropout_p = check_dropout_p(dropout_p)
    if seed is None:
        if dropout_p > 0:
            raise ValueError(f"seed is required when dropout_p > 0 (got dropout_p={dropout_p}): "
                             "an int with 0 <= seed < 2**64")
        return dropout_p, None
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (numbers.Integral, np.integer)):
        raise TypeError(f"seed must be None or an int with 0 <= seed < 2**64, got {seed!r} "
                        f"of type {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int with 0 <= seed < 2**64, got {seed}")
    return dropout_p, seed


@dataclass(frozen=True)
class Modifiers:
    """The score modifiers of one call, checked by `check_modifiers` (docs/contract.md, "Score
    modifiers"): the arrays as given, None where absent; softcap and dropout_p 0.0 when off."""

    softcap: float = 0.0
    bias: object = None
    alibi_slopes: object = None
    sinks: object = None
    dropout_p: float = 0.0
    seed: int | None = None


def check_modifiers(batch_shape, nq: int, nk: int, dtype_name: str | None, *, softcap=None, bias=None,
                    alibi_slopes=None, sinks=None, dropout_p=0.0, seed=None, packed: bool = False) -> Modifiers:
    """Checks the score modifiers of an attention, attention_backward or attention_vjp call, for
    the GPU functions and cuflash.reference alike: `check_softcap`, `check_bias` (refused with
    packed sequences), `check_per_entry` for alibi_slopes and sinks, `check_dropout`. The arrays
    are NumPy or CuPy arrays whose type the caller has checked; only shapes and dtypes are read."""
    softcap = check_softcap(softcap)
    if bias is not None:
        if packed:
            raise ValueError("bias is not taken with packed sequences (cu_seqlens_q, cu_seqlens_k), "
                             f"got a bias of shape {tuple(bias.shape)}")
        check_bias(bias, batch_shape, nq, nk, dtype_name)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            check_per_entry(name, x, batch_shape)
    dropout_p, seed = check_dropout(dropout_p, seed)
    return Modifiers(softcap, bias, alibi_slopes, sinks, dropout_p, seed)


def check_block_mask(batch_shape, nq, nk, block) -> tuple[tuple, int, int, tuple[int, int]]:
    """block_mask's sizes as ints (batch_shape, nq, nk, block), or ValueError naming the one
    that is not a non-negative int (block: two positive ones)."""
    batch_shape = tuple(batch_shape)
    named = [(f"batch_shape[{i}]", n) for i, n in enumerate(batch_shape)] + [("nq", nq), ("nk", nk)]
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise ValueError(f"block must be two positive ints (rows, keys), got {block!r}")
    named += [("block[0]", block[0]), ("block[1]", block[1])]
    for name, n in named:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (numbers.Integral, np.integer)) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    if block[0] < 1 or block[1] < 1:
        raise ValueError(f"block must be two positive ints (rows, keys), got {block!r}")
    return tuple(int(n) for n in batch_shape), int(nq), int(nk), (int(block[0]), int(block[1]))


def block_mask_function(mask_mod, block_mask):
    """The mask function of a call given ``block_mask`` (a BlockMask of `cuflash.block_mask` or
    `cuflash.reference.block_mask`): the one it was built from. TypeError for anything else;
    ValueError for one without a mask function, or beside a different ``mask_mod``."""
    if block_mask is None:
        return mask_mod
    if not isinstance(block_mask, _block_mask_class()):
        raise TypeError(f"block_mask must be a BlockMask of cuflash.block_mask, got {type(block_mask).__name__}")
    if block_mask.mask_mod is None:
        raise ValueError("block_mask has no mask function: build it with cuflash.block_mask(mask_mod, ...)")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError("mask_mod is not the function block_mask was built from: pass block_mask alone "
                         "(it carries its mask_mod)")
    return block_mask.mask_mod


@functools.cache
def _block_mask_class():
    from .reference import BlockMask   # (here, not above: reference imports this module)

    return BlockMask


def check_block_mask_fits(block_mask, batch_shape, nq, nk) -> None:
    """ValueError unless ``block_mask`` (None: nothing to check) was built for ``(nq, nk)`` and a
    batch that broadcasts to ``batch_shape`` without enlarging it, its kinds int8 of one entry
    per block."""
    if block_mask is None:
        return
    if tuple(block_mask.shape) != (nq, nk):
        raise ValueError(f"block_mask was built for (Nq, Nk) = {tuple(block_mask.shape)}, but the call has "
                         f"({nq}, {nk})")
    rows, keys = _block_of(block_mask.block, nq, nk)
    kinds, blocks = block_mask.kinds, (-(-nq // rows), -(-nk // keys))
    if kinds.dtype != np.int8 or kinds.ndim < 2 or tuple(kinds.shape[-2:]) != blocks:
        raise ValueError(f"block_mask.kinds must be int8 of shape batch + {blocks}, got {kinds.dtype} "
                         f"{tuple(kinds.shape)}")
    batch = tuple(kinds.shape[:-2])
    if len(batch) > len(batch_shape) or any(n not in (1, m) for n, m in zip(batch[::-1], batch_shape[::-1])):
        raise ValueError(f"block_mask's batch shape {batch} does not broadcast to the call's {tuple(batch_shape)}")


def _block_of(block, nq, nk) -> tuple[int, int]:
    """A block mask's ``block`` as two positive ints, or `check_block_mask`'s ValueError: at
    little cost where it is a tuple of two (each call with a block mask checks it)."""
    if type(block) is tuple and len(block) == 2:
        rows, keys = block
        if type(rows) is int and type(keys) is int and rows > 0 and keys > 0:
            return block
    return check_block_mask((), nq, nk, block)[3]


def check_head_dim(name: str, axis: str, n: int) -> None:
    if n > MAX_HEAD_DIM:
        raise ValueError(f"{name} has {axis} {n}; cuflash supports head dims up to {MAX_HEAD_DIM}")


def pad_head_dim(xp, x):
    """x with its last axis zero-padded to a multiple of HEAD_DIM_MULTIPLE, or x itself.

    The kernels move rows in 16-byte chunks; zero columns change no score q.k and give
    zero output columns, which the callers slice off (as FlashAttention-2 pads). Dims
    that x broadcasts along (stride 0) stay broadcast. ``xp`` is numpy or cupy.
    """
    n = x.shape[-1]
    width = -(-n // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE
    if width == n:
        return x
    compact = x[tuple(slice(0, 1) if s == 0 else slice(None) for s in x.strides[:-1])]
    padded = xp.zeros(compact.shape[:-1] + (width,), dtype=x.dtype)
    padded[..., :n] = compact
    return xp.broadcast_to(padded, x.shape[:-1] + (width,))


class CuPyMissingError(ImportError, RuntimeError):
    """CuPy is not installed or cannot be imported: an ImportError (docs/contract.md), and a
    RuntimeError like every other reason `require_gpu` gives, so one ``except`` catches all."""


def _no_gpu_message(problem: str) -> str:
    """The one message of every error saying why the GPU functions cannot run."""
    return (
        f"cuflash's GPU functions need an NVIDIA GPU: {problem}. "
        "cuflash.reference runs the same computation with NumPy on the CPU."
    )


def require_cupy():
    """The cupy module, or a CuPyMissingError saying how to install it."""
    try:
        import cupy
    except ImportError as err:
        raise CuPyMissingError(_no_gpu_message(_gpu.cupy_import_problem(err))) from err
    return cupy


def require_gpu() -> None:
    """Raises, saying exactly what is missing, when the GPU functions cannot run: without CuPy
    the CuPyMissingError of every GPU function (`require_cupy`), else RuntimeError."""
    problem = _gpu.problem()
    if problem:
        require_cupy()
        raise RuntimeError(_no_gpu_message(problem))


def _type_name(x) -> str:
    kind = type(x)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def conversion_hint(name: str, x) -> str:
    """How to turn ``x``, given as argument ``name``, into a CuPy array."""
    if type(x).__module__.split(".")[0] == "torch":
        return f"cupy.from_dlpack({name}) (zero-copy; the tensor must be on a CUDA device, e.g. {name}.cuda())"
    # NumPy arrays also have __dlpack__, but their memory is on the host: they need a copy.
    if not isinstance(x, (np.ndarray, np.generic)):
        if hasattr(x, "__dlpack__"):  # JAX arrays and others
            return f"cupy.from_dlpack({name}) (zero-copy)"
        if hasattr(x, "__cuda_array_interface__"):  # cupy.asarray reads it without a copy
            return f"cupy.asarray({name}) (zero-copy)"
    return f"cupy.asarray({name})"


def check_cupy(cupy, **arrays) -> None:
    """Raises TypeError, saying how to convert it, for the first argument that is not a CuPy array."""
    for name, x in arrays.items():
        if not isinstance(x, cupy.ndarray):
            raise TypeError(
                f"{name} must be a cupy.ndarray, got {_type_name(x)}; convert it with {conversion_hint(name, x)}"
            )


def _listing(words, last: str = "or") -> str:
    """'a', 'a or b', 'a, b or c'."""
    *rest, final = words
    return f"{', '.join(rest)} {last} {final}" if rest else final


def check_dtypes(**dtypes) -> str:
    """Checks the dtypes of the arguments (by name) are one supported dtype; returns its name.

    Takes dtypes, not arrays, so that it runs without a GPU.
    """
    first = next(iter(dtypes.values()))
    name = _SUPPORTED_NAMES.get(first)
    if name is not None and all(dt is first or dt == first for dt in dtypes.values()):
        return name   # the usual case, checked without building any names
    dtypes = {name: np.dtype(dt) for name, dt in dtypes.items()}
    for name, dt in dtypes.items():
        if dt.name in SUPPORTED_DTYPES:
            _SUPPORTED_NAMES[dt] = dt.name
        else:
            raise TypeError(
                f"{name} must have dtype {_listing(SUPPORTED_DTYPES)}, got {dt.name} "
                f"(cast it, e.g. {name}.astype(cupy.float32))"
            )
    if len(set(dtypes.values())) > 1:
        raise TypeError(
            f"{_listing(dtypes, 'and')} must share one dtype, got "
            + ", ".join(f"{name}.dtype={dt.name}" for name, dt in dtypes.items())
        )
    return next(iter(dtypes.values())).name


def check_devices(**arrays) -> None:
    devices = {name: x.device.id for name, x in arrays.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(
            "all arrays must be on one device, got "
            + ", ".join(f"{name} on device {d}" for name, d in devices.items())
        )


@dataclass(frozen=True)
class Packed:
    """Packed variable-length sequences as the kernels read them (docs/contract.md)."""

    cu_seqlens_q: object  # int32 CuPy arrays of S + 1 offsets, contiguous
    cu_seqlens_k: object
    num_seqs: int


def query_group(batch_shape, shapes, kernel_shape, kernel_strides) -> tuple[int, int, int] | None:
    """Native grouped-query attention: (kernel batch dim, size, q's stride along it) of the
    one dim along which k and v are broadcast (size 1, or missing) and q is not, or None.

    The dim may merge several of the given ones (heads and groups, say); it must be the only
    kernel dim where k and v do not move, so that each K/V entry of the other dims has its
    own gradient rows. Other patterns (k broadcast but not v, broadcasts along separate dims,
    views expanded with stride 0) take the general path: gradients summed after the kernels.
    """
    nd = len(batch_shape)
    _, k_sizes, v_sizes = ((1,) * (nd - len(s) + 2) + tuple(s[:-2]) for s in shapes)
    grouped = []
    for i, n in enumerate(batch_shape):
        if n == 1:
            continue
        if (k_sizes[i] == 1) != (v_sizes[i] == 1):
            return None
        if k_sizes[i] == 1:
            grouped.append(i)
    if not grouped:
        return None
    size = math.prod(batch_shape[i] for i in grouped)
    _, k_strides, v_strides = kernel_strides
    still = [j for j in range(len(kernel_shape)) if k_strides[j] == 0 and v_strides[j] == 0]
    if len(still) != 1 or kernel_shape[still[0]] != size:
        return None
    return still[0], size, kernel_strides[0][still[0]]


def packed_inputs(cupy, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check) -> Packed | None:
    """Checks the packed-sequence arguments of a GPU call (docs/contract.md); None when dense.

    With ``check`` the offsets are copied to the host in one transfer and validated as in
    `packed_sequences`; without it nothing is read back, and the kernels clamp every offset.
    """
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if max_seqlen_q is not None or max_seqlen_k is not None:
            raise ValueError("max_seqlen_q and max_seqlen_k go with cu_seqlens_q and cu_seqlens_k")
        return None
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together: give both or neither")
    check_flag("check", check)
    check_cupy(cupy, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != np.int32 or cu.ndim != 1 or cu.size < 1:
            raise TypeError(
                f"{name} must be a 1-dim int32 array of shape (S + 1,), got dtype {cu.dtype} and shape {cu.shape}"
            )
    if cu_seqlens_q.size != cu_seqlens_k.size:
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must have the same length (S + 1), got "
            f"{cu_seqlens_q.size} and {cu_seqlens_k.size}"
        )
    check_devices(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    total_q, total_k = q.shape[-2], k.shape[-2]
    if check:
        host = cupy.concatenate((cu_seqlens_q, cu_seqlens_k)).get()   # one synchronization
        n = cu_seqlens_q.size
        packed_sequences(host[:n], host[n:], total_q, total_k, max_seqlen_q, max_seqlen_k, True)
    else:
        _check_max_seqlen("max_seqlen_q", max_seqlen_q)
        _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    return Packed(cupy.ascontiguousarray(cu_seqlens_q), cupy.ascontiguousarray(cu_seqlens_k), cu_seqlens_q.size - 1)


@dataclass
class AttnInputs:
    """Validated forward inputs, laid out for a kernel launch."""

    q: object
    k: object
    v: object
    dtype_name: str
    batch_shape: tuple[int, ...]  # broadcast batch dims, as the user sees them
    nq: int
    nk: int
    d: int  # head dims as the kernels see them: padded to a multiple of HEAD_DIM_MULTIPLE
    dv: int
    given_dv: int  # v's head dim as given (out has it)
    left: int | None
    right: int | None
    scale: float
    row_strides: tuple[int, int, int]  # elements between rows of q, k, v
    kernel_batch_shape: tuple[int, ...]  # batch dims after merging, <= MAX_BATCH_DIMS
    kernel_batch_strides: tuple[tuple[int, ...], ...]  # per tensor, 0 where broadcast
    # (kernel batch dim, size, q's stride) of the query heads that share each K/V head, or None
    group: tuple[int, int, int] | None = None
    packed: Packed | None = None  # packed variable-length sequences along axis -2
    mods: object = None  # the score modifiers (_mods.ScoreMods), None: none
    user: object = None  # the call's score and mask functions (_user.UserMods), None: none

    @property
    def batch_size(self) -> int:
        return math.prod(self.batch_shape)


def _kernel_ready(cupy, x):
    """x itself if the kernels can read it in place, else a contiguous copy.

    In place needs a contiguous last axis and rows aligned to 16 bytes (the
    kernels move 16-byte chunks); strided views such as a (B, N, H, D) array
    transposed to (B, H, N, D) qualify.
    """
    item = x.itemsize
    if x.flags.c_contiguous:
        # rows of a multiple of 8 elements (pad_head_dim) stay 16-byte aligned; a
        # contiguous view that starts off a 16-byte boundary is copied (fresh memory is aligned)
        return x if x.data.ptr % 16 == 0 else x.copy()
    aligned = x.data.ptr % 16 == 0 and all(
        (s // item) * item == s and (s // item) % (16 // item) == 0 for s, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1
    )
    if (x.shape[-1] <= 1 or x.strides[-1] == item) and aligned:
        return x
    return cupy.ascontiguousarray(x)


def kernel_batch_layout(batch_shape, arrays):
    """Merges batch dims where every tensor allows it; strides in elements, 0 where broadcast."""
    n = math.prod(batch_shape)
    if n > 0 and all(x.shape[:-2] == batch_shape and x.flags.c_contiguous for x in arrays):
        # the usual case: contiguous tensors of one batch shape, one dim (none if n is 1)
        if n == 1:
            return (), tuple(() for _ in arrays)
        return (n,), tuple((x.shape[-2] * x.shape[-1],) for x in arrays)
    nd = len(batch_shape)
    strides = []
    for x in arrays:
        pad = nd - (x.ndim - 2)
        per = [0] * nd
        for i in range(x.ndim - 2):
            if x.shape[i] != 1:
                per[pad + i] = x.strides[i] // x.itemsize
        strides.append(per)
    dims = [(n, [s[i] for s in strides]) for i, n in enumerate(batch_shape) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, st in dims:
        if merged:
            n0, st0 = merged[-1]
            if all(a == b * n for a, b in zip(st0, st)):
                merged[-1] = (n0 * n, st)
                continue
        merged.append((n, st))
    if len(merged) > MAX_BATCH_DIMS:
        raise ValueError(
            f"the broadcast batch shape {tuple(batch_shape)} with these strides needs {len(merged)} "
            f"batch dims; cuflash handles up to {MAX_BATCH_DIMS} (make the inputs contiguous)"
        )
    shape = tuple(n for n, _ in merged)
    per_tensor = tuple(tuple(st[j] for _, st in merged) for j in range(len(arrays)))
    return shape, per_tensor


def attention_inputs(q, k, v, causal, window, scale, packed=None, **more) -> AttnInputs:
    """Checks the inputs of a forward or backward call; returns them laid out for a launch.

    ``packed`` holds the packed-sequence keywords (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, check), checked by `packed_inputs`. ``more`` holds the backward's other
    arrays (dout, out, lse): their types are checked here with q, k, v, before the GPU is
    looked for, and their devices with q's; `backward_arrays` checks the rest.
    """
    cupy = require_cupy()
    # Types first: a non-CuPy input on a machine without a GPU gets the conversion hint,
    # not the no-GPU error (and no CuPy array exists without a GPU).
    check_cupy(cupy, q=q, k=k, v=v, **more)
    require_gpu()
    dtype_name = check_dtypes(q=q.dtype, k=k.dtype, v=v.dtype)
    check_devices(q=q, k=k, v=v, **more)
    batch_shape = check_shapes(q.shape, k.shape, v.shape)
    nq, d = q.shape[-2:]
    nk, dv = v.shape[-2:]
    left, right = normalize_window(causal, window)
    scale = check_scale(scale, d)   # of the head dim as given, not as padded
    sequences = packed_inputs(cupy, q, k, **packed) if packed else None
    shapes = (q.shape, k.shape, v.shape)
    q, k, v = (_kernel_ready(cupy, pad_head_dim(cupy, x)) for x in (q, k, v))
    kshape, kstrides = kernel_batch_layout(batch_shape, (q, k, v))
    row_strides = tuple(x.strides[-2] // x.itemsize for x in (q, k, v))
    return AttnInputs(
        q, k, v, dtype_name, batch_shape, nq, nk, q.shape[-1], v.shape[-1], dv, left, right, scale,
        row_strides, kshape, kstrides, query_group(batch_shape, shapes, kshape, kstrides), sequences,
    )


def check_backward_arrays(batch_shape, nq: int, dv: int, dtype, **given) -> None:
    """Checks out, dout and lse, each given as (shape, dtype), against what the forward
    returns for these q, k, v: out and dout broadcast(batch) + (Nq, Dv) in the inputs'
    dtype, lse broadcast(batch) + (Nq,) in float32. With ``dtype`` None (cuflash.reference,
    which takes any real dtype) the shapes only.

    Takes shapes and dtypes, not arrays, so that it runs without a GPU.
    """
    out_shape = tuple(batch_shape) + (nq, dv)
    want = {
        "out": (out_shape, dtype, "as attention(q, k, v) returns it"),
        "dout": (out_shape, dtype, "those of out"),
        "lse": (out_shape[:-1], np.float32, "as attention(q, k, v, return_lse=True) returns it"),
    }
    for name, (shape, dt) in given.items():
        want_shape, want_dtype, why = want[name]
        if dtype is None:
            if tuple(shape) != want_shape:
                raise ValueError(f"{name} must have shape {want_shape} ({why}), got shape {tuple(shape)}")
            continue
        want_dtype = np.dtype(want_dtype)
        if tuple(shape) != want_shape or np.dtype(dt) != want_dtype:
            raise ValueError(
                f"{name} must have shape {want_shape} and dtype {want_dtype.name} ({why}), "
                f"got shape {tuple(shape)} and dtype {np.dtype(dt).name}"
            )


def backward_arrays(cupy, x: AttnInputs, **arrays):
    """Checks out, dout and lse (see `check_backward_arrays`); returns them contiguous and
    16-byte aligned, in the order given.

    Their types and devices were checked by `attention_inputs`.
    """
    check_backward_arrays(x.batch_shape, x.nq, x.given_dv, x.q.dtype, **{n: (a.shape, a.dtype) for n, a in arrays.items()})
    padded = (a if n == "lse" else pad_head_dim(cupy, a) for n, a in arrays.items())   # out, dout: to dv
    return tuple(_kernel_ready(cupy, cupy.ascontiguousarray(a)) for a in padded)


def _check_max_seqlen(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)) or value < 0:
        raise TypeError(f"{name} must be None or a non-negative int, got {value!r}")
    return int(value)


def packed_sequences(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int,
                     max_seqlen_q=None, max_seqlen_k=None, check: bool = True) -> list[tuple[int, int, int, int]]:
    """The query and key row ranges ``(q0, q1, k0, k1)`` of each packed sequence.

    ``cu_seqlens_q`` and ``cu_seqlens_k`` are host (NumPy) int32 arrays of shape (S + 1,):
    sequence s owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` and key rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]`` of axis -2. With ``check`` they must start at 0,
    never decrease and end at ``total_q`` and ``total_k``, and no sequence may be longer than
    ``max_seqlen_q`` / ``max_seqlen_k`` where given; a ValueError names the array and the
    first bad position. Without ``check`` every offset is clamped to ``[0, total]`` and a
    sequence whose end lies before its start is empty, so no range leaves the arrays.
    """
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    arrays = {}
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        cu = np.asarray(cu)
        if cu.dtype != np.int32 or cu.ndim != 1 or cu.size < 1:
            raise TypeError(
                f"{name} must be a 1-dim int32 array of shape (S + 1,), got dtype {cu.dtype} and shape {cu.shape}"
            )
        arrays[name] = cu.astype(np.int64)
    cu_q, cu_k = arrays.values()
    if cu_q.size != cu_k.size:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (S + 1), got {cu_q.size} and {cu_k.size}"
        )
    if check:
        for name, cu, total, axis_name, longest in (
            ("cu_seqlens_q", cu_q, total_q, "q", max_seqlen_q),
            ("cu_seqlens_k", cu_k, total_k, "k", max_seqlen_k),
        ):
            _check_offsets(name, cu, total, axis_name, longest)
    else:
        cu_q, cu_k = np.clip(cu_q, 0, total_q), np.clip(cu_k, 0, total_k)
    return [
        (int(cu_q[s]), int(max(cu_q[s], cu_q[s + 1])), int(cu_k[s]), int(max(cu_k[s], cu_k[s + 1])))
        for s in range(cu_q.size - 1)
    ]


def _check_offsets(name: str, cu, total: int, axis_name: str, longest) -> None:
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    steps = np.diff(cu)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0)) + 1
        raise ValueError(f"{name} must not decrease, got {name}[{i}] = {cu[i]} after {name}[{i - 1}] = {cu[i - 1]}")
    if cu[-1] != total:
        raise ValueError(
            f"{name} must end at {axis_name}.shape[-2] = {total}, got {name}[{cu.size - 1}] = {cu[-1]}"
        )
    if longest is not None and steps.size and steps.max() > longest:
        s = int(np.argmax(steps > longest))
        max_name = "max_seqlen_" + name[-1]
        raise ValueError(f"{max_name} = {longest} is less than the length {steps[s]} of sequence {s} in {name}")


def host_cache_seqlens(cache_seqlens, batch: int, default) -> np.ndarray:
    """``cache_seqlens`` of a KV-cache call given on the host (a Python int or a NumPy integer
    array of shape (B,)), as int64 of shape (B,); ``default`` (an int, or None: required) when
    it is None."""
    if cache_seqlens is None:
        if default is None:
            raise ValueError("cache_seqlens is required with block_table (the keys already in each sequence's pages)")
        cache_seqlens = default
    if isinstance(cache_seqlens, (bool, np.bool_)):
        raise TypeError(f"cache_seqlens must be an int or an int array of shape ({batch},), got {cache_seqlens!r}")
    if isinstance(cache_seqlens, (numbers.Integral, np.integer)):
        return np.full(batch, int(cache_seqlens), dtype=np.int64)
    seqlens = np.asarray(cache_seqlens)
    if seqlens.dtype.kind not in "iu" or seqlens.shape != (batch,):
        raise TypeError(
            f"cache_seqlens must be an int or an int array of shape ({batch},), "
            f"got dtype {seqlens.dtype} and shape {seqlens.shape}"
        )
    return seqlens.astype(np.int64)


def kvcache_lengths(seqlens, n_new: int, capacity: int, block_table, num_pages: int, page_size: int,
                    check: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The keys each sequence holds once its ``n_new`` new keys are appended, and the page
    table to reach them (paged caches; None otherwise), both host arrays.

    With ``check``, a sequence that would run past its cache (``capacity`` keys: Nmax, or its
    row of ``block_table`` times ``page_size``), a negative ``cache_seqlens`` or a page it uses
    outside ``[0, num_pages)`` raises ValueError naming the sequence. Without it, lengths are
    clamped to ``[0, capacity]`` and pages to ``[0, num_pages)``, so no key lies outside the
    arrays (new keys past the end of a cache are dropped)."""
    if check:
        bad = np.flatnonzero(seqlens < 0)
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cache_seqlens[{b}] = {seqlens[b]} is negative")
        over = np.flatnonzero(seqlens + n_new > capacity)
        if over.size:
            b = int(over[0])
            raise ValueError(
                f"sequence {b} would run past its cache: cache_seqlens[{b}] = {seqlens[b]} plus {n_new} new "
                f"keys is more than the {capacity} keys it can hold"
            )
    lengths = np.clip(seqlens + n_new, 0, capacity)
    if block_table is None:
        return lengths, None
    pages = np.asarray(block_table).astype(np.int64)
    if check:
        for b, n in enumerate(lengths):
            used = pages[b, : -(-int(n) // page_size)]
            outside = np.flatnonzero((used < 0) | (used >= num_pages))
            if outside.size:
                j = int(outside[0])
                raise ValueError(
                    f"block_table[{b}, {j}] = {used[j]} is not a page of the cache (0 to {num_pages - 1})"
                )
    return lengths, np.clip(pages, 0, num_pages - 1)


def merge_parts(outs, lses, array):
    """The parts of a merge_attention call (sequences, or arrays whose first axis indexes
    them) as two lists, checked for the GPU function and cuflash.reference alike: at least one
    part, as many lses as outs, the outs of one shape (..., Nq, Dv), the lses of that shape
    but the last axis. ``array(name, x)`` checks the type of each array given and returns it
    as the caller computes with it."""
    parts = {}
    for name, given in (("outs", outs), ("lses", lses)):
        if isinstance(given, (list, tuple)):
            if not given:
                raise ValueError(f"{name} must hold at least one part, got an empty {type(given).__name__}")
            parts[name] = [array(f"{name}[{i}]", x) for i, x in enumerate(given)]
        else:
            given = array(name, given)
            if given.ndim < 1 or given.shape[0] < 1:
                raise ValueError(f"{name} must have a first axis of parts (at least one), got shape {given.shape}")
            parts[name] = list(given)
    outs, lses = parts["outs"], parts["lses"]
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must hold the same number of parts, got {len(outs)} and {len(lses)}")
    first = outs[0]
    for i, (o, x) in enumerate(zip(outs, lses)):
        if o.ndim < 2 or o.shape != first.shape:
            raise ValueError(f"every part of outs must have the shape (..., Nq, Dv) of outs[0], {first.shape}, "
                             f"got outs[{i}].shape = {o.shape}")
        if x.shape != first.shape[:-1]:
            raise ValueError(f"lses[{i}] must have shape {first.shape[:-1]}, got {x.shape}")
    return outs, lses


def merge_inputs(cupy, outs, lses):
    """The parts of a merge_attention call as two lists of contiguous CuPy arrays, checked:
    `merge_parts`, then a supported dtype for the outs, float32 lses, one device."""

    def cupy_array(name, x):
        check_cupy(cupy, **{name: x})
        return x

    outs, lses = merge_parts(outs, lses, cupy_array)
    require_gpu()
    check_dtypes(**{f"outs[{i}]": o.dtype for i, o in enumerate(outs)})
    for i, x in enumerate(lses):
        if x.dtype != np.float32:
            raise ValueError(f"lses[{i}] must be float32 (as attention(..., return_lse=True) returns it), got {x.dtype}")
    check_devices(**{f"outs[{i}]": o for i, o in enumerate(outs)}, **{f"lses[{i}]": x for i, x in enumerate(lses)})
    return [cupy.ascontiguousarray(o) for o in outs], [cupy.ascontiguousarray(x) for x in lses]


@dataclass
class KVCacheInputs:
    """A checked attention_kvcache call, as the kernels read it (kernels/decode/decode.cuh)."""

    q: object                 # (B, E, G * Nq, D), contiguous
    k: object                 # the caches themselves, written and read in place
    v: object
    k_strides: tuple          # (sequence or page, entry, row), in elements
    v_strides: tuple
    k_new: object | None      # (B, E, Nnew, D), contiguous
    v_new: object | None
    seqlens: object | None    # CuPy int32 (B,), or None: seqlen_all for every sequence
    seqlen_all: int
    block_table: object | None  # CuPy int32 (B, max_pages), contiguous
    batch: int
    entries: int
    group: int
    nq: int
    n_new: int
    d: int
    dv: int
    capacity: int
    page_size: int
    num_pages: int
    left: int | None
    right: int | None
    scale: float
    num_splits: int | None
    longest: int              # an upper bound on any sequence's keys (for the split)
    dtype_name: str
    out_shape: tuple          # (B, ..., Nq, Dv)
    mods: object = None       # the score modifiers (_mods.ScoreMods), per query head of (B, ...)
    user: object = None       # the call's score and mask functions (_user.UserMods), None: none


def check_num_splits(num_splits) -> int | None:
    """The ``num_splits`` of an attention_kvcache call: None or a positive int."""
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (numbers.Integral, np.integer)) \
            or num_splits < 1:
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    return int(num_splits)


@dataclass(frozen=True)
class KVCacheShapes:
    """What the shapes of an attention_kvcache call say (see `kvcache_shapes`)."""

    mid_q: tuple      # q's dims between B and Nq
    mid_c: tuple      # the caches' dims between the first and the last two
    group: int        # query heads per K/V head, along the last of mid_q (1: no grouping)
    n_new: int
    capacity: int     # the keys each sequence's cache holds
    rows: int         # the caches' rows: Nmax, or the page size
    num_pages: int    # the caches' first dim


def kvcache_shapes(q_shape, k_shape, v_shape, new_shapes, block_table, itemsize: int, dtype_name: str) -> KVCacheShapes:
    """Checks the shapes of an attention_kvcache call, for the GPU function and cuflash.reference
    alike (docs/contract.md): ``new_shapes`` is None or the shapes of (k_new, v_new),
    ``block_table`` None or an int array (NumPy or CuPy), ``itemsize`` and ``dtype_name`` those
    of q's dtype (the rows the kernels move)."""
    if len(q_shape) < 3 or len(k_shape) != len(q_shape) or len(v_shape) != len(q_shape):
        raise ValueError(f"q (B, ..., Nq, D) and the caches (B or pages, ..., rows, D) must have one number of dims, "
                         f"at least 3, got shapes {q_shape}, {k_shape} and {v_shape}")
    if k_shape[:-1] != v_shape[:-1]:
        raise ValueError(f"k_cache and v_cache must agree but in the last dim, got {k_shape} and {v_shape}")
    batch, d, dv, rows = q_shape[0], q_shape[-1], v_shape[-1], k_shape[-2]
    if k_shape[-1] != d:
        raise ValueError(f"q and k_cache must have one head dim, got {d} and {k_shape[-1]}")
    for name, n in (("D", d), ("Dv", dv)):
        if n < 1 or n > 256 or (n * itemsize) % 16:
            raise ValueError(f"attention_kvcache takes head dims of whole 16-byte rows up to 256 ({16 // itemsize}, "
                             f"{32 // itemsize}, ... for {dtype_name}), got {name} = {n}")
    mid_q, mid_c = tuple(q_shape[1:-2]), tuple(k_shape[1:-2])
    try:
        np.broadcast_shapes(mid_q, mid_c)
    except ValueError:
        raise ValueError(f"the dims of q between B and Nq, {mid_q}, do not broadcast against the caches', {mid_c}") from None
    if np.broadcast_shapes(mid_q, mid_c) != mid_q:
        raise ValueError(f"q's dims {mid_q} must hold the caches' {mid_c} (q is not broadcast)")
    grouped = [i for i, (a, c) in enumerate(zip(mid_q, mid_c)) if c == 1 and a > 1]
    if len(grouped) > 1 or (grouped and grouped[0] != len(mid_q) - 1):
        raise ValueError(f"attention_kvcache groups query heads along the last dim before Nq only (q (B, Hkv, G, Nq, D) "
                         f"against caches (., Hkv, 1, rows, D)), got q dims {mid_q} against {mid_c}")
    n_new = 0
    if new_shapes is not None:
        k_new_shape, v_new_shape = (tuple(s) for s in new_shapes)
        n_new = k_new_shape[-2] if len(k_new_shape) == len(q_shape) else -1
        want_k, want_v = (batch,) + mid_c + (n_new, d), (batch,) + mid_c + (n_new, dv)
        if k_new_shape != want_k or v_new_shape != want_v:
            raise ValueError(f"k_new and v_new must be (B, <the caches' dims>, Nnew, D / Dv): {want_k[:-2]} + (Nnew, D), "
                             f"got {k_new_shape} and {v_new_shape}")
    if block_table is not None:
        if block_table.dtype.kind not in "iu" or block_table.ndim != 2 or block_table.shape[0] != batch:
            raise TypeError(f"block_table must be an int array of shape ({batch}, max_pages), got dtype "
                            f"{block_table.dtype} and shape {block_table.shape}")
        capacity, num_pages = block_table.shape[1] * rows, k_shape[0]
    else:
        if k_shape[0] != batch:
            raise ValueError(f"k_cache must hold one cache per sequence of q: {batch}, got {k_shape[0]}")
        capacity, num_pages = rows, batch
    return KVCacheShapes(mid_q, mid_c, mid_q[-1] if grouped else 1, n_new, capacity, rows, num_pages)


def _merged_axis(shape, strides, name):
    """The stride of dims ``shape`` viewed as one axis (dims of size 1 ignored), or raise."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    for (n0, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            raise ValueError(f"{name}: the dims between its first and its last two must be one strided axis "
                             f"(as in a (P, H, rows, D) array or a view of one), got shape {shape} and strides {strides}")
    return dims[-1][1] if dims else 0


def kvcache_inputs(cupy, q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, causal, window, scale,
                   num_splits, check) -> KVCacheInputs:
    """Checks an attention_kvcache call; with ``check``, every length and page, before
    anything is written (ValueError naming the sequence)."""
    check_cupy(cupy, q=q, k_cache=k_cache, v_cache=v_cache)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: give both or neither")
    if k_new is not None:
        check_cupy(cupy, k_new=k_new, v_new=v_new)
    require_gpu()
    dtype_name = check_dtypes(q=q.dtype, k_cache=k_cache.dtype, v_cache=v_cache.dtype,
                              **({} if k_new is None else {"k_new": k_new.dtype, "v_new": v_new.dtype}))
    check_devices(q=q, k_cache=k_cache, v_cache=v_cache, **({} if k_new is None else {"k_new": k_new, "v_new": v_new}))
    left, right = normalize_window(causal, window)
    num_splits = check_num_splits(num_splits)
    if block_table is not None and not isinstance(block_table, (np.ndarray, cupy.ndarray)):
        raise TypeError(f"block_table must be a NumPy or CuPy int array, got {_type_name(block_table)}")
    shapes = kvcache_shapes(q.shape, k_cache.shape, v_cache.shape, None if k_new is None else (k_new.shape, v_new.shape),
                            block_table, q.dtype.itemsize, dtype_name)
    batch, nq, d, dv = q.shape[0], q.shape[-2], q.shape[-1], v_cache.shape[-1]
    mid_q, group, n_new, capacity, num_pages = shapes.mid_q, shapes.group, shapes.n_new, shapes.capacity, shapes.num_pages
    rows = page_size = shapes.rows
    itemsize = q.dtype.itemsize
    entry_dims = shapes.mid_c[:-1] if group > 1 else shapes.mid_c
    entries = math.prod(entry_dims)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.size and (x.strides[-1] != itemsize or x.data.ptr % 16 or any(s % 16 for s in x.strides[:-1])):
            raise ValueError(f"{name} must have contiguous rows on 16-byte boundaries (it is written and read in place)")
    strides = {}
    for name, x in (("k", k_cache), ("v", v_cache)):
        mids = x.shape[1:-2][:len(entry_dims)], x.strides[1:-2][:len(entry_dims)]
        strides[name] = (x.strides[0] // itemsize, _merged_axis(*mids, f"{name}_cache") // itemsize,
                         x.strides[-2] // itemsize)
    on_device = isinstance(cache_seqlens, cupy.ndarray)
    if on_device and (cache_seqlens.dtype.kind not in "iu" or cache_seqlens.shape != (batch,)):
        raise TypeError(f"cache_seqlens must be an int or an int array of shape ({batch},), "
                        f"got dtype {cache_seqlens.dtype} and shape {cache_seqlens.shape}")
    host_lengths = None
    if check or not on_device:
        given = cupy.asnumpy(cache_seqlens) if on_device else cache_seqlens
        seqlens = host_cache_seqlens(given, batch, None if block_table is not None else rows)
        table = None
        if block_table is not None:
            table = cupy.asnumpy(block_table) if isinstance(block_table, cupy.ndarray) else np.asarray(block_table)
        host_lengths, _ = kvcache_lengths(seqlens, n_new, capacity, table, num_pages, page_size, bool(check))
    seqlen_all, device_seqlens = 0, None
    if on_device:
        device_seqlens = cupy.ascontiguousarray(cache_seqlens, dtype=cupy.int32)
    elif isinstance(cache_seqlens, (numbers.Integral, np.integer)) or cache_seqlens is None:
        seqlen_all = int(rows if cache_seqlens is None else cache_seqlens)
        seqlen_all = min(max(seqlen_all, -2**31), 2**31 - 1)
    else:
        device_seqlens = cupy.asarray(np.clip(np.asarray(cache_seqlens), -2**31, 2**31 - 1).astype(np.int32))
    table = None
    if block_table is not None:
        table = cupy.ascontiguousarray(cupy.asarray(block_table), dtype=cupy.int32)
    longest = capacity if host_lengths is None else int(host_lengths.max(initial=0))
    qk = cupy.ascontiguousarray(q).reshape(batch, entries, group * nq, d)
    news = (None, None) if k_new is None else (
        cupy.ascontiguousarray(k_new).reshape(batch, entries, n_new, d),
        cupy.ascontiguousarray(v_new).reshape(batch, entries, n_new, dv))
    out = KVCacheInputs(
        qk, k_cache, v_cache, strides["k"], strides["v"], news[0], news[1], device_seqlens, seqlen_all, table, batch, entries, group, nq, n_new, d, dv,
        capacity, page_size, num_pages, left, right, check_scale(scale, d), num_splits,
        longest, dtype_name, (batch,) + tuple(mid_q) + (nq, dv),
    )
    return out
