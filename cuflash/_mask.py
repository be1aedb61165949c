"""The attention mask rule, in one place.

cuflash follows FlashAttention-2: masks are aligned to the bottom-right corner of the
score matrix. With ``off = Nk - Nq``, query row ``i`` may attend key ``j`` iff::

    i + off - left <= j <= i + off + right

where ``left`` or ``right`` set to ``None`` leaves that side unbounded. ``causal=True`` is the
window with ``right = 0``. Every other piece of Python in the package asks this module; the CUDA
side (``kernels/attention/mask.cuh``) implements the same formulas, and the block helpers below
(`key_range`, `block_needs_mask`) are the ones the kernels use to skip or mask key blocks.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

__all__ = [
    "normalize_window",
    "allowed",
    "block_allowed",
    "key_range",
    "block_needs_mask",
]

_WINDOW_EXPECTED = "None or a pair (left, right), each None or a non-negative int"


def _window_side(value, index: int):
    """Validate one side of a window; return it as a Python int, or None."""
    side = ("left", "right")[index]
    if value is None:
        return None
    # bool is an int subclass, but window=(True, False) is almost certainly a mistake.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(
            f"window[{index}] ({side}) must be None or a non-negative int, "
            f"got {value!r} of type {type(value).__name__}"
        )
    value = int(value)
    if value < 0:
        raise ValueError(
            f"window[{index}] ({side}) must be None or a non-negative int, got {value}"
        )
    return value


def normalize_window(causal, window) -> tuple[int | None, int | None]:
    """Turn the user's ``causal`` and ``window`` arguments into ``(left, right)``.

    Parameters
    ----------
    causal : bool
        If True, no query attends a key to its (bottom-right aligned) future: ``right = 0``.
    window : None or (left, right)
        Sliding-window bounds, each ``None`` (unbounded) or a non-negative integer
        (Python ``int`` or a NumPy integer; ``bool`` is rejected).

    Returns
    -------
    left, right : int or None
        The window as plain Python ints, ``None`` for an unbounded side. ``causal=True``
        forces ``right = 0`` and keeps ``left`` from the window (``None`` without one).

    Raises
    ------
    TypeError
        ``causal`` is not a bool, ``window`` is not None or a sequence, or a side is not an int.
    ValueError
        ``window`` does not have two entries, or a side is negative.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r} of type {type(causal).__name__}")
    if window is None:
        left, right = None, None
    else:
        if isinstance(window, (str, bytes)) or not isinstance(window, (Sequence, np.ndarray)):
            raise TypeError(
                f"window must be {_WINDOW_EXPECTED}, got {window!r} of type {type(window).__name__}"
            )
        if len(window) != 2:
            raise ValueError(
                f"window must be {_WINDOW_EXPECTED}, got a sequence of length {len(window)}: {window!r}"
            )
        left = _window_side(window[0], 0)
        right = _window_side(window[1], 1)
    if causal:
        right = 0
    return left, right


def block_allowed(
    row_start: int,
    row_stop: int,
    col_start: int,
    col_stop: int,
    nq: int,
    nk: int,
    left: int | None,
    right: int | None,
) -> np.ndarray:
    """The mask of one tile: rows ``[row_start, row_stop)`` by keys ``[col_start, col_stop)``.

    Returns a bool array of shape ``(row_stop - row_start, col_stop - col_start)``. Keys outside
    ``[0, nk)`` (the ragged end of the last key block) are never allowed. Row indices are put
    into the formula as given; callers pass rows inside ``[0, nq)``.
    """
    i = np.arange(row_start, row_stop)[:, None]
    j = np.arange(col_start, col_stop)[None, :]
    d = j - (i + (nk - nq))  # signed distance from the (bottom-right aligned) diagonal
    ok = np.ones(d.shape, dtype=bool)
    ok &= (j >= 0) & (j < nk)
    if left is not None:
        ok &= d >= -left
    if right is not None:
        ok &= d <= right
    return ok


def allowed(nq: int, nk: int, left: int | None, right: int | None) -> np.ndarray:
    """The full ``(nq, nk)`` bool mask: ``allowed(...)[i, j]`` iff row ``i`` may attend key ``j``.

    Examples
    --------
    Causal with ``Nq = 3, Nk = 5`` (``off = 2``):

    >>> allowed(3, 5, None, 0).astype(int)
    array([[1, 1, 1, 0, 0],
           [1, 1, 1, 1, 0],
           [1, 1, 1, 1, 1]])
    """
    return block_allowed(0, nq, 0, nk, nq, nk, left, right)


def key_range(
    row_start: int,
    row_stop: int,
    nq: int,
    nk: int,
    left: int | None,
    right: int | None,
) -> tuple[int, int]:
    """The keys that any row in ``[row_start, row_stop)`` may attend, as a half-open range.

    Rows are clipped to ``[0, nq)`` and keys to ``[0, nk)``. Each row's keys form one interval,
    and consecutive rows' intervals overlap (the band is at least one key wide before
    clipping), so their union is exactly ``[lo, hi)``: a kernel working on that block of rows
    can skip every key block outside it. ``hi <= lo`` means no row attends any key.

    Returns
    -------
    lo, hi : int
    """
    row_start = max(row_start, 0)
    row_stop = min(row_stop, nq)
    if row_stop <= row_start or nk <= 0:
        return 0, 0
    off = nk - nq
    lo = 0 if left is None else row_start + off - left
    hi = nk if right is None else (row_stop - 1) + off + right + 1
    return min(max(lo, 0), nk), min(max(hi, 0), nk)


def block_needs_mask(
    row_start: int,
    row_stop: int,
    col_start: int,
    col_stop: int,
    nq: int,
    nk: int,
    left: int | None,
    right: int | None,
) -> bool:
    """Whether the tile rows ``[row_start, row_stop)`` by keys ``[col_start, col_stop)`` needs a mask.

    False exactly when every (row, key) pair of the tile is allowed, so the tile's scores can be
    used as they are. Rows are clipped to ``[0, nq)``; keys are not clipped: a tile reaching past
    ``nk`` (the ragged end) or before 0 needs a mask. The band is convex, so checking the two
    corners nearest its edges is enough: (last row, first key) for the left edge and
    (first row, last key) for the right edge.
    """
    row_start = max(row_start, 0)
    row_stop = min(row_stop, nq)
    if row_stop <= row_start or col_stop <= col_start:
        return False
    if col_start < 0 or col_stop > nk:
        return True
    off = nk - nq
    if left is not None and col_start < (row_stop - 1) + off - left:
        return True
    if right is not None and col_stop - 1 > row_start + off + right:
        return True
    return False
