"""The score modifiers of a GPU call (softcap, ALiBi slopes, sinks, bias, dropout): checked,
and laid out as the kernels read them (kernels/attention/score_path.cuh)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from . import _checks


@dataclass(frozen=True)
class BiasLayout:
    """How the kernels read a bias: element strides along the kernels' batch dims (0 where it
    is broadcast), between rows and between keys, and whether it is float32 (else the inputs'
    dtype)."""

    batch_strides: tuple
    row_stride: int
    col_stride: int
    float32: bool


@dataclass(frozen=True)
class ScoreMods:
    """A call's modifiers as its plan keeps them: the cap's value, whether slopes and sinks
    are given (their values are read per call: `per_entry`), the bias's layout and dropout_p
    (dropout's seed is given per call)."""

    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    bias: BiasLayout | None = None
    dropout_p: float = 0.0

    @property
    def modified(self) -> bool:
        """Whether the call runs one of the kernels' modified score paths (softcap, ALiBi, bias
        or dropout: sinks alone touch only the row sums, which every path counts)."""
        return bool(self.softcap) or self.alibi or self.full

    @property
    def full(self) -> bool:
        """Whether it needs the path with bias and dropout (the portable kernels')."""
        return self.bias is not None or bool(self.dropout_p)


def key(softcap, alibi_slopes, sinks, bias=None, dropout_p=0.0):
    """The modifiers' part of a plan's signature (not dropout's seed: it is given per call)."""
    cap = softcap if isinstance(softcap, numbers.Real) else None   # (anything else: refused by check)
    p = dropout_p if isinstance(dropout_p, numbers.Real) else None
    return (type(softcap), cap, _array_key(alibi_slopes), _array_key(sinks), _array_key(bias), type(dropout_p), p)


def _array_key(a):
    """A CuPy array's type, dtype, shape, strides and device; of anything else what it has of
    these (`check` refuses it, so no plan is kept under such a key)."""
    if a is None:
        return None
    return (type(a),) + tuple(getattr(a, name, None) for name in ("dtype", "shape", "strides")) + (
        getattr(getattr(a, "device", None), "id", None),)


def _check_arrays(cupy, device: int, scale: float, **arrays) -> None:
    """That the modifiers' arrays given (None: absent) are CuPy arrays on q's device, and that
    the additive ones (ALiBi's slopes, the bias) come with a scale other than 0: the kernels keep
    additive terms in raw score units, 1 / scale of the scaled ones (cuflash.reference takes 0)."""
    for name, x in arrays.items():
        if x is not None:
            _checks.check_cupy(cupy, **{name: x})
            _same_device(name, x, device)
    for name in ("alibi_slopes", "bias"):
        if arrays.get(name) is not None and scale == 0:
            raise NotImplementedError(f"cuflash's kernels take {name} with a scale other than 0, got scale=0 "
                                      "(cuflash.reference takes it)")


def check(cupy, softcap, alibi_slopes, sinks, batch_shape, device: int, scale: float) -> ScoreMods:
    """attention_kvcache's modifiers: softcap, and slopes and sinks (`_check_arrays`) one per
    entry of the call's broadcast batch dims; raises naming the argument."""
    _check_arrays(cupy, device, scale, alibi_slopes=alibi_slopes, sinks=sinks)
    cap = _checks.check_softcap(softcap)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            _checks.check_per_entry(name, x, batch_shape)
    return ScoreMods(cap, alibi_slopes is not None, sinks is not None)


def check_all(cupy, x, softcap, alibi_slopes, sinks, bias, dropout_p) -> ScoreMods:
    """attention's modifiers for its inputs ``x`` (_checks.AttnInputs): `_check_arrays`, then
    their values and shapes as cuflash.reference checks them (_checks.check_modifiers); the bias
    without its layout (`bias_layout`)."""
    _check_arrays(cupy, x.q.device.id, x.scale, alibi_slopes=alibi_slopes, sinks=sinks, bias=bias)
    checked = _checks.check_modifiers(x.batch_shape, x.nq, x.nk, x.dtype_name, softcap=softcap, bias=bias,
                                      alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, seed=0,
                                      packed=x.packed is not None)
    return ScoreMods(checked.softcap, alibi_slopes is not None, sinks is not None, dropout_p=checked.dropout_p)


def bias_layout(bias, batch_strides) -> BiasLayout:
    """The layout of a checked bias, whose strides along the kernels' batch dims are
    ``batch_strides`` (_checks.kernel_batch_layout with the bias beside q, k and v)."""
    rows, keys = ((bias.strides[i] // bias.itemsize if bias.ndim >= -i and bias.shape[i] != 1 else 0)
                  for i in (-2, -1))
    return BiasLayout(tuple(batch_strides), rows, keys, bias.dtype == "float32")


def _same_device(name, x, device: int) -> None:
    if x.device.id != device:
        raise ValueError(f"{name} is on device {x.device.id}, but q is on device {device}")


def per_entry(cupy, x, batch_shape):
    """Slopes or sinks as the kernels read them: one float32 per entry of the broadcast batch,
    contiguous (None stays None)."""
    if x is None:
        return None
    return cupy.ascontiguousarray(cupy.broadcast_to(x, tuple(batch_shape)))


def dsinks(cupy, z, shape, lse, delta):
    """The gradient of the sinks from their values per entry ``z`` (as `per_entry` lays them
    out for the kernels): -sum over each row of exp(z - lse) * rowsum(dout * out), summed to the
    sinks' ``shape`` over the dims they were broadcast along, by one CuPy reduction (added up in
    float64, its order fixed; float32 sums in its order missed the float32 tests' bound): five
    CuPy operations had cost the backward about 130 us of host time."""
    batch = lse.shape[:-1]
    own = (1,) * (len(batch) - len(shape)) + tuple(shape)
    axes = tuple(d for d, n in enumerate(own) if n == 1 and batch[d] != 1) + (len(batch),)
    return _sink_gradient(cupy)(z[..., None], lse, delta, axis=axes).reshape(shape)


_SINK_GRADIENT = []   # the reduction, made once (compiled by CuPy at its first use, and cached)


def _sink_gradient(cupy):
    if not _SINK_GRADIENT:
        _SINK_GRADIENT.append(cupy.ReductionKernel(
            "float32 z, float32 lse, float32 delta", "float32 dsinks", "(double)expf(z - lse) * delta", "a + b",
            "dsinks = -a", "0", "cuflash_sink_gradient", reduce_type="double"))
    return _SINK_GRADIENT[0]
