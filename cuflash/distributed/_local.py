"""A single-process stand-in for a group of ranks: each rank a thread, messages in memory.

With NumPy arrays the ring then runs ``cuflash.reference`` on the CPU; with CuPy arrays, the
GPU kernels on one device. Sends are buffered (a copy is queued at once), so a rank never waits
on a send; a receive waits for its message, or for a peer's failure, or for the timeout.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from ._comm import MAX_PAYLOAD, PeerError, RingError, RingTimeoutError


class LocalWorld:
    """``size`` ranks in one process; ``comms[r]`` is rank r's communicator.

    ``xp``: the array module the ranks compute with (numpy, or cupy for one GPU shared by
    every rank; messages are copied on each thread's current stream, so the ranks should keep
    CuPy's default one). ``timeout``: seconds a rank waits for a message or a collective before
    `RingTimeoutError` (a deadlock in the caller's program, not a slow peer).
    """

    def __init__(self, size: int, *, xp=np, timeout: float = 60.0):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.size, self.xp, self.timeout = size, xp, float(timeout)
        self._cond = threading.Condition()
        self._mail = collections.defaultdict(collections.deque)   # (source, dest) -> messages
        self._gathers: dict[int, tuple[dict[int, bytes], list[int]]] = {}   # step -> (parts, [readers])
        self._failed: tuple[int, str] | None = None
        self.comms = [LocalCommunicator(self, r) for r in range(size)]

    def fail(self, rank: int, reason: str) -> None:
        """Marks the world failed by ``rank``: every rank waiting, or waiting later, raises
        `PeerError` (the first failure is the one reported)."""
        with self._cond:
            if self._failed is None:
                self._failed = (rank, reason)
            self._cond.notify_all()

    def _check(self, rank: int, what: str) -> None:
        """Raises (holding the lock) if the world failed: `PeerError` for another rank's failure."""
        if self._failed is not None and self._failed[0] != rank:
            raise PeerError(f"rank {rank}: rank {self._failed[0]} failed while this rank waited for {what}: "
                            f"{self._failed[1]}")
        if self._failed is not None:
            raise RingError(f"rank {rank}: this rank's communication was aborted: {self._failed[1]}")

    def _wait(self, rank: int, ready, what: str):
        """Waits (holding the lock) until ``ready()`` returns something other than None."""
        deadline = time.monotonic() + self.timeout
        while True:
            found = ready()
            if found is not None:
                return found
            self._check(rank, what)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RingTimeoutError(f"rank {rank}: {what} did not come within {self.timeout:g} s")
            self._cond.wait(left)


class LocalCommunicator:
    """Rank ``rank`` of a `LocalWorld` (the `Communicator` protocol)."""

    def __init__(self, world: LocalWorld, rank: int):
        self.world, self.rank, self.size, self.xp = world, rank, world.size, world.xp
        self._gathers = 0

    def _peer(self, name: str, r) -> int:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.size:
            raise ValueError(f"{name} must be a rank from 0 to {self.size - 1}, got {r!r}")
        return r

    def sendrecv(self, send, dest, recv, source):
        dest, source = self._peer("dest", dest), self._peer("source", source)
        message = [self.xp.array(a, copy=True) for a in send]
        world = self.world
        with world._cond:
            world._check(self.rank, f"the message to rank {dest}")
            world._mail[(self.rank, dest)].append(message)
            world._cond.notify_all()
        return _LocalRequest(self, source, list(recv))

    def allgather_bytes(self, payload: bytes) -> list[bytes]:
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"allgather_bytes takes at most {MAX_PAYLOAD} bytes, got {len(payload)}")
        world, step = self.world, self._gathers
        self._gathers += 1
        with world._cond:
            slots, readers = world._gathers.setdefault(step, ({}, [0]))
            slots[self.rank] = bytes(payload)
            world._cond.notify_all()
            found = world._wait(self.rank, lambda: [slots[r] for r in range(self.size)] if len(slots) == self.size
                                else None, f"every rank's part of collective {step}")
            readers[0] += 1
            if readers[0] == self.size:
                del world._gathers[step]
        return found

    def barrier(self) -> None:
        self.allgather_bytes(b"")

    def abort(self, reason: str) -> None:
        self.world.fail(self.rank, reason)


class _LocalRequest:
    def __init__(self, comm: LocalCommunicator, source: int, recv: list):
        self.comm, self.source, self.recv = comm, source, recv

    def wait(self) -> None:
        comm, world = self.comm, self.comm.world
        with world._cond:   # the mailbox too is made under the lock, where the sender may make it
            box = world._mail[(self.source, comm.rank)]
            message = world._wait(comm.rank, lambda: box.popleft() if box else None,
                                  f"the message from rank {self.source}")
        got = [(a.shape, a.dtype) for a in message]
        want = [(a.shape, a.dtype) for a in self.recv]
        if got != want:
            raise RingError(f"rank {comm.rank}: the message from rank {self.source} holds arrays of "
                            f"(shape, dtype) {got}, this rank expected {want}")
        for dst, src in zip(self.recv, message):
            dst[...] = src


def run_ranks(size: int, fn, *, xp=np, timeout: float = 60.0, return_exceptions: bool = False) -> list:
    """Runs ``fn(comm)`` for every rank of a `LocalWorld` of ``size`` ranks, each in a thread,
    and returns their results in rank order.

    A rank that raises marks the world failed, so the others stop at their next wait
    (`PeerError`) instead of waiting for ever. Then, without ``return_exceptions``, the error of
    the lowest rank that failed by itself (not as a `PeerError`) is raised; with it, each
    failed rank's exception takes its place in the list.
    """
    world = LocalWorld(size, xp=xp, timeout=timeout)
    results: list = [None] * size
    errors: list = [None] * size

    def main(rank):
        try:
            results[rank] = fn(world.comms[rank])
        except BaseException as err:   # noqa: BLE001 - handed to the caller below
            errors[rank] = err
            world.fail(rank, f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=main, args=(r,), name=f"cuflash-rank-{r}", daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if return_exceptions:
        return [e if e is not None else x for e, x in zip(errors, results)]
    failed = [e for e in errors if e is not None]
    if failed:
        raise next((e for e in failed if not isinstance(e, PeerError)), failed[0])
    return results
