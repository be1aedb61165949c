"""Ring attention: the forward, its backward and the handshake that checks a call on every rank.

Each rank holds one shard of q, k and v along axis -2 (`_plan`: contiguous or zigzag). Step t
of P: rank r computes its queries against the K/V shard of rank ``(r - t) mod P`` while that
shard moves on to rank r + 1 and the next one arrives from rank r - 1; partial results merge by
their logsumexp in float32 (float64 on the reference path), in step order, so a given number of
ranks always gives the same bits. The backward sends K/V round the same way, each with float32
dK/dV accumulators that reach their home rank after P steps; dq stays where it is.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers

import numpy as np

from .. import _checks
from .._mask import normalize_window
from . import _plan
from ._comm import MAX_PAYLOAD, RingError

# ALiBi off a piece's own diagonal runs with scores shifted by up to ALIBI_SPAN at a row's
# nearest keys (`_plan`): float32 holds them to ALIBI_SPAN * 2^-24, within the 16-bit types'
# rounding at 1024 and float32's at 32.
ALIBI_SPAN = {"float16": 1024, "bfloat16": 1024, "float32": 32, "float64": 1024}


# ---------------------------------------------------------------------------------------------
# The attention calls: cuflash.reference on NumPy arrays, the GPU functions on CuPy arrays
# ---------------------------------------------------------------------------------------------


class _Backend:
    """One rank's attention calls and array module. ``acc``: the dtype of the merged results
    and of the gradients' sums (float32 on the GPU, float64 in the reference)."""

    def __init__(self, xp):
        self.xp = xp
        self.gpu = xp is not np
        if self.gpu:
            from .._api import attention, attention_backward
        else:
            from ..reference import attention, attention_backward
        self._forward, self._backward = attention, attention_backward
        self.acc = np.float32 if self.gpu else np.float64

    def _keywords(self, call: _plan.Call, opts) -> dict:
        kw = {"window": call.window, "scale": opts.scale, "softcap": opts.softcap}
        if opts.slopes is not None:
            kw["alibi_slopes"] = opts.slopes if call.slope_sign > 0 else opts.negated_slopes
        if call.packed:
            cu_q, cu_k = opts.offsets[call]
            kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
            if self.gpu:
                kw["check"] = False   # offsets made here, valid: no read back to the host
        return kw

    def offsets(self, plans) -> dict:
        """The packed calls' offsets as the attention functions take them, made before the ring
        starts (a copy to the GPU in the middle of the ring would wait for the work queued)."""
        return {call: tuple(self.xp.asarray(np.asarray(x, dtype=np.int32)) for x in call.offsets())
                for steps in plans for call in steps if call.packed}

    def forward(self, q, k, v, call, opts):
        return self._forward(q, k, v, return_lse=True, **self._keywords(call, opts))

    def backward(self, dout, q, k, v, out, lse, call, opts):
        return self._backward(dout, q, k, v, out, lse, deterministic=opts.deterministic,
                              **self._keywords(call, opts))


def _rows(x, rows, matrix=True):
    """Rows ``rows`` of axis -2 (of axis -1 for lse: ``matrix`` False)."""
    return x[..., rows[0]:rows[1], :] if matrix else x[..., rows[0]:rows[1]]


def _flip(x, matrix=True):
    """x reversed along axis -2 (axis -1: ``matrix`` False), as a view."""
    return x[..., ::-1, :] if matrix else x[..., ::-1]


class _Views:
    """A step's arrays as its calls read them: as given, or (mirrored calls) reversed along
    the sequence, copied once when first asked for."""

    def __init__(self, xp, **arrays):
        self.xp, self.arrays, self.flipped = xp, arrays, {}

    def get(self, name, call):
        if not call.mirrored:
            return self.arrays[name]
        if name not in self.flipped:
            self.flipped[name] = self.xp.ascontiguousarray(_flip(self.arrays[name], name != "lse"))
        return self.flipped[name]


def _home(call, span, n):
    """Where a call's rows or keys ``span`` lie in a shard of ``n``: counted from the end for a
    mirrored call (whose results are then reversed back, `_flip`)."""
    return (n - span[1], n - span[0]) if call.mirrored else span


