"""Ring attention (cuflash.distributed) on the single-process stand-in, computed by the float64
reference: the sharded result against ``cuflash.reference`` over the whole sequence, forward and
backward, for 1 to 8 ranks (docs/contract.md, "Ring attention"). No GPU needed; the GPU twins
of these tests are in test_ring_attention_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import distributed, reference
from cuflash.distributed import _ring

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
MASKS = ({}, {"causal": True}, {"window": (3, 1)}, {"window": (None, 2)}, {"causal": True, "window": (4, None)},
         {"window": (0, 0)})
ROOT = Path(__file__).resolve().parent.parent


def ring_case(rng, size, layout, lengths=None, chunk=2, heads=(2,), gqa=False, d=6, dv=6, mods=(), cuts=None,
              **mask):
    """Whole-sequence arrays and keywords of one case, and its shards."""
    n = sum(lengths) if lengths is not None else 2 * chunk * size
    if gqa:   # two K/V heads, two query heads each: q (2, 2, n, d) against k, v (2, 1, n, d)
        q, k, v = (rng.standard_normal(shape) for shape in ((2, 2, n, d), (2, 1, n, d), (2, 1, n, dv)))
    else:
        q, k, v = (rng.standard_normal(heads + (n, x)) for x in (d, d, dv))
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    kw = dict(mask)
    if "softcap" in mods:
        kw["softcap"] = 1.5
    if "alibi" in mods:
        kw["alibi_slopes"] = rng.uniform(0.1, 2.0, batch[-1:]).astype(np.float32)
    if "sinks" in mods:
        kw["sinks"] = rng.standard_normal(batch).astype(np.float32)
    whole, ring = dict(kw), dict(kw, layout=layout)
    if cuts is not None:
        cu = np.asarray([0, *sorted(min(c, n) for c in cuts), n], dtype=np.int32)
        whole.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
        ring["cu_seqlens"] = cu
    return (q, k, v), whole, ring, lengths


def run_ring(size, arrays, ring, lengths, dout=None, **options):
    """Each rank's (out, lse, gradients) of the stand-in, shards cut with `shard`."""
    layout = ring["layout"]
    shards = [distributed.shard(x, size, layout=layout, lengths=lengths) for x in arrays]
    douts = None if dout is None else distributed.shard(dout, size, layout=layout, lengths=lengths)

    def rank(comm):
        q, k, v = (s[comm.rank] for s in shards)
        out, lse = distributed.ring_attention(q, k, v, comm, return_lse=True, **ring)
        if douts is None:
            return out, lse, None
        grads = distributed.ring_attention_backward(douts[comm.rank], q, k, v, out, lse, comm, **ring, **options)
        return out, lse, grads

    return distributed.run_ranks(size, rank)


def check_against_reference(size, case, rng):
    (q, k, v), whole, ring, lengths = case
    layout = ring["layout"]
    out, lse = reference.attention(q, k, v, return_lse=True, **whole)
    dout = rng.standard_normal(out.shape)
    grads = reference.attention_backward(dout, q, k, v, out, lse, **whole)
    results = run_ring(size, (q, k, v), ring, lengths, dout)
    got_out = distributed.unshard([r[0] for r in results], layout=layout)
    got_lse = distributed.unshard([r[1] for r in results], layout=layout, axis=-1)
    np.testing.assert_allclose(got_out, out, rtol=1e-9, atol=1e-10)
    finite = np.isfinite(lse)
    assert np.array_equal(np.isfinite(got_lse), finite)
    np.testing.assert_allclose(got_lse[finite], lse[finite], rtol=1e-9, atol=1e-10)
    for i, name in enumerate(("dq", "dk", "dv")):
        got = distributed.unshard([r[2][i] for r in results], layout=layout)
        assert got.shape == grads[i].shape, name
        np.testing.assert_allclose(got, grads[i], rtol=1e-9, atol=1e-10, err_msg=name)
    if "sinks" in whole:   # each rank's rows' share, summed over the ranks
        np.testing.assert_allclose(sum(r[2][3] for r in results), grads[3], rtol=1e-9, atol=1e-10)
    return results


