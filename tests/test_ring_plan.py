"""The ring's plans (cuflash.distributed._plan), pair by pair: which calls each step makes, with
which windows, ALiBi signs and corrections (docs/contract.md, "Ring attention"; docs/design.md,
"Ring attention"). No arrays, no GPU: every (row, key) pair of small sequences is checked
against the global mask.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuflash.distributed import _plan

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
BANDS = [(None, None), (0, None), (0, 3), (-2, 5), (-4, 0), (1, 6), (None, -1), (-3, None), (2, 2)]


def call_pairs(call: _plan.Call, mq: int, mk: int):
    """(row, key) -> (the call's t, the piece) for every pair the call selects, in local
    positions of shards of ``mq`` rows and ``mk`` keys: each piece is a problem of its own,
    bottom-right aligned, masked by its window (a mirrored one on the shards reversed)."""
    selected = {}
    for p in call.pieces:
        m, n = p.rows[1] - p.rows[0], p.keys[1] - p.keys[0]
        left, right = p.window
        for x in range(p.rows[0], p.rows[1]):
            for y in range(p.keys[0], p.keys[1]):
                t = (x - p.rows[0]) - (y - p.keys[0]) + (n - m)
                if (left is None or t <= left) and (right is None or t >= -right):
                    pair = (mq - 1 - x, mk - 1 - y) if p.mirrored else (x, y)
                    assert pair not in selected, f"pair {pair} twice in one call"
                    selected[pair] = (t, p)
    return selected


def check_offsets(call: _plan.Call):
    """A packed call's offsets: its pieces, and between them sequences of rows without keys or
    keys without rows, never both."""
    if not call.packed:
        return
    cu_q, cu_k = call.offsets()
    lengths = [(b - a, d - c) for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]
    assert all(nq >= 0 and nk >= 0 for nq, nk in lengths)
    assert sum(1 for nq, nk in lengths if nq and nk) == len(call.pieces)
    assert cu_q[-1] == call.rows[1] - call.rows[0] and cu_k[-1] == call.keys[1] - call.keys[0]


def allowed(i, j, lo, hi, sequences):
    t = i - j
    if (lo is not None and t < lo) or (hi is not None and t > hi):
        return False
    if sequences is None:
        return True
    return np.searchsorted(sequences, i, side="right") == np.searchsorted(sequences, j, side="right")


def check_block(qsegs, ksegs, lo, hi, sequences=None, alibi_rows=None):
    """Every allowed pair of the block in exactly one call, nothing else; with ALiBi, each
    call's distance differs from the true one by its piece's constant, and the call's term is
    within alibi_rows of 0 at each row's largest (where that row's weight is)."""
    calls = _plan.plan_block(qsegs, ksegs, lo, hi, sequences, alibi_rows)
    qpos, kpos = _plan.positions(qsegs), _plan.positions(ksegs)
    seen = {}
    for call in calls:
        check_offsets(call)
        for (x, y), (t, piece) in call_pairs(call, len(qpos), len(kpos)).items():
            assert (x, y) not in seen, f"pair {(x, y)} in two calls"
            seen[(x, y)] = (t, piece)
    want = {(x, y) for x, i in enumerate(qpos) for y, j in enumerate(kpos) if allowed(i, j, lo, hi, sequences)}
    assert set(seen) == want, f"extra {sorted(set(seen) - want)[:5]}, missing {sorted(want - set(seen))[:5]}"
    if not want:
        assert calls == (), "a block without an allowed pair makes no call"
    if alibi_rows is None:
        return calls
    tops = {}
    for (x, y), (t, piece) in seen.items():
        true_t = int(qpos[x] - kpos[y])
        call_term = -piece.slope_sign * abs(t)
        assert call_term + abs(true_t) == piece.shift, (x, y, t, piece)
        if piece.shift:
            key = (x, piece)
            tops[key] = max(tops.get(key, -np.inf), call_term)
    assert all(abs(v) <= alibi_rows for v in tops.values()), max(abs(v) for v in tops.values())
    return calls


@st.composite
def shards(draw):
    """A layout, its shard lengths and two ranks of it."""
    size = draw(st.integers(1, 6))
    layout = draw(st.sampled_from(_plan.LAYOUTS))
    if layout == "zigzag":
        lengths = (2 * draw(st.integers(0, 5)),) * size
    else:
        lengths = tuple(draw(st.lists(st.integers(0, 9), min_size=size, max_size=size)))
    r, s = draw(st.integers(0, size - 1)), draw(st.integers(0, size - 1))
    return layout, lengths, r, s


@settings(max_examples=250, **FAST)
@given(shards=shards(), band=st.sampled_from(BANDS), packed=st.booleans(), alibi=st.sampled_from((None, 1, 2, 5)),
       data=st.data())
def test_every_allowed_pair_in_exactly_one_call(shards, band, packed, alibi, data):
    layout, lengths, r, s = shards
    total = sum(lengths)
    sequences = None
    if packed:
        cuts = sorted(data.draw(st.lists(st.integers(0, total), max_size=4)))
        sequences = tuple([0, *cuts, total])
    check_block(_plan.segments(layout, lengths, r), _plan.segments(layout, lengths, s), *band, sequences, alibi)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_zigzag_causal_steps_are_one_call_each_and_balanced(size):
    """Causal, zigzag: rank r's own shard is one causal call, every other one call without a
    mask over half the pairs; every rank computes the same number of pairs at every step."""
    lengths = (16,) * size
    segs = [_plan.segments("zigzag", lengths, r) for r in range(size)]
    per_step = {}
    for r in range(size):
        for t in range(size):
            calls = check_block(segs[r], segs[(r - t) % size], 0, None)
            assert len(calls) == 1
            (piece,) = calls[0].pieces
            assert piece.window == ((None, 0) if t == 0 else (None, None))
            work = len(call_pairs(calls[0], 16, 16))
            per_step.setdefault(t, set()).add(work)
    assert all(len(works) == 1 for works in per_step.values()), per_step
    assert per_step[1 % size] == ({16 * 17 // 2} if size == 1 else {8 * 16})


def test_contiguous_causal_skips_the_blocks_ahead_and_leaves_the_ones_behind_unmasked():
    lengths = (5, 0, 9, 4)
    segs = [_plan.segments("contiguous", lengths, r) for r in range(4)]
    assert _plan.plan_block(segs[0], segs[2], 0, None) == ()
    (behind,) = _plan.plan_block(segs[2], segs[0], 0, None)
    assert behind.pieces == (_plan.Piece((0, 9), (0, 5)),)
    (diagonal,) = _plan.plan_block(segs[2], segs[2], 0, None)
    assert diagonal.pieces == (_plan.Piece((0, 9), (0, 9), (None, 0)),)
    assert _plan.plan_block(segs[1], segs[0], 0, None) == ()   # an empty shard computes nothing


def test_a_window_crops_the_block_to_its_band():
    """A sliding window of 3 keys back: the block behind sees only its last keys, with the
    window's edge placed by the crop's own corner."""
    segs = [_plan.segments("contiguous", (8, 8), r) for r in range(2)]
    (call,) = check_block(segs[1], segs[0], 0, 3)
    assert call.pieces == (_plan.Piece((0, 3), (5, 8), (0, None)),)


def test_alibi_off_the_diagonal_splits_at_the_corner_with_opposite_slopes():
    """The block behind, 4 rows by 4 keys, in one chunk: the pairs below its corner's diagonal
    with the slopes as they are, the others with them negated; both corrected by a constant."""
    segs = [_plan.segments("contiguous", (4, 4), r) for r in range(2)]
    calls = check_block(segs[1], segs[0], 0, None, None, 4)
    assert [(c.pieces[0].slope_sign, c.pieces[0].shift) for c in calls] == [(-1, 3), (1, 4)]
    (exact,) = check_block(segs[1], segs[1], 0, None, None, 4)   # the diagonal: ALiBi as it is
    assert exact.pieces == (_plan.Piece((0, 4), (0, 4), (None, 0)),)


@pytest.mark.parametrize("layout", _plan.LAYOUTS)
def test_shard_lengths_and_positions(layout):
    assert _plan.shard_lengths(12, 3, layout) == (4, 4, 4)
    if layout == "zigzag":
        assert [_plan.positions(_plan.segments(layout, (4,) * 3, r)).tolist() for r in range(3)] == \
            [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
        with pytest.raises(ValueError, match="not a multiple of 6"):
            _plan.shard_lengths(10, 3, layout)
    else:
        assert _plan.shard_lengths(10, 3, layout) == (4, 3, 3)
    with pytest.raises(ValueError, match="layout must be one of"):
        _plan.check_layout("ring")