class _Merged:
    """Attention over disjoint key sets merged row by row by their logsumexp:
    ``lse = log(exp(lse_a) + exp(lse_b))``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``."""

    def __init__(self, xp, shape, dtype):
        self.xp = xp
        self.out = xp.zeros(shape, dtype=dtype)
        self.lse = xp.full(shape[:-1], -np.inf, dtype=dtype)

    def _weights(self, lse_a, lse_b):
        xp = self.xp
        top = xp.maximum(lse_a, lse_b)
        seen = xp.isfinite(top)
        base = xp.where(seen, top, 0)
        wa, wb = xp.exp(lse_a - base), xp.exp(lse_b - base)
        total = xp.where(seen, wa + wb, 1)   # at least 1 where seen: the larger term is exp(0)
        return wa / total, wb / total, xp.where(seen, base + xp.log(total), -np.inf)

    def add(self, rows, out, lse):
        acc_out, acc_lse = _rows(self.out, rows), _rows(self.lse, rows, False)
        wa, wb, merged = self._weights(acc_lse, lse.astype(self.lse.dtype))
        acc_out[...] = acc_out * wa[..., None] + out.astype(self.out.dtype) * wb[..., None]
        acc_lse[...] = merged

    def add_sinks(self, sinks):
        """Each row's sink as one more part: a logit ``z`` whose value vector is 0."""
        z = self.xp.broadcast_to(sinks.astype(self.lse.dtype)[..., None], self.lse.shape)
        wa, _, merged = self._weights(self.lse, z)
        self.out *= wa[..., None]
        self.lse[...] = merged


# ---------------------------------------------------------------------------------------------
# The handshake: every rank's arguments, checked alike on every rank before anything is sent
# ---------------------------------------------------------------------------------------------