@st.composite
def cases(draw):
    size = draw(st.integers(1, 8))
    layout = draw(st.sampled_from(distributed.LAYOUTS))
    lengths = None if layout == "zigzag" else draw(st.lists(st.integers(0, 6), min_size=size, max_size=size))
    cuts = draw(st.none() | st.lists(st.integers(0, 40), max_size=3))
    return dict(size=size, layout=layout, lengths=lengths, chunk=draw(st.integers(1, 3)), gqa=draw(st.booleans()),
                dv=draw(st.sampled_from((4, 6))), mods=draw(st.sets(st.sampled_from(("softcap", "alibi", "sinks")))),
                cuts=cuts, mask=draw(st.sampled_from(MASKS)), span=draw(st.sampled_from((1024, 1, 3))))


@settings(max_examples=150, **FAST)
@given(c=cases(), seed=st.integers(0, 2**32 - 1))
def test_ring_is_attention_over_the_whole_sequence(c, seed):
    """Ranks 1 to 8, contiguous shards of any lengths (empty ones too) or zigzag ones, every
    mask, grouped queries, softcap, ALiBi (its pieces in chunks as small as one row: `span`),
    sinks, packed sequences: out, lse and the gradients of every rank, put together, are the
    reference's over the whole sequence."""
    rng = np.random.default_rng(seed)
    case = ring_case(rng, c["size"], c["layout"], c["lengths"], c["chunk"], gqa=c["gqa"], dv=c["dv"], mods=c["mods"],
                     cuts=c["cuts"], **c["mask"])
    with mock.patch.dict(_ring.ALIBI_SPAN, {"float64": c["span"]}):
        check_against_reference(c["size"], case, rng)


@pytest.mark.parametrize("layout", distributed.LAYOUTS)
def test_ring_of_eight_causal_with_every_modifier(layout):
    """A fixed case at 8 ranks: causal, grouped queries, softcap, ALiBi and sinks together."""
    rng = np.random.default_rng(8)
    lengths = None if layout == "zigzag" else [3, 0, 5, 1, 4, 4, 2, 7]
    case = ring_case(rng, 8, layout, lengths, gqa=True, mods=("softcap", "alibi", "sinks"), causal=True)
    check_against_reference(8, case, rng)


def test_ring_is_deterministic_and_its_vjp_is_its_backward():
    """The same bits on every run (threads scheduled as they come); ring_attention_vjp's
    closure gives ring_attention_backward's gradients."""
    rng = np.random.default_rng(1)
    (q, k, v), _, ring, lengths = ring_case(rng, 4, "zigzag", chunk=3, mods=("alibi", "sinks"), causal=True)
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    first, second = (run_ring(4, (q, k, v), ring, lengths, dout) for _ in range(2))
    for a, b in zip(first, second):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
        assert all(np.array_equal(x, y) for x, y in zip(a[2], b[2]))
    shards = [distributed.shard(x, 4, layout="zigzag") for x in (q, k, v, dout)]

    def rank(comm):
        qs, ks, vs, ds = (s[comm.rank] for s in shards)
        out, vjp = distributed.ring_attention_vjp(qs, ks, vs, comm, **ring)
        return out, vjp(ds)

    for (out, grads), want in zip(distributed.run_ranks(4, rank), first):
        assert np.array_equal(out, want[0]) and all(np.array_equal(x, y) for x, y in zip(grads, want[2]))


# ---------------------------------------------------------------------------------------------
# Errors: the same on every rank, before any send
# ---------------------------------------------------------------------------------------------


class Counting:
    """A rank's communicator that counts its sends."""

    def __init__(self, comm):
        self.comm, self.sends = comm, 0
        self.rank, self.size, self.xp = comm.rank, comm.size, comm.xp

    def sendrecv(self, *args):
        self.sends += 1
        return self.comm.sendrecv(*args)

    def allgather_bytes(self, payload):
        return self.comm.allgather_bytes(payload)

    def abort(self, reason):
        self.comm.abort(reason)


