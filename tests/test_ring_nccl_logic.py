"""NcclCommunicator's own logic on the CPU, against fakes that follow CuPy's API (cupy.cuda's
Device, Stream, Event; cupy.cuda.nccl's group calls and communicator): the order of the stream
waits and the group around each transfer, the allgather's framing, the polls with a deadline,
the abort, NCCL's asynchronous errors, the bounded setup and the unique id's rendezvous. The real
thing needs two GPUs (test_ring_attention_gpu.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import types

import numpy as np
import pytest

from cuflash.distributed import PeerError, RingError, RingTimeoutError, _nccl

LOG: list = []
_ids = itertools.count(1)


class Stream:
    current = None

    def __init__(self, name="stream"):
        self.name, self.ptr = name, next(_ids)

    def wait_event(self, event):
        LOG.append(("wait", self.name, event.name))

    def __enter__(self):
        self.before, Stream.current = Stream.current, self
        return self

    def __exit__(self, *exc):
        Stream.current = self.before


COMPUTE = Stream("compute")
Stream.current = COMPUTE


class Event:
    polls_until_done = 0

    def __init__(self, disable_timing=False):
        self.name, self.polls = f"event{next(_ids)}", 0

    def record(self, stream=None):
        LOG.append(("record", self.name, stream.name))

    @property
    def done(self):
        self.polls += 1
        return self.polls > Event.polls_until_done


class Array:
    """A 'device' array: NumPy data behind a pointer the fake NCCL can find."""

    registry: dict = {}

    def __init__(self, data, device=0):
        self.host, self.device = data, types.SimpleNamespace(id=device)
        self.data = types.SimpleNamespace(ptr=next(_ids))
        self.nbytes, self.flags = data.nbytes, types.SimpleNamespace(c_contiguous=data.flags.c_contiguous)
        Array.registry[self.data.ptr] = self

    def get(self, stream=None):
        LOG.append(("get", stream.name))
        return self.host.copy()


class FakeNcclComm:
    def __init__(self, size=2, rank=0, async_error=None):
        self.size_, self.rank, self.async_error, self.aborted = size, rank, async_error, False

    def send(self, ptr, count, dtype, peer, stream):
        LOG.append(("send", count, peer, stream))

    def recv(self, ptr, count, dtype, peer, stream):
        LOG.append(("recv", count, peer, stream))

    def allGather(self, send, recv, count, dtype, stream):   # every rank sent this rank's bytes, with its rank
        mine = Array.registry[send].host
        every = Array.registry[recv].host
        for r in range(self.size_):
            every[r] = mine
        LOG.append(("allGather", count, stream))

    def check_async_error(self):
        if self.async_error:
            raise RuntimeError(self.async_error)

    def abort(self):
        self.aborted = True
        LOG.append(("abort",))


nccl = types.SimpleNamespace(NCCL_UINT8=1, groupStart=lambda: LOG.append(("groupStart",)),
                             groupEnd=lambda: LOG.append(("groupEnd",)))
cupy = types.SimpleNamespace(
    uint8=np.uint8,
    asarray=lambda x: Array(np.array(x), 0),
    empty=lambda shape, dtype: Array(np.zeros(shape, dtype=dtype), 0),
    cuda=types.SimpleNamespace(Device=lambda i: contextlib.nullcontext(), Event=Event,
                               get_current_stream=lambda: Stream.current))


def communicator(timeout=5.0, size=2, rank=0, **fake):
    """An NcclCommunicator on the fakes (its constructor's CUDA work skipped)."""
    comm = object.__new__(_nccl.NcclCommunicator)
    comm.rank, comm.size, comm.xp, comm.timeout, comm.device = rank, size, cupy, timeout, 0
    comm._aborted, comm._nccl, comm.stream = None, nccl, Stream("comm")
    comm._comm = FakeNcclComm(size, rank, **fake)
    return comm


@pytest.fixture(autouse=True)
def fresh():
    LOG.clear()
    Event.polls_until_done = 0
    yield


def test_sendrecv_orders_the_transfer_after_the_compute_stream_in_one_group():
    comm = communicator()
    send = [Array(np.zeros((2, 3), np.float16)), Array(np.zeros(0, np.float16))]
    recv = [Array(np.zeros((4, 3), np.float16)), Array(np.zeros(0, np.float16))]
    request = comm.sendrecv(send, 1, recv, 1)
    ready, done = LOG[0][1], LOG[-1][1]
    assert LOG == [("record", ready, "compute"), ("wait", "comm", ready), ("groupStart",),
                   ("send", 12, 1, comm.stream.ptr), ("recv", 24, 1, comm.stream.ptr), ("groupEnd",),
                   ("record", done, "comm")], "empty arrays are not sent"
    LOG.clear()
    request.wait()
    assert LOG == [("wait", "compute", done)]
    request.wait()   # a second wait does nothing
    assert LOG == [("wait", "compute", done)]
    with pytest.raises(ValueError, match="send\\[0\\] must be a C-contiguous array on device 0"):
        comm.sendrecv([Array(np.zeros((3, 2)).T)], 1, [], 1)


def test_allgather_frames_each_rank_payload():
    comm = communicator(size=3)
    assert comm.allgather_bytes(b"rank's facts") == [b"rank's facts"] * 3
    assert [e[0] for e in LOG] == ["allGather", "record", "get"]
    assert LOG[0][1] == 8192 + 8 and LOG[-1] == ("get", "comm")
    with pytest.raises(ValueError, match="at most 8192 bytes"):
        comm.allgather_bytes(bytes(8193))


def test_a_transfer_past_the_deadline_aborts_and_raises():
    comm = communicator(timeout=0.05)
    request = comm.sendrecv([Array(np.zeros(4, np.uint8))], 1, [Array(np.zeros(4, np.uint8))], 1)
    Event.polls_until_done = 10**9
    with pytest.raises(RingTimeoutError, match="rank 0: the transfer to rank 1 and from rank 1 did not complete "
                                               "within 0.05 s: a peer failed or stopped; the communicator is aborted"):
        request.wait()
    assert comm._comm.aborted and ("abort",) in LOG
    with pytest.raises(RingError, match="the communicator was aborted"):
        comm.allgather_bytes(b"")
    comm.abort("again")   # once aborted, aborting does nothing
    assert LOG.count(("abort",)) == 1


def test_an_nccl_error_while_waiting_aborts_and_raises():
    comm = communicator(async_error="NCCL_ERROR_REMOTE_ERROR: peer gone")
    Event.polls_until_done = 10**9
    with pytest.raises(PeerError, match="NCCL reported an error during the allgather.*peer gone"):
        comm.allgather_bytes(b"")
    assert comm._comm.aborted


def test_a_slow_transfer_is_waited_for():
    comm = communicator()
    request = comm.sendrecv([Array(np.zeros(4, np.uint8))], 1, [Array(np.zeros(4, np.uint8))], 1)
    Event.polls_until_done = 5
    request.wait()
    assert not comm._comm.aborted


def test_setup_is_bounded_by_the_timeout():
    """ncclCommInitRank waits for every rank: run in a thread, given up after the timeout."""
    release = threading.Event()

    class Hanging:
        def __init__(self, *args):
            release.wait(10)

    comm = object.__new__(_nccl.NcclCommunicator)
    comm.rank, comm.size, comm.timeout, comm.device = 1, 2, 0.05, 0
    fake = types.SimpleNamespace(NcclCommunicator=Hanging)
    with pytest.raises(RingTimeoutError, match="rank 1: NCCL setup of 2 ranks did not complete within 0.05 s"):
        comm._setup(fake, cupy, (0,) * 128)
    release.set()

    class Failing:
        def __init__(self, *args):
            raise RuntimeError("NCCL_ERROR_INVALID_USAGE")

    with pytest.raises(RingError, match="rank 1: NCCL setup failed: NCCL_ERROR_INVALID_USAGE"):
        comm._setup(types.SimpleNamespace(NcclCommunicator=Failing), cupy, (0,) * 128)


def test_unique_id_rendezvous_through_a_file(tmp_path, monkeypatch):
    uid = bytes(range(256))[:128]
    monkeypatch.setattr(_nccl, "unique_id", lambda: uid)
    path = str(tmp_path / "run.uid")
    got = []
    reader = threading.Thread(target=lambda: got.append(_nccl.share_unique_id(path, 1, timeout=5)))
    reader.start()
    assert _nccl.share_unique_id(path, 0) == uid
    reader.join(10)
    assert got == [uid]
    # CuPy's ids are tuples of signed chars; bytes and such tuples name the same id
    high = bytes(range(128, 256))
    assert _nccl._id_tuple(high)[:2] == (-128, -127) and _nccl._id_tuple(uid)[127] == 127
    assert _nccl._id_tuple(_nccl._id_tuple(high)) == _nccl._id_tuple(high)
    with pytest.raises(ValueError, match="unique id of 128 bytes, got 3"):
        _nccl._id_tuple(b"abc")
    with pytest.raises(RingTimeoutError, match="did not appear in"):
        _nccl.share_unique_id(str(tmp_path / "never.uid"), 2, timeout=0.1)


@pytest.mark.skipif(_nccl.process_start(os.getppid()) is None, reason="needs Linux's /proc")
def test_a_file_left_by_an_earlier_run_is_not_read(tmp_path, monkeypatch):
    """A rendezvous file older than the launcher (here pytest's parent) is an earlier run's:
    the other ranks wait for rank 0's new one rather than join with a stale id."""
    launched = _nccl.process_start(os.getppid())
    assert launched <= _nccl.process_start(os.getpid()) + 1 and launched <= time.time()
    path = tmp_path / "run.uid"
    path.write_bytes(b"\x01" * 128)
    os.utime(path, (launched - 100, launched - 100))
    got = []
    reader = threading.Thread(target=lambda: got.append(_nccl.share_unique_id(str(path), 1, timeout=5)))
    reader.start()
    time.sleep(0.3)
    assert not got   # still waiting: the old file is not this run's
    fresh = bytes(range(128))
    monkeypatch.setattr(_nccl, "unique_id", lambda: fresh)
    assert _nccl.share_unique_id(str(path), 0) == fresh
    reader.join(10)
    assert got == [fresh]