class _Options:
    """A checked call, as every rank agreed on it."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


_DESCRIBED = {   # the facts every rank must share, in the order they are compared
    "q": "q's shape (but axis -2)", "k": "k's shape (but axis -2)", "v": "v's shape (but axis -2)",
    "dtype": "the dtype", "layout": "layout", "window": "the mask (left, right)", "scale": "scale",
    "softcap": "softcap", "alibi_slopes": "alibi_slopes (shape, values)", "sinks": "sinks (shape, values)",
    "cu_seqlens": "cu_seqlens", "seqlen": "seqlen", "deterministic": "deterministic",
}
_ERRORS = {cls.__name__: cls for cls in (TypeError, ValueError, NotImplementedError)}


def _host(x) -> np.ndarray:
    return np.asarray(x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x)


def _digest(x):
    """(shape, a hash of the values) of a small array, or None."""
    if x is None:
        return None
    h = _host(x)
    return [list(h.shape), hashlib.sha256(np.ascontiguousarray(h).tobytes() + str(h.dtype).encode()).hexdigest()[:16]]


def _without(shape, axis):
    shape = list(shape)
    shape[axis] = None
    return shape


def _check_array(xp, name, x):
    if not isinstance(x, xp.ndarray):
        kind = f"{type(x).__module__.split('.')[0]}.{type(x).__name__}"
        raise TypeError(f"{name} must be a {xp.__name__}.ndarray, the communicator's array module, got {kind}")


def _local_facts(backend, comm, q, k, v, o) -> dict:
    """This rank's checks (the errors of cuflash's own functions) and what the other ranks must
    agree with."""
    xp = backend.xp
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(xp, name, x)
    if backend.gpu:
        dtype = _checks.check_dtypes(q=q.dtype, k=k.dtype, v=v.dtype)
        _checks.check_devices(q=q, k=k, v=v)
        device = getattr(comm, "device", None)
        if device is not None and q.device.id != device:
            raise ValueError(f"q is on device {q.device.id}, but the communicator's rank works on device {device}")
    else:
        if len({x.dtype for x in (q, k, v)}) > 1 or q.dtype.kind not in "fV":
            raise TypeError(f"q, k and v must have one floating dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
        dtype = str(q.dtype)
    batch = _checks.check_shapes(q.shape, k.shape, v.shape)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError("q and k must hold the same positions of the sequence (ring attention is self-attention "
                         f"over one sharded sequence), got q.shape[-2] = {q.shape[-2]} and k.shape[-2] = {k.shape[-2]}")
    left, right = normalize_window(o.causal, o.window)
    scale = _checks.check_scale(o.scale, q.shape[-1])
    softcap = _checks.check_softcap(o.softcap)
    _plan.check_layout(o.layout)
    for name, x in (("alibi_slopes", o.alibi_slopes), ("sinks", o.sinks)):
        if x is not None:
            _check_array(xp, name, x)
            _checks.check_per_entry(name, x, batch)
    if o.cu_seqlens is not None:
        cu = _host(o.cu_seqlens)
        if cu.dtype != np.int32 or cu.ndim != 1 or cu.size < 1:
            raise TypeError(f"cu_seqlens must be a 1-dim int32 array of shape (S + 1,), got dtype {cu.dtype} "
                            f"and shape {cu.shape}")
    if o.seqlen is not None and (isinstance(o.seqlen, bool) or not isinstance(o.seqlen, numbers.Integral)
                                 or o.seqlen < 0):
        raise TypeError(f"seqlen must be None or a non-negative int, got {o.seqlen!r}")
    _checks.check_flag("deterministic", o.deterministic)
    if o.backward is not None:
        dout, out, lse = o.backward
        for name, x in (("dout", dout), ("out", out), ("lse", lse)):
            _check_array(xp, name, x)
        _checks.check_backward_arrays(batch, q.shape[-2], v.shape[-1], q.dtype if backend.gpu else None,
                                      dout=(dout.shape, dout.dtype), out=(out.shape, out.dtype),
                                      lse=(lse.shape, lse.dtype))
    return {"n": q.shape[-2], "q": _without(q.shape, -2), "k": _without(k.shape, -2), "v": _without(v.shape, -2),
            "dtype": dtype, "layout": o.layout, "window": [left, right], "scale": scale, "softcap": softcap,
            "alibi_slopes": _digest(o.alibi_slopes), "sinks": _digest(o.sinks), "cu_seqlens": _digest(o.cu_seqlens),
            "seqlen": None if o.seqlen is None else int(o.seqlen), "deterministic": bool(o.deterministic),
            "batch": list(batch)}


def _payload(rank: int, size: int, error, facts: dict) -> bytes:
    """A rank's part of the handshake as JSON of at most MAX_PAYLOAD bytes: an error's message
    is cut, in whole characters, until it fits (escaped, one character may take 12 bytes)."""
    message = None if error is None else str(error)
    while True:
        said = None if error is None else [type(error).__name__, message]
        mine = json.dumps({"rank": rank, "size": size, "error": said, **facts}).encode()
        if len(mine) <= MAX_PAYLOAD or not message:
            return mine
        message = message[: len(message) // 2]


def _handshake(name, backend, comm, q, k, v, o) -> _Options:
    """Every rank's facts through one allgather, then the same checks on every rank: an error
    on one rank, or ranks that disagree, raise the same error on all of them before any send."""
    error = None
    try:
        facts = _local_facts(backend, comm, q, k, v, o)
    except Exception as err:   # noqa: BLE001 - said to every rank, raised on every rank below
        facts, error = {}, err
    parts = [json.loads(x) for x in comm.allgather_bytes(_payload(comm.rank, comm.size, error, facts))]
    for r, part in enumerate(parts):
        if part["error"] is not None:
            kind, message = part["error"]
            cause = error if r == comm.rank else None
            raise _ERRORS.get(kind, RuntimeError)(f"{name}: rank {r}: {message}") from cause
    size = len(parts)
    for r, part in enumerate(parts):
        if part["rank"] != r or part["size"] != size:
            raise RingError(f"{name}: the communicator is inconsistent: part {r} of {size} came from rank "
                            f"{part['rank']} of a group of {part['size']}")
    for key, what in _DESCRIBED.items():
        for r, part in enumerate(parts):
            if part[key] != parts[0][key]:
                raise ValueError(f"{name}: the ranks disagree on {what}: {parts[0][key]} on rank 0, "
                                 f"{part[key]} on rank {r}")
    lengths = tuple(part["n"] for part in parts)
    total = sum(lengths)
    if o.layout == "zigzag" and (len(set(lengths)) > 1 or lengths[0] % 2):
        raise ValueError(f"{name}: layout='zigzag' needs the same even number of rows on every rank (chunks r and "
                         f"2P - 1 - r of 2P equal chunks), got {list(lengths)}")
    if o.seqlen is not None and o.seqlen != total:
        raise ValueError(f"{name}: the shards of the {size} ranks hold {total} positions, but seqlen = {o.seqlen}: "
                         f"were they cut for another number of ranks?")
    sequences = None
    if o.cu_seqlens is not None:
        cu = _host(o.cu_seqlens)
        try:
            _checks.packed_sequences(cu, cu, total, total)
        except ValueError as err:
            raise ValueError(f"{name}: {err} (cu_seqlens covers the whole sequence: the {total} positions of "
                             f"the {size} ranks' shards)") from None
        sequences = tuple(int(x) for x in cu)
    facts = parts[comm.rank]
    slopes = o.alibi_slopes
    alibi_rows = None
    if slopes is not None:
        steepest = float(np.abs(_host(slopes)).max(initial=0.0))
        if steepest > 0:
            alibi_rows = max(1, math.floor(ALIBI_SPAN.get(facts["dtype"], 32) / steepest))
    lo, hi = _plan.band(*facts["window"])
    segs = [_plan.segments(o.layout, lengths, r) for r in range(size)]
    plans = [_plan.plan_block(segs[comm.rank], segs[(comm.rank - t) % size], lo, hi, sequences, alibi_rows)
             for t in range(size)]
    return _Options(lengths=lengths, plans=plans, offsets=backend.offsets(plans), batch=tuple(facts["batch"]),
                    scale=facts["scale"], softcap=facts["softcap"] or None, slopes=slopes,
                    negated_slopes=None if slopes is None else -slopes, sinks=o.sinks,
                    deterministic=bool(o.deterministic))


def _arguments(causal, window, scale, layout, cu_seqlens, softcap, alibi_slopes, sinks, seqlen,
               deterministic=True, backward=None) -> _Options:
    return _Options(causal=causal, window=window, scale=scale, layout=layout, cu_seqlens=cu_seqlens,
                    softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, seqlen=seqlen,
                    deterministic=deterministic, backward=backward)


def _backend_of(comm) -> _Backend:
    for attr in ("rank", "size", "xp", "sendrecv", "allgather_bytes"):
        if not hasattr(comm, attr):
            raise TypeError(f"comm must be a communicator (cuflash.distributed.Communicator: rank, size, xp, "
                            f"sendrecv, allgather_bytes), got {type(comm).__name__} without {attr}")
    return _Backend(comm.xp)


def _true_lse(lse, call, opts, sign):
    """A call's lse with ALiBi's constant moved out (``sign`` -1) or back in (+1)."""
    shifts = call.shifts()
    if not shifts:
        return lse
    lse = lse.copy()
    r0 = call.rows[0]
    for a, b, shift in shifts:
        part = lse[..., a - r0:b - r0]
        part += (sign * shift) * opts.slopes.astype(lse.dtype)[..., None]
    return lse


def _guarded(comm, run):
    """Runs the ring; a failure aborts this rank's communication so that no peer waits on it."""
    try:
        return run()
    except BaseException as err:
        abort = getattr(comm, "abort", None)
        if abort is not None:
            abort(f"rank {comm.rank} failed: {type(err).__name__}: {err}")
        raise


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def ring_attention(q, k, v, comm, *, causal=False, window=None, scale=None, layout="contiguous", cu_seqlens=None,
                   softcap=None, alibi_slopes=None, sinks=None, return_lse=False, seqlen=None):
    """Attention over a sequence sharded across the ranks of ``comm`` (context parallelism).

    Every rank calls it at once with its own shard: q, k and v hold the same positions of the
    sequence along axis -2 (``layout``), the other dims alike on every rank. The result is
    this rank's rows of ``attention`` over the whole sequence, masks, ALiBi and packed
    sequences in global positions.

    Parameters
    ----------
    q, k, v : arrays of ``comm.xp`` (cupy: the GPU kernels; numpy: ``cuflash.reference``)
        Shapes ``(..., n, D)``, ``(..., n, D)``, ``(..., n, Dv)``, leading dims broadcasting as in
        ``cuflash.attention`` (GQA: k, v ``(B, Hkv, 1, n, D)`` against q ``(B, Hkv, G, n, D)``).
    comm : Communicator
        `NcclCommunicator` (one process per GPU) or a rank of `LocalWorld` / `run_ranks`.
    causal, window, scale, softcap
        As in ``cuflash.attention``, over the whole sequence (its Nq = Nk, so aligned at 0).
    layout : "contiguous" or "zigzag"
        contiguous: rank r holds positions ``sum(n_0 .. n_{r-1})`` onwards (shards of any
        lengths); zigzag: the sequence in 2P equal chunks, rank r holding chunks r and
        2P - 1 - r (balanced under a causal mask). `shard` cuts a whole array either way.
    cu_seqlens : int32 array (S + 1,), optional
        Packed sequences: offsets into the *whole* sequence, the same on every rank; each
        position attends only its own sequence's keys.
    alibi_slopes, sinks : float32 arrays of ``comm.xp``, optional
        As in ``cuflash.attention``, the same on every rank: ALiBi by global positions, each
        row's sink counted once (merged after every rank's keys).
    return_lse : bool
        Also return the rows' logsumexp (float32; float64 on NumPy): what the backward needs.
    seqlen : int, optional
        The whole sequence's length, checked against the shards (catches shards cut for
        another number of ranks).

    Returns
    -------
    out : this rank's rows, ``broadcast(batch) + (n, Dv)``, q's dtype (float64 on NumPy)
    lse : ``broadcast(batch) + (n,)``, with ``return_lse``

    Every rank checks every rank's arguments before anything is sent: a bad argument on one
    rank, or ranks that disagree, raise the same error on all. Deterministic for a given
    number of ranks.
    """
    backend = _backend_of(comm)
    opts = _handshake("ring_attention", backend, comm, q, k, v,
                      _arguments(causal, window, scale, layout, cu_seqlens, softcap, alibi_slopes, sinks, seqlen))
    out, lse = _guarded(comm, lambda: _forward(backend, comm, q, k, v, opts))
    return (out, lse) if return_lse else out