def every_rank_raises(size, args_of_rank, **keywords):
    """Each rank's exception (none may return) and that nothing was sent; then the same world
    runs a good call, so the communicators are still usable."""
    counters = []

    def rank(comm):
        counting = Counting(comm)
        counters.append(counting)
        try:
            distributed.ring_attention(*args_of_rank(comm.rank), counting, **keywords)
        except Exception as err:   # noqa: BLE001 - returned for the test to look at
            good = distributed.ring_attention(*(np.ones((1, 4, 8)),) * 3, comm)
            assert good.shape == (1, 4, 8)
            return err
        return None

    errors = distributed.run_ranks(size, rank)
    assert all(isinstance(e, Exception) for e in errors), errors
    assert all(c.sends == 0 for c in counters), "something was sent before the checks"
    assert len({(type(e), str(e)) for e in errors}) == 1, errors
    return errors[0]


def test_mismatched_shards_raise_the_same_error_on_every_rank():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 8))
    odd = rng.standard_normal((2, 4, 6))
    err = every_rank_raises(3, lambda r: (x, x, x) if r != 2 else (odd, odd, odd))
    assert isinstance(err, ValueError)
    assert str(err) == ("ring_attention: the ranks disagree on q's shape (but axis -2): [2, None, 8] on rank 0, "
                        "[2, None, 6] on rank 2")
    err = every_rank_raises(2, lambda r: (x, x[..., :3, :], x[..., :3, :]))
    assert isinstance(err, ValueError) and "rank 0: q and k must hold the same positions" in str(err)
    err = every_rank_raises(2, lambda r: (x.tolist() if r == 1 else x, x, x))
    assert isinstance(err, TypeError) and str(err) == \
        "ring_attention: rank 1: q must be a numpy.ndarray, the communicator's array module, got builtins.list"
    err = every_rank_raises(2, lambda r: (x, x, x), causal=None)
    assert isinstance(err, TypeError) and "rank 0: causal must be a bool" in str(err)


@pytest.mark.parametrize("char", ["x", "\u00e9", "\u4e2d", "\U0001f600", "\x01"])
def test_a_long_error_message_fits_the_handshake(char):
    """However long the message and whatever its characters (escaped in JSON they take up to 12
    bytes), a rank's part fits allgather_bytes' limit and carries the start of the message."""
    from cuflash.distributed._comm import MAX_PAYLOAD

    facts = {"n": 8, "batch": [2, 4]}
    for length in (10, 5000, 100_000):
        message = char * length
        part = _ring._payload(3, 4, ValueError(message), facts)
        assert len(part) <= MAX_PAYLOAD
        said = json.loads(part)
        assert said["rank"] == 3 and said["batch"] == [2, 4] and said["error"][0] == "ValueError"
        assert said["error"][1] and message.startswith(said["error"][1])
        assert len(said["error"][1]) == length or len(part) > MAX_PAYLOAD // 4
    assert json.loads(_ring._payload(0, 1, None, facts))["error"] is None


def test_ranks_that_disagree_on_a_keyword_raise_on_every_rank():
    x = np.ones((1, 4, 8))
    counters = []

    def rank(comm):
        counting = Counting(comm)
        counters.append(counting)
        return distributed.ring_attention(x, x, x, counting, causal=comm.rank == 1)

    errors = distributed.run_ranks(2, rank, return_exceptions=True)
    assert [str(e) for e in errors] == ["ring_attention: the ranks disagree on the mask (left, right): "
                                        "[None, None] on rank 0, [None, 0] on rank 1"] * 2
    assert all(c.sends == 0 for c in counters)


