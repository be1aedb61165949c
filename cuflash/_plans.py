"""Launch plans: what a call launches, kept per call signature so that a repeated
call skips the checks and the building of its parameter records.

A signature holds everything the checks and the launches depend on except the
data pointers: each array's type, dtype, shape, strides, device and whether it
starts on a 16-byte boundary, and the mask and scale arguments with their types.
Only calls that pass the checks are kept, and only those whose arrays the kernels
read in place (no copy) and whose gradients need no sum over broadcast dims, so a
kept plan runs exactly what the checked path would.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from . import _checks, _dispatch

MAX_PLANS = 512   # beyond this many signatures the cache starts over

_plans: dict = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Plan:
    device: int  # q's device: where the outputs live and the kernels run
    shapes: tuple[tuple[int, ...], ...]  # of the outputs: out and lse, or dq, dk, dv and delta
    launches: tuple[_dispatch.Launch, ...]


def _signature(direction: str, arrays, causal, window, scale):
    """The cache key of a call, or None when an argument cannot be part of one (the checks
    then say what is wrong with it)."""
    if not (window is None or isinstance(window, (tuple, list))):
        return None
    try:
        mask = (
            type(causal), causal,
            None if window is None else tuple((type(w), w) for w in window),
            type(scale), scale,
        )
        key = (direction, mask) + tuple(
            (type(a), a.dtype, a.shape, a.strides, a.device.id, a.data.ptr % 16 == 0) for a in arrays
        )
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def _keep(key, plan: Plan) -> None:
    if key is None:
        return
    with _lock:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan


def clear() -> None:
    """Forgets every kept plan (after a change to the tile tables, say)."""
    with _lock:
        _plans.clear()


def forward(q, k, v, causal, window, scale):
    """(plan, (q, k, v) as the kernels read them) of a forward call; raises as the checks do."""
    key = _signature("fwd", (q, k, v), causal, window, scale)
    plan = _plans.get(key)
    if plan is not None:
        return plan, (q, k, v)
    x = _checks.attention_inputs(q, k, v, causal, window, scale)
    with x.q.device:
        launches = _dispatch.forward_launches(x) if x.batch_size and x.nq else ()
    plan = Plan(x.q.device.id, (x.batch_shape + (x.nq, x.dv), x.batch_shape + (x.nq,)), launches)
    if x.q is q and x.k is k and x.v is v:
        _keep(key, plan)
    return plan, (x.q, x.k, x.v)


def backward(dout, q, k, v, out, lse, causal, window, scale):
    """(plan, (q, k, v, out, lse, dout) as the kernels read them) of a backward call. A plan
    without launches (no query or no key) stands for zero gradients."""
    arrays = (q, k, v, out, lse, dout)
    key = _signature("bwd", arrays, causal, window, scale)
    plan = _plans.get(key)
    if plan is not None:
        return plan, arrays
    x = _checks.attention_inputs(q, k, v, causal, window, scale, dout=dout, out=out, lse=lse)
    cupy = _checks.require_cupy()
    out2, dout2, lse2 = _checks.backward_arrays(cupy, x, out=out, dout=dout, lse=lse)
    shape = x.batch_shape
    shapes = (shape + (x.nq, x.d), shape + (x.nk, x.d), shape + (x.nk, x.dv), shape + (x.nq,))
    with x.q.device:
        launches = _dispatch.backward_launches(x) if x.batch_size and x.nq and x.nk else ()
    plan = Plan(x.q.device.id, shapes, launches)
    checked = (x.q, x.k, x.v, out2, lse2, dout2)
    if launches and all(a is b for a, b in zip(checked, arrays)) and shapes[:3] == (q.shape, k.shape, v.shape):
        _keep(key, plan)
    return plan, checked