def _kv_shapes(k, v, n):
    return (k.shape[:-2] + (n, k.shape[-1]), v.shape[:-2] + (n, v.shape[-1]))


def _pass_on(comm, xp, arrays, shapes):
    """Starts sending ``arrays`` to the next rank and receiving their like, of ``shapes`` (the
    next shard's), from the one before: the buffers and the transfer."""
    incoming = [xp.empty(shape, dtype=x.dtype) for shape, x in zip(shapes, arrays)]
    return incoming, comm.sendrecv(arrays, (comm.rank + 1) % comm.size, incoming, (comm.rank - 1) % comm.size)


def _forward(backend, comm, q, k, v, opts):
    xp, size, rank = backend.xp, comm.size, comm.rank
    merged = _Merged(xp, opts.batch + (q.shape[-2], v.shape[-1]), backend.acc)
    mine = _Views(xp, q=q)
    kv = (xp.ascontiguousarray(k), xp.ascontiguousarray(v)) if size > 1 else (k, v)
    for t in range(size):
        src = (rank - t) % size
        if t + 1 < size:   # the next shard moves while this one is computed
            incoming, pending = _pass_on(comm, xp, kv, _kv_shapes(k, v, opts.lengths[(src - 1) % size]))
        theirs = _Views(xp, k=kv[0], v=kv[1])
        for call in opts.plans[t]:
            o, lse = backend.forward(_rows(mine.get("q", call), call.rows), _rows(theirs.get("k", call), call.keys),
                                     _rows(theirs.get("v", call), call.keys), call, opts)
            lse = _true_lse(lse, call, opts, -1)
            if call.mirrored:
                o, lse = _flip(o), _flip(lse, False)
            merged.add(_home(call, call.rows, q.shape[-2]), o, lse)
        if t + 1 < size:
            pending.wait()
            kv = tuple(incoming)
    if opts.sinks is not None:
        merged.add_sinks(opts.sinks)
    if not backend.gpu:
        return merged.out, merged.lse
    return merged.out.astype(q.dtype), merged.lse


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