def test_layouts_lengths_and_offsets_are_checked_against_every_rank():
    x, y = np.ones((1, 4, 8)), np.ones((1, 6, 8))
    err = every_rank_raises(2, lambda r: (x, x, x) if r == 0 else (y, y, y), layout="zigzag")
    assert "layout='zigzag' needs the same even number of rows on every rank" in str(err)
    err = every_rank_raises(2, lambda r: (x, x, x), seqlen=16)
    assert str(err) == ("ring_attention: the shards of the 2 ranks hold 8 positions, but seqlen = 16: were they cut "
                        "for another number of ranks?")
    err = every_rank_raises(2, lambda r: (x, x, x), cu_seqlens=np.array([0, 3, 7], dtype=np.int32))
    assert "cu_seqlens_q must end at q.shape[-2] = 8" in str(err) and "the 2 ranks' shards" in str(err)
    err = every_rank_raises(2, lambda r: (x, x, x), layout="ring")
    assert "rank 0: layout must be one of 'contiguous', 'zigzag'" in str(err)
    err = every_rank_raises(2, lambda r: (x, x, x), alibi_slopes=np.ones(3, dtype=np.float32))
    assert "alibi_slopes must have a shape that broadcasts to the batch dims (1,)" in str(err)


def test_a_backward_with_the_wrong_arrays_raises_on_every_rank():
    x = np.ones((1, 4, 8))

    def rank(comm):
        out, lse = distributed.ring_attention(x, x, x, comm, return_lse=True)
        dout = out if comm.rank == 0 else out[..., :7]
        return distributed.ring_attention_backward(dout, x, x, x, out, lse, comm)

    errors = distributed.run_ranks(2, rank, return_exceptions=True)
    assert len({str(e) for e in errors}) == 1 and all(isinstance(e, ValueError) for e in errors)
    assert str(errors[0]).startswith("ring_attention_backward: rank 1: dout must have shape (1, 4, 8)")


def test_not_a_communicator():
    x = np.ones((1, 4, 8))
    with pytest.raises(TypeError, match="comm must be a communicator"):
        distributed.ring_attention(x, x, x, object())


# ---------------------------------------------------------------------------------------------
# Failures: a rank that raises does not leave the others waiting
# ---------------------------------------------------------------------------------------------


def test_a_rank_that_fails_mid_ring_stops_the_others():
    """Rank 2 raises in its second step's attention; run_ranks raises rank 2's own error. No
    other rank hangs: each either finishes with what it had already been sent (the threads'
    timing decides) or stops with PeerError at its next wait, and rank 3, which needs rank 2's
    last forward, always stops."""
    x = np.random.default_rng(0).standard_normal((1, 8, 8))
    real = _ring._Backend.forward
    calls = {}

    def failing(self, q, k, v, call, opts):
        import threading

        name = threading.current_thread().name
        calls[name] = calls.get(name, 0) + 1
        if name == "cuflash-rank-2" and calls[name] == 2:
            raise MemoryError("out of memory on rank 2")
        return real(self, q, k, v, call, opts)

    with mock.patch.object(_ring._Backend, "forward", failing):
        with pytest.raises(MemoryError, match="out of memory on rank 2"):
            distributed.run_ranks(4, lambda comm: distributed.ring_attention(x, x, x, comm))
        calls.clear()
        errors = distributed.run_ranks(4, lambda comm: distributed.ring_attention(x, x, x, comm),
                                       return_exceptions=True)
    assert isinstance(errors[2], MemoryError)
    assert isinstance(errors[3], distributed.PeerError), errors[3]
    for r in (0, 1, 3):
        if isinstance(errors[r], np.ndarray):
            assert errors[r].shape == x.shape   # its shard's rows: it had been sent all it needed
            continue
        assert isinstance(errors[r], distributed.PeerError), errors[r]
        assert "rank 2 failed" in str(errors[r]) and "out of memory on rank 2" in str(errors[r])


