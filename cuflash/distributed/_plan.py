"""Which attention calls one step of the ring makes, worked out on the host from shapes alone.

A rank's shard is one or two *segments*: runs of consecutive positions of the whole sequence
held in consecutive rows of its arrays (axis -2). ``contiguous``: rank r holds one run, of any
length; ``zigzag``: the sequence is cut into 2P chunks of equal length and rank r holds chunks
r and 2P - 1 - r, so that under a causal mask every rank has the same work.

The mask of the whole sequence is a band in ``T = i - j`` (global row minus global key):
``-right <= T <= left`` (causal: ``T >= 0``). A cuflash call of ``m`` rows and ``n`` keys sees
the band of its own diagonal instead, ``t = i' - j' + (n - m)`` in its local rows and keys
(bottom-right alignment), with ``window=(L, R)`` meaning ``-R <= t <= L`` and ``L, R >= 0``.
Over one part of a call (a pair of segments) ``t = T - c`` for a constant ``c``, the position
``i - j`` of the call's bottom-right corner as that part maps it. So a call expresses the
global band exactly when, on every part, ``[c - R, c + L]`` and ``[-right, left]`` select the
same pairs: `_window_for` searches such a window, after cropping the call to the pairs that are
allowed at all (the crop's corner then lies in the band, so a window with ``L, R >= 0``
exists for a single part).

ALiBi's distance is the call's ``|t|``, not the global ``|T|``. Where ``c = 0`` they agree.
Elsewhere a piece is chosen whose corner lies on one edge of its band and on one side of
``T = 0``, so that ``t`` and ``T`` keep one sign on it: then ``-s |T| = -(s sign) |t| - s
sign_T c``, the call's scores differ from the true ones by a constant per row, which changes
no probability; the call runs with slopes ``s * sign`` and its lse is corrected by ``slopes *
shift``. Keys before rows (``T >= 0``) go in chunks of at most ``alibi_rows`` rows, so that
the call's term at each row's nearest keys stays within ``alibi_rows * |slope|`` of 0 (float32
scores keep their precision); keys after rows go the same way on the shards reversed along the
sequence (``mirrored`` pieces), where they come first.

Nothing here touches an array: plans are tuples of ints, cached per shape.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from dataclasses import dataclass

import numpy as np

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    """Positions ``start .. start + length - 1`` of the whole sequence, held in rows
    ``offset .. offset + length - 1`` of a shard."""

    start: int
    length: int
    offset: int


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(x) for x in LAYOUTS)}, got {layout!r}")
    return layout


def check_int(name: str, x, least: int) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < least:
        raise ValueError(f"{name} must be an int of at least {least}, got {x!r}")


def shard_lengths(seqlen: int, size: int, layout: str = "contiguous") -> tuple[int, ...]:
    """The rows of each rank's shard of a sequence of ``seqlen`` positions: ``contiguous``, as
    equal as they come (the first ``seqlen % size`` ranks one more); ``zigzag``, ``2 * seqlen /
    (2 * size)`` each (ValueError unless ``2 * size`` divides ``seqlen``)."""
    check_layout(layout)
    check_int("seqlen", seqlen, 0)
    check_int("size", size, 1)
    if layout == "zigzag":
        if seqlen % (2 * size):
            raise ValueError(f"the zigzag layout cuts the sequence into 2 * {size} chunks of equal length: "
                             f"{seqlen} positions are not a multiple of {2 * size}")
        return (seqlen // size,) * size
    base, extra = divmod(seqlen, size)
    return tuple(base + (r < extra) for r in range(size))


def segments(layout: str, lengths: tuple[int, ...], rank: int) -> tuple[Segment, ...]:
    """The segments of rank ``rank``'s shard, given the shard lengths of every rank (zigzag:
    all equal and even, checked by the caller)."""
    if layout == "contiguous":
        return (Segment(sum(lengths[:rank]), lengths[rank], 0),)
    size, chunk = len(lengths), lengths[rank] // 2
    return Segment(rank * chunk, chunk, 0), Segment((2 * size - 1 - rank) * chunk, chunk, chunk)


def positions(segs) -> np.ndarray:
    """The position in the whole sequence of each row of a shard."""
    if not segs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(s.start, s.start + s.length, dtype=np.int64) for s in segs])


@dataclass(frozen=True)
class Piece:
    """One problem of a call: local query rows ``rows`` against local keys ``keys`` (half-open
    ranges of the shards' axis -2), masked by ``window`` (cuflash's ``(left, right)``, relative
    to the piece's own bottom-right corner; ``(None, None)`` is no mask). With ALiBi the call
    runs with ``slope_sign * alibi_slopes``, and its lse exceeds the true one by ``slopes *
    shift`` on these rows. ``mirrored``: rows and keys are those of the shards reversed along
    axis -2 (row x is row ``n - 1 - x``)."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    window: tuple[int | None, int | None] = (None, None)
    slope_sign: int = 1
    shift: int = 0
    mirrored: bool = False


@dataclass(frozen=True)
class Call:
    """One attention call of a step: a single piece (a dense call over its rows and keys) or
    several (a packed call: pieces in increasing rows and keys, one sequence each, with
    sequences of rows without keys and keys without rows between them)."""

    pieces: tuple[Piece, ...]

    @property
    def rows(self) -> tuple[int, int]:
        return self.pieces[0].rows[0], self.pieces[-1].rows[1]

    @property
    def keys(self) -> tuple[int, int]:
        return self.pieces[0].keys[0], self.pieces[-1].keys[1]

    @property
    def window(self):
        return self.pieces[0].window

    @property
    def slope_sign(self) -> int:
        return self.pieces[0].slope_sign

    @property
    def mirrored(self) -> bool:
        return self.pieces[0].mirrored

    @property
    def packed(self) -> bool:
        return len(self.pieces) > 1

    def offsets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A packed call's cu_seqlens_q and cu_seqlens_k, relative to its first row and key."""
        (r, k), cu_q, cu_k = (self.rows[0], self.keys[0]), [0], [0]
        for p in self.pieces:
            for gap_q, gap_k in ((p.rows[0] - r, 0), (0, p.keys[0] - k)):
                if gap_q or gap_k:   # rows without keys, keys without rows: never both
                    cu_q.append(cu_q[-1] + gap_q)
                    cu_k.append(cu_k[-1] + gap_k)
            cu_q.append(cu_q[-1] + p.rows[1] - p.rows[0])
            cu_k.append(cu_k[-1] + p.keys[1] - p.keys[0])
            r, k = p.rows[1], p.keys[1]
        return tuple(cu_q), tuple(cu_k)

    def shifts(self):
        """(first row, last row + 1, shift) of each piece whose lse needs ALiBi's correction."""
        return tuple((p.rows[0], p.rows[1], p.shift) for p in self.pieces if p.shift)


# ---------------------------------------------------------------------------------------------
# One part: a rectangle of rows and keys, each a run of consecutive positions
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """Global rows ``a .. a + m - 1`` in local rows from ``ra``, global keys ``b .. b + n - 1``
    in local keys from ``kb``."""

    a: int
    m: int
    ra: int
    b: int
    n: int
    kb: int

    def box(self, lo, hi):
        """The tight box of the pairs with ``lo <= T <= hi`` (None: unbounded): global
        (first row, last row, first key, last key), or None where there are none."""
        if self.m <= 0 or self.n <= 0:
            return None
        a1, b1 = self.a + self.m - 1, self.b + self.n - 1
        lo = -np.inf if lo is None else lo
        hi = np.inf if hi is None else hi
        i0, i1 = max(self.a, self.b + lo), min(a1, b1 + hi)
        j0, j1 = max(self.b, self.a - hi), min(b1, a1 - lo)
        if i0 > i1 or j0 > j1:
            return None
        return int(i0), int(i1), int(j0), int(j1)

    def crop(self, i0, i1, j0, j1) -> _Part:
        """The part's rows ``i0 .. i1`` and keys ``j0 .. j1`` (global, inclusive)."""
        i0, i1 = max(i0, self.a), min(i1, self.a + self.m - 1)
        j0, j1 = max(j0, self.b), min(j1, self.b + self.n - 1)
        return _Part(i0, max(0, i1 - i0 + 1), self.ra + i0 - self.a, j0, max(0, j1 - j0 + 1), self.kb + j0 - self.b)


def _intervals_equal(x, y) -> bool:
    empty_x, empty_y = x[0] > x[1], y[0] > y[1]
    return (empty_x and empty_y) or (not empty_x and not empty_y and x == y)


def _window_for(parts, rows, keys, lo, hi, exact):
    """A window ``(L, R)`` with which one call over local ``rows`` x ``keys`` selects exactly
    the pairs of ``parts`` with ``lo <= T <= hi`` (the pairs of the rectangle that no part
    covers are not to be selected either: callers pass parts that tile it). ``exact``: also
    ``c = 0`` on every part with a selected pair (ALiBi's distance then is the true one).
    None where no window does."""
    r0, r1 = rows
    k0, k1 = keys
    facts = []   # (c, the part's T range, the band's T range on it)
    for p in parts:
        if p.m <= 0 or p.n <= 0:
            continue
        c = (p.a - p.ra + r1) - (p.b - p.kb + k1)
        span = (p.a - (p.b + p.n - 1), p.a + p.m - 1 - p.b)
        want = (span[0] if lo is None else max(lo, span[0]), span[1] if hi is None else min(hi, span[1]))
        if exact and want[0] <= want[1] and c != 0:
            return None
        facts.append((c, span, want))
    lefts, rights = [None], [None]
    for c, span, want in facts:
        lefts += [x for x in (want[1] - c, span[1] - c, span[0] - 1 - c) if x >= 0]
        rights += [x for x in (c - want[0], c - span[0], c - span[1] - 1) if x >= 0]
    for left in sorted(set(lefts), key=lambda x: (x is not None, x)):
        for right in sorted(set(rights), key=lambda x: (x is not None, x)):
            if all(_intervals_equal(want, (span[0] if right is None else max(span[0], c - right),
                                           span[1] if left is None else min(span[1], c + left)))
                   for c, span, want in facts):
                return left, right
    return None


def _piece(part: _Part, box, lo, hi, slope_sign=1, shift=0) -> Piece:
    """The piece of ``part`` over its ``box`` (global, inclusive), band ``lo <= T <= hi``."""
    i0, i1, j0, j1 = box
    c = i1 - j1
    left = None if hi is None or hi >= i1 - j0 else hi - c
    right = None if lo is None or lo <= i0 - j1 else c - lo
    assert (left is None or left >= 0) and (right is None or right >= 0), (box, lo, hi)
    rows = (part.ra + i0 - part.a, part.ra + i1 + 1 - part.a)
    keys = (part.kb + j0 - part.b, part.kb + j1 + 1 - part.b)
    return Piece(rows, keys, (left, right), slope_sign, shift)


def _alibi_pieces(part: _Part, lo: int, hi: int) -> list[Piece]:
    """Pieces of ``part`` (one sign of T over ``[lo, hi]``) on each of which the call's and the
    true ALiBi distance differ by a constant: split at the corner until it lies on an edge."""
    box = part.box(lo, hi)
    if box is None:
        return []
    i0, i1, j0, j1 = box
    lo, hi = max(lo, i0 - j1), min(hi, i1 - j0)
    c = i1 - j1
    if c == 0:
        return [_piece(part, box, lo, hi)]
    if c in (lo, hi):
        true_sign = 1 if lo >= 0 else -1          # |T| = true_sign * T on the piece
        call_sign = 1 if c == lo else -1          # |t| = call_sign * (T - c)
        return [_piece(part, box, lo, hi, true_sign * call_sign, true_sign * c)]
    return _alibi_pieces(part, lo, c - 1) + _alibi_pieces(part, c, hi)


def _mirror(part: _Part, mq: int, mk: int) -> _Part:
    """The part in the shards reversed (``mq`` rows, ``mk`` keys): positions negated, so
    ``T`` becomes ``-T``, and local rows and keys counted from the ends."""
    return _Part(-(part.a + part.m - 1), part.m, mq - part.ra - part.m, -(part.b + part.n - 1), part.n,
                 mk - part.kb - part.n)


def _row_chunks(part: _Part, lo: int, hi: int, rows: int) -> list[Piece]:
    """`_alibi_pieces` of ``part`` (keys before rows: ``0 <= lo``) in chunks of ``rows`` rows."""
    box = part.box(lo, hi)
    if box is None:
        return []
    i0, i1, j0, j1 = box
    return [x for start in range(i0, i1 + 1, rows)
            for x in _alibi_pieces(part.crop(start, min(i1, start + rows - 1), j0, j1), lo, hi)]


def _part_pieces(part: _Part, lo, hi, alibi_rows, mq: int, mk: int) -> list[Piece]:
    """A part's pieces: one with the band's window, or (ALiBi off its own diagonal) the pairs
    whose keys come first in chunks of ``alibi_rows`` rows, where each row's nearest keys lie
    within the chunk of the corner, and the others the same way on the shards reversed
    (``mirrored``: there they come first)."""
    box = part.box(lo, hi)
    if box is None:
        return []
    i0, i1, j0, j1 = box
    if alibi_rows is None or i1 - j1 == 0:
        return [_piece(part, box, lo, hi)]
    t0, t1 = max(i0 - j1, -np.inf if lo is None else lo), min(i1 - j0, np.inf if hi is None else hi)
    pieces = _row_chunks(part, int(max(t0, 0)), int(t1), alibi_rows) if t1 >= 0 else []
    if t0 <= -1:
        pieces += [dataclasses.replace(x, mirrored=True)
                   for x in _row_chunks(_mirror(part, mq, mk), int(-min(t1, -1)), int(-t0), alibi_rows)]
    return pieces


# ---------------------------------------------------------------------------------------------
# A block: one query shard against one key shard
# ---------------------------------------------------------------------------------------------


def _problems(qsegs, ksegs, sequences):
    """The problems of a block, each a list of parts (pairs of segments, cut to one sequence
    when packed): one problem for a dense block, one per sequence for a packed one."""
    if sequences is None:
        return [[_Part(p.start, p.length, p.offset, s.start, s.length, s.offset) for p in qsegs for s in ksegs]]
    problems = []
    for g0, g1 in zip(sequences[:-1], sequences[1:]):
        cut = [[(max(g0, x.start), min(g1, x.start + x.length), x.offset - x.start) for x in segs]
               for segs in (qsegs, ksegs)]
        problems.append([_Part(a0, a1 - a0, a0 + qo, b0, b1 - b0, b0 + ko)
                         for a0, a1, qo in cut[0] if a1 > a0 for b0, b1, ko in cut[1] if b1 > b0])
    return problems


def _problem_pieces(parts, lo, hi, alibi_rows, mq: int, mk: int) -> list[Piece]:
    """One piece for the whole problem (cropped to its allowed pairs) where a window expresses
    it, else the pieces of each part."""
    boxes = [(p, p.box(lo, hi)) for p in parts]
    boxes = [(p, b) for p, b in boxes if b is not None]
    if not boxes:
        return []
    local = [_piece(p, b, lo, hi) for p, b in boxes]
    rows = min(x.rows[0] for x in local), max(x.rows[1] for x in local)
    keys = min(x.keys[0] for x in local), max(x.keys[1] for x in local)
    to_global = [(p.a - p.ra, p.b - p.kb) for p in parts]
    cropped = [p.crop(rows[0] + dr, rows[1] - 1 + dr, keys[0] + dk, keys[1] - 1 + dk)
               for p, (dr, dk) in zip(parts, to_global)]
    window = _window_for(cropped, rows, keys, lo, hi, exact=alibi_rows is not None)
    if window is not None and _tiles(cropped, rows, keys):
        return [Piece(rows, keys, window)]
    return [x for p, _ in boxes for x in _part_pieces(p, lo, hi, alibi_rows, mq, mk)]


def _tiles(parts, rows, keys) -> bool:
    """Whether the parts cover the local rectangle ``rows`` x ``keys`` (their rows and keys
    are whole runs of the shards, so the products of their row and key runs tile it)."""
    row_runs = {(p.ra, p.ra + p.m) for p in parts if p.m > 0 and p.n > 0}
    key_runs = {(p.kb, p.kb + p.n) for p in parts if p.m > 0 and p.n > 0}
    covered = sum((r1 - r0) * (k1 - k0) for r0, r1 in row_runs for k0, k1 in key_runs)
    pairs = {(p.ra, p.kb) for p in parts if p.m > 0 and p.n > 0}
    return len(pairs) == len(row_runs) * len(key_runs) and covered == (rows[1] - rows[0]) * (keys[1] - keys[0])


def _merge_dense(pieces: list[Piece]) -> list[Piece]:
    """Unmasked pieces without ALiBi that share their keys and meet along rows (or the
    reverse) become one."""
    pieces = list(pieces)
    merged = True
    while merged:
        merged = False
        for i, p in enumerate(pieces):
            for j, q in enumerate(pieces):
                if i == j or p.window != (None, None) or q.window != (None, None) or p.shift or q.shift:
                    continue
                if p.keys == q.keys and p.rows[1] == q.rows[0]:
                    joined = Piece((p.rows[0], q.rows[1]), p.keys)
                elif p.rows == q.rows and p.keys[1] == q.keys[0]:
                    joined = Piece(p.rows, (p.keys[0], q.keys[1]))
                else:
                    continue
                pieces[min(i, j)] = joined
                del pieces[max(i, j)]
                merged = True
                break
            if merged:
                break
    return pieces


def _group_packed(pieces: list[Piece]) -> list[Call]:
    """Pieces into packed calls: one window, slope sign and direction a call, rows and keys
    increasing."""
    groups: list[list[Piece]] = []
    for p in sorted(pieces, key=lambda x: (x.rows[0], x.keys[0])):
        for g in groups:
            last = g[-1]
            alike = (last.window, last.slope_sign, last.mirrored) == (p.window, p.slope_sign, p.mirrored)
            if alike and last.rows[1] <= p.rows[0] and last.keys[1] <= p.keys[0]:
                g.append(p)
                break
        else:
            groups.append([p])
    return [Call(tuple(g)) for g in groups]


@functools.lru_cache(maxsize=4096)
def plan_block(qsegs: tuple[Segment, ...], ksegs: tuple[Segment, ...], lo: int | None, hi: int | None,
               sequences: tuple[int, ...] | None = None, alibi_rows: int | None = None) -> tuple[Call, ...]:
    """The calls that compute the query shard ``qsegs`` against the key shard ``ksegs`` under
    the band ``lo <= T <= hi`` (None: unbounded), each allowed (row, key) pair in exactly one
    call, no call on a block with no allowed pair. ``sequences``: the global offsets of packed
    sequences (every pair across sequences masked). ``alibi_rows``: with ALiBi, the most rows
    a piece off its own diagonal may have (None: no ALiBi)."""
    mq, mk = (sum(s.length for s in segs) for segs in (qsegs, ksegs))
    pieces = [x for parts in _problems(qsegs, ksegs, sequences)
              for x in _problem_pieces(parts, lo, hi, alibi_rows, mq, mk)]
    if sequences is None:
        if alibi_rows is None:
            pieces = _merge_dense(pieces)
        return tuple(Call((p,)) for p in pieces)
    return tuple(_group_packed(pieces))


def band(left: int | None, right: int | None) -> tuple[int | None, int | None]:
    """cuflash's window sides as bounds on ``T = i - j``: ``-right <= T <= left``."""
    return (None if right is None else -right), left