def ring_attention_backward(dout, q, k, v, out, lse, comm, *, causal=False, window=None, scale=None,
                            layout="contiguous", cu_seqlens=None, softcap=None, alibi_slopes=None, sinks=None,
                            seqlen=None, deterministic=True):
    """Gradients of `ring_attention` for this rank's shard, every rank calling it at once.

    ``dout``, ``out`` and ``lse`` are this rank's rows (``out`` and ``lse`` as the forward
    returned them); the keywords are the forward's, and ``deterministic`` that of
    ``cuflash.attention_backward`` (bitwise repeatable for a given number of ranks when True).

    Returns ``dq, dk, dv`` in the shapes and dtypes of this rank's q, k, v (float64 on NumPy),
    and with ``sinks`` this rank's rows' share of ``dsinks`` (float32; float64 on NumPy): the
    sum over the ranks is the gradient, to be reduced with the other parameters' gradients.
    """
    backend = _backend_of(comm)
    opts = _handshake("ring_attention_backward", backend, comm, q, k, v,
                      _arguments(causal, window, scale, layout, cu_seqlens, softcap, alibi_slopes, sinks, seqlen,
                                 deterministic, (dout, out, lse)))
    return _guarded(comm, lambda: _backward(backend, comm, dout, q, k, v, out, lse, opts))


