"""The score modifiers of a GPU call (softcap, ALiBi slopes, sinks): checked, and laid out
as the kernels read them (kernels/attention/score_path.cuh)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from . import _checks


@dataclass(frozen=True)
class ScoreMods:
    """A call's modifiers as its plan keeps them: the cap's value, and whether slopes and
    sinks are given (their values are read per call: `per_entry`)."""

    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False

    @property
    def modified(self) -> bool:
        """Whether the call runs the kernels' modified score path (softcap or ALiBi: sinks
        alone touch only the row sums, which every path counts)."""
        return bool(self.softcap) or self.alibi


def key(softcap, alibi_slopes, sinks):
    """The modifiers' part of a plan's signature."""
    cap = softcap if isinstance(softcap, numbers.Real) else None   # (anything else: refused by check)
    return (type(softcap), cap, _array_key(alibi_slopes), _array_key(sinks))


def _array_key(a):
    """A CuPy array's type, dtype, shape, strides and device; of anything else what it has of
    these (`check` refuses it, so no plan is kept under such a key)."""
    if a is None:
        return None
    return (type(a),) + tuple(getattr(a, name, None) for name in ("dtype", "shape", "strides")) + (
        getattr(getattr(a, "device", None), "id", None),)


def check(cupy, softcap, alibi_slopes, sinks, batch_shape, device: int, scale: float) -> ScoreMods:
    """Checks the modifiers against the call's broadcast batch dims and scale; raises naming
    the argument. The kernels keep ALiBi's term in raw score units (1 / scale of the scaled
    ones), so they take slopes with a scale other than 0 (cuflash.reference takes 0)."""
    cap = _checks.check_softcap(softcap)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            _checks.check_cupy(cupy, **{name: x})
            _checks.check_per_entry(name, x, batch_shape)
            if x.device.id != device:
                raise ValueError(f"{name} is on device {x.device.id}, but q is on device {device}")
    if alibi_slopes is not None and scale == 0:
        raise NotImplementedError("cuflash's kernels take alibi_slopes with a scale other than 0, got scale=0 "
                                  "(cuflash.reference takes it)")
    return ScoreMods(cap, alibi_slopes is not None, sinks is not None)


def per_entry(cupy, x, batch_shape):
    """Slopes or sinks as the kernels read them: one float32 per entry of the broadcast batch,
    contiguous (None stays None)."""
    if x is None:
        return None
    return cupy.ascontiguousarray(cupy.broadcast_to(x, tuple(batch_shape)))


def dsinks(cupy, z, shape, lse, delta):
    """The gradient of the sinks from their values per entry ``z`` (as `per_entry` lays them
    out for the kernels): -sum over each row of exp(z - lse) * rowsum(dout * out), summed to the
    sinks' ``shape`` over the dims they were broadcast along (float32, the order fixed)."""
    rows = -(cupy.exp(z[..., None] - lse) * delta).sum(axis=-1)
    return _checks.sum_to_shape(rows, shape).astype(cupy.float32)