def test_a_rank_that_never_comes_times_out_the_others():
    x = np.ones((1, 4, 8))

    def rank(comm):
        if comm.rank == 1:
            return None   # never calls ring_attention
        return distributed.ring_attention(x, x, x, comm)

    world = distributed.LocalWorld(2, timeout=0.3)
    errors = []

    def main(comm):
        try:
            rank(comm)
        except distributed.RingTimeoutError as err:
            errors.append(err)

    import threading

    threads = [threading.Thread(target=main, args=(c,)) for c in world.comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 1 and "rank 0: every rank's part of collective 0 did not come within 0.3 s" in str(errors[0])


# ---------------------------------------------------------------------------------------------
# Shards, positions, the package
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", distributed.LAYOUTS)
def test_shard_and_unshard(layout):
    x = np.arange(2 * 12 * 3).reshape(2, 12, 3)
    parts = distributed.shard(x, 3, layout=layout)
    assert np.array_equal(distributed.unshard(parts, layout=layout), x)
    for r, part in enumerate(parts):
        assert np.array_equal(part, x[:, distributed.shard_positions(12, 3, r, layout=layout)])
    lse = np.arange(24).reshape(2, 12)
    assert np.array_equal(distributed.unshard(distributed.shard(lse, 3, layout=layout, axis=-1), layout=layout,
                                              axis=-1), lse)
    if layout == "contiguous":
        assert [p.shape[1] for p in distributed.shard(x, 3, lengths=[0, 10, 2])] == [0, 10, 2]
        with pytest.raises(ValueError, match="lengths must be 3 non-negative ints adding up to 12"):
            distributed.shard(x, 3, lengths=[1, 2, 3])
    else:
        assert distributed.shard_positions(12, 3, 0, layout=layout).tolist() == [0, 1, 10, 11]
        with pytest.raises(ValueError, match=r"the same even number of rows each, got \[4, 3\]"):
            distributed.unshard([x[:, :4], x[:, :3]], layout=layout)
    with pytest.raises(ValueError, match="rank must be an int from 0 to size - 1 = 2, got -1"):
        distributed.shard_positions(12, 3, -1, layout=layout)
    with pytest.raises(ValueError, match="seqlen must be an int of at least 0, got -6"):
        distributed.shard_positions(-6, 3, 0, layout=layout)
    with pytest.raises(ValueError, match="size must be an int of at least 1, got 3.0"):
        distributed.shard(x, 3.0, layout=layout)
    with pytest.raises(ValueError, match="shards must hold every rank's shard, got none"):
        distributed.unshard([], layout=layout)


def test_import_cuflash_does_not_import_distributed():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(cuflash.__file__).parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", "import sys, cuflash; print('cuflash.distributed' in sys.modules)"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_nccl_communicator_without_cupy_says_why():
    """Where CuPy cannot be used, making an NcclCommunicator raises cuflash's one-line reason."""
    from cuflash import _gpu

    if _gpu.problem() is None:
        pytest.skip("a GPU is here: test_ring_attention_gpu.py covers NCCL")
    with pytest.raises((ImportError, RuntimeError), match="CuPy|NVIDIA|GPU|NCCL"):
        distributed.NcclCommunicator(2, bytes(128), 0)


# ---------------------------------------------------------------------------------------------
# launch: one process per rank (a stand-in for NcclCommunicator, made in each process)
# ---------------------------------------------------------------------------------------------


def test_launch_returns_every_rank_result_and_reports_failures():
    """launch's processes (ring_workers.py: a stand-in communicator and what the ranks do): the
    results in rank order; a rank that raises and one that dies without a word, both reported."""
    import ring_workers

    from cuflash.distributed import _launch

    got = _launch._spawn(ring_workers.rank_says, 3, (np.arange(3),), [5, 6, 7], 120, ring_workers.FakeComm, b"id")
    assert [g[:4] for g in got] == [(r, 3, 5 + r, b"id") for r in range(3)]
    assert np.array_equal(got[2][4], [0, 2, 4])
    with pytest.raises(distributed.LaunchError) as err:
        _launch._spawn(ring_workers.rank_fails, 3, (), None, 120, ring_workers.FakeComm, b"id")
    assert str(err.value).startswith("2 of 3 ranks failed:\n--- rank 1 ---\nTraceback")
    assert "ValueError: rank 1 cannot go on" in str(err.value)
    assert str(err.value).endswith("--- rank 2 ---\nthe process exited with code 3")
    with pytest.raises(ValueError, match=r"devices must name 2 GPUs, got \[0\]"):
        _launch._spawn(ring_workers.rank_says, 2, (1,), [0], 120, ring_workers.FakeComm, b"id")
    with pytest.raises(ValueError, match="size must be an int of at least 1, got 0"):   # before any GPU work
        distributed.launch(ring_workers.rank_says, 0)