def _backward(backend, comm, dout, q, k, v, out, lse, opts):
    xp, size, rank, acc = backend.xp, comm.size, comm.rank, backend.acc
    dq = xp.zeros(q.shape, dtype=acc)
    mine = _Views(xp, q=q, dout=dout, out=out, lse=lse)
    kv = (xp.ascontiguousarray(k), xp.ascontiguousarray(v)) if size > 1 else (k, v)
    sums = sums_pending = None
    for t in range(size):
        src = (rank - t) % size
        if t + 1 < size:
            incoming, pending = _pass_on(comm, xp, kv, _kv_shapes(k, v, opts.lengths[(src - 1) % size]))
        theirs = _Views(xp, k=kv[0], v=kv[1])
        dk, dv = (xp.zeros(s, dtype=acc) for s in _kv_shapes(k, v, opts.lengths[src]))
        for call in opts.plans[t]:
            rows, keys = call.rows, call.keys
            mine_rows = [_rows(mine.get(name, call), rows) for name in ("dout", "q")]
            grads = backend.backward(*mine_rows, _rows(theirs.get("k", call), keys), _rows(theirs.get("v", call), keys),
                                     _rows(mine.get("out", call), rows),
                                     _true_lse(_rows(mine.get("lse", call), rows, False), call, opts, 1),
                                     call, opts)
            for total, g, span in zip((dq, dk, dv), grads[:3], (rows, keys, keys)):
                part = _rows(total, _home(call, span, total.shape[-2]))
                part += _flip(g) if call.mirrored else g
        if sums_pending is not None:   # the shard's sums from the ranks before, then this rank's
            sums_pending.wait()
            dk, dv = sums[0] + dk, sums[1] + dv
        if size > 1:   # on to the next rank; the last hop takes them home
            sums, sums_pending = _pass_on(comm, xp, (dk, dv), _kv_shapes(k, v, opts.lengths[(src - 1) % size]))
        else:
            sums = (dk, dv)
        if t + 1 < size:
            pending.wait()
            kv = tuple(incoming)
    if sums_pending is not None:
        sums_pending.wait()
    grads = (dq, sums[0], sums[1])
    if backend.gpu:
        grads = tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))
    if opts.sinks is None:
        return grads
    delta = (dout.astype(acc) * out.astype(acc)).sum(axis=-1)
    z = opts.sinks.astype(acc)[..., None]
    rows = -(xp.exp(z - lse.astype(acc)) * delta).sum(axis=-1)
    return grads + (_checks.sum_to_shape(rows, opts.sinks.shape).astype(acc),)


def ring_attention_vjp(q, k, v, comm, *, deterministic=True, **keywords):
    """`ring_attention` and a closure for its vector-Jacobian product: ``out, vjp =
    ring_attention_vjp(q, k, v, comm, ...)``, then ``vjp(dout)`` (every rank at once) returns what
    `ring_attention_backward` returns. The keywords are the forward's (but ``return_lse``)."""
    out, lse = ring_attention(q, k, v, comm, return_lse=True, **keywords)

    def vjp(dout):
        return ring_attention_backward(dout, q, k, v, out, lse, comm, deterministic=deterministic, **keywords)

    return out, vjp


# ---------------------------------------------------------------------------------------------
# Cutting a whole array into shards and back
# ---------------------------------------------------------------------------------------------


def _lengths_of(total, size, layout, lengths):
    _plan.check_int("size", size, 1)
    if lengths is None:
        return _plan.shard_lengths(total, size, layout)
    lengths = tuple(int(n) for n in lengths)
    if len(lengths) != size or any(n < 0 for n in lengths) or sum(lengths) != total:
        raise ValueError(f"lengths must be {size} non-negative ints adding up to {total}, got {list(lengths)}")
    if layout == "zigzag" and lengths != _plan.shard_lengths(total, size, layout):
        raise ValueError("the zigzag layout has no lengths of its own: leave lengths out")
    return lengths


def shard_positions(seqlen: int, size: int, rank: int, *, layout: str = "contiguous", lengths=None) -> np.ndarray:
    """The positions in the whole sequence of rank ``rank``'s rows (for rotary embeddings and
    the like): ``layout`` and ``lengths`` as for `shard`."""
    _plan.check_layout(layout)
    lengths = _lengths_of(seqlen, size, layout, lengths)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < size:
        raise ValueError(f"rank must be an int from 0 to size - 1 = {size - 1}, got {rank!r}")
    return _plan.positions(_plan.segments(layout, lengths, rank))


def shard(x, size: int, *, layout: str = "contiguous", lengths=None, axis: int = -2) -> list:
    """Rank by rank, the shards of ``x`` (a whole sequence along ``axis``) that `ring_attention`
    takes: ``contiguous`` in ``lengths`` (default: as equal as they come, `shard_lengths`),
    ``zigzag`` in 2 * size equal chunks. NumPy or CuPy arrays; contiguous shards are views."""
    _plan.check_layout(layout)
    lengths = _lengths_of(x.shape[axis], size, layout, lengths)
    xp = np if isinstance(x, np.ndarray) else _checks.require_cupy()
    shards = []
    for r in range(size):
        runs = []
        for s in _plan.segments(layout, lengths, r):
            index = [slice(None)] * x.ndim
            index[axis] = slice(s.start, s.start + s.length)
            runs.append(x[tuple(index)])
        shards.append(runs[0] if len(runs) == 1 else xp.concatenate(runs, axis=axis))
    return shards


def unshard(shards, *, layout: str = "contiguous", axis: int = -2):
    """The whole sequence from every rank's shard, in rank order (`shard`'s inverse)."""
    _plan.check_layout(layout)
    if not shards:
        raise ValueError("shards must hold every rank's shard, got none")
    lengths = tuple(s.shape[axis] for s in shards)
    if layout == "zigzag" and (len(set(lengths)) > 1 or lengths[0] % 2):
        raise ValueError(f"zigzag shards hold the same even number of rows each, got {list(lengths)}")
    xp = np if isinstance(shards[0], np.ndarray) else _checks.require_cupy()
    runs = []
    for r, x in enumerate(shards):
        for s in _plan.segments(layout, lengths, r):
            index = [slice(None)] * x.ndim
            index[axis] = slice(s.offset, s.offset + s.length)
            runs.append((s.start, x[tuple(index)]))
    return xp.concatenate([x for _, x in sorted(runs, key=lambda item: item[0])], axis=axis)
