"""The ring over NCCL: one process per GPU, through CuPy's NCCL bindings.

Transfers run on a stream of their own, ordered after the work queued so far on the calling
thread's current stream (the compute stream); `Request.wait` makes the compute stream wait for
them. Every wait for NCCL is a poll of an event with a deadline: past ``timeout`` seconds (a peer
that failed or stopped) the communicator is aborted (``ncclCommAbort``, which also ends this
rank's transfers) and `RingTimeoutError` names the rank and what it waited for; NCCL's own
asynchronous errors are read while polling. Nothing here has run on several GPUs yet.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import numpy as np

from .. import _checks
from ._comm import MAX_PAYLOAD, PeerError, RingError, RingTimeoutError

UNIQUE_ID_BYTES = 128
_POLL_FIRST, _POLL_MOST = 2e-5, 5e-4   # seconds between polls: doubling from the first to the most
_ERROR_CHECK_EVERY = 0.05              # seconds between reads of NCCL's asynchronous error


def _nccl():
    _checks.require_cupy()
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        raise RuntimeError("CuPy was built without NCCL: install the nccl wheel of its CUDA version "
                           "(pip install 'nvidia-nccl-cu12' with a CUDA 12 CuPy)")
    return nccl


def unique_id() -> bytes:
    """A new NCCL unique id (128 bytes): made by one rank, handed to all (`NcclCommunicator`)."""
    return bytes(x % 256 for x in _nccl().get_unique_id())


def _id_tuple(uid) -> tuple:
    data = bytes(uid) if not isinstance(uid, tuple) else bytes(x % 256 for x in uid)
    if len(data) != UNIQUE_ID_BYTES:
        raise ValueError(f"uid must be NCCL's unique id of {UNIQUE_ID_BYTES} bytes, got {len(data)}")
    return tuple(b - 256 if b > 127 else b for b in data)   # CuPy's: signed chars


class NcclCommunicator:
    """Rank ``rank`` of ``size`` ranks over NCCL, on GPU ``device`` (default: the current one).

    ``uid``: `unique_id()` of one rank, the same for all (`from_env` passes it through a file).
    ``timeout``: seconds any wait on the other ranks may take, setup included; past it, the
    communicator is aborted and `RingTimeoutError` raised, so a rank that fails makes the
    others fail too rather than hang.
    """

    def __init__(self, size: int, uid, rank: int, *, device: int | None = None, timeout: float = 300.0):
        nccl = _nccl()
        import cupy

        _checks.require_gpu()
        for name, x in (("size", size), ("rank", rank)):
            if isinstance(x, bool) or not isinstance(x, int):
                raise TypeError(f"{name} must be an int, got {x!r}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be from 0 to size - 1 = {size - 1}, got {rank}")
        self.rank, self.size, self.xp, self.timeout = rank, size, cupy, float(timeout)
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        self._aborted: str | None = None
        self._nccl = nccl
        with cupy.cuda.Device(self.device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._comm = self._setup(nccl, cupy, _id_tuple(uid))

    def _setup(self, nccl, cupy, uid):
        """``ncclCommInitRank``, which waits for every rank, in a thread bounded by the timeout."""
        made: list = []

        def init():
            try:
                with cupy.cuda.Device(self.device):
                    made.append(nccl.NcclCommunicator(self.size, uid, self.rank))
            except BaseException as err:   # noqa: BLE001 - raised by the caller's thread
                made.append(err)

        thread = threading.Thread(target=init, name=f"cuflash-nccl-setup-{self.rank}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if not made:
            self._aborted = "setup did not complete"
            raise RingTimeoutError(f"rank {self.rank}: NCCL setup of {self.size} ranks did not complete within "
                                   f"{self.timeout:g} s: a rank did not join, or joined with another unique id")
        if isinstance(made[0], BaseException):
            raise RingError(f"rank {self.rank}: NCCL setup failed: {made[0]}") from made[0]
        return made[0]

    @classmethod
    def from_env(cls, *, rendezvous: str | None = None, timeout: float = 300.0) -> NcclCommunicator:
        """The communicator of a process started by torchrun or the like: ``RANK``, ``WORLD_SIZE``
        and ``LOCAL_RANK`` (the GPU, made the process's current one) from the environment; rank 0
        makes the unique id and hands it over through the file ``rendezvous`` (default: in the
        temporary directory, named after ``TORCHELASTIC_RUN_ID`` or ``MASTER_PORT`` and torchrun's
        restart count), which it removes once every rank joined."""
        try:
            rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except KeyError as err:
            raise RuntimeError(f"NcclCommunicator.from_env needs RANK and WORLD_SIZE in the environment "
                               f"(as torchrun sets them); {err.args[0]} is missing") from None
        device = int(os.environ.get("LOCAL_RANK", rank))
        if rendezvous is None:
            run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or "default"
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            rendezvous = os.path.join(tempfile.gettempdir(), f"cuflash-nccl-{run}-{restart}.uid")
        uid = share_unique_id(rendezvous, rank, timeout)
        comm = cls(size, uid, rank, device=device, timeout=timeout)
        comm.xp.cuda.Device(device).use()
        if rank == 0:
            try:
                os.remove(rendezvous)
            except OSError:
                pass
        return comm

    # -- the Communicator protocol --------------------------------------------------------------

    def _live(self):
        if self._aborted is not None:
            raise RingError(f"rank {self.rank}: the communicator was aborted ({self._aborted}); make a new one")

    def _wait_event(self, event, what: str) -> None:
        """Polls ``event`` until it is done; past the deadline, or on an NCCL error, aborts."""
        start = time.monotonic()
        delay, checked = _POLL_FIRST, start
        while not event.done:
            now = time.monotonic()
            if now - start > self.timeout:
                self.abort(f"{what} timed out")
                raise RingTimeoutError(f"rank {self.rank}: {what} did not complete within {self.timeout:g} s: a "
                                       "peer failed or stopped; the communicator is aborted")
            if now - checked > _ERROR_CHECK_EVERY:
                checked = now
                try:
                    self._comm.check_async_error()
                except Exception as err:   # noqa: BLE001 - NCCL's error, said with the rank
                    self.abort(f"NCCL error: {err}")
                    raise PeerError(f"rank {self.rank}: NCCL reported an error during {what}: {err}") from err
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MOST)

    def sendrecv(self, send, dest, recv, source):
        self._live()
        cupy, nccl = self.xp, self._nccl
        for name, arrays in (("send", send), ("recv", recv)):
            for i, x in enumerate(arrays):
                if not x.flags.c_contiguous or x.device.id != self.device:
                    raise ValueError(f"{name}[{i}] must be a C-contiguous array on device {self.device}")
        with cupy.cuda.Device(self.device):
            ready = cupy.cuda.Event(disable_timing=True)
            ready.record(cupy.cuda.get_current_stream())
            self.stream.wait_event(ready)   # the data to send is written, the buffers are free
            nccl.groupStart()   # paired sends and receives in one group: no deadlock between neighbours
            try:
                for x in send:
                    if x.nbytes:
                        self._comm.send(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, dest, self.stream.ptr)
                for x in recv:
                    if x.nbytes:
                        self._comm.recv(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, source, self.stream.ptr)
            finally:
                nccl.groupEnd()
            done = cupy.cuda.Event(disable_timing=True)
            done.record(self.stream)
        return _NcclRequest(self, done, (list(send), list(recv)), f"the transfer to rank {dest} and from rank {source}")

    def allgather_bytes(self, payload: bytes) -> list[bytes]:
        self._live()
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"allgather_bytes takes at most {MAX_PAYLOAD} bytes, got {len(payload)}")
        cupy, nccl = self.xp, self._nccl
        width = MAX_PAYLOAD + 8
        host = np.zeros(width, dtype=np.uint8)
        host[:8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
        host[8:8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        with cupy.cuda.Device(self.device), self.stream:
            mine = cupy.asarray(host)
            every = cupy.empty((self.size, width), dtype=cupy.uint8)
            self._comm.allGather(mine.data.ptr, every.data.ptr, width, nccl.NCCL_UINT8, self.stream.ptr)
            done = cupy.cuda.Event(disable_timing=True)
            done.record(self.stream)
        self._wait_event(done, "the allgather of every rank's arguments")
        with cupy.cuda.Device(self.device):
            rows = every.get(stream=self.stream)
        return [bytes(row[8:8 + int.from_bytes(row[:8].tobytes(), "little")]) for row in rows]

    def barrier(self) -> None:
        self.allgather_bytes(b"")

    def abort(self, reason: str) -> None:
        if self._aborted is not None:
            return
        self._aborted = reason
        try:
            self._comm.abort()
        except Exception:   # noqa: BLE001 - aborting what may already be broken
            pass

    def close(self) -> None:
        """Frees the communicator (every rank should call it, after its last transfer)."""
        if self._aborted is None:
            self._aborted = "closed"
            self._comm.destroy()


class _NcclRequest:
    def __init__(self, comm: NcclCommunicator, done, keep, what: str):
        self.comm, self.done, self.keep, self.what = comm, done, keep, what

    def wait(self) -> None:
        if self.keep is None:
            return
        self.comm._wait_event(self.done, self.what)
        with self.comm.xp.cuda.Device(self.comm.device):
            self.comm.xp.cuda.get_current_stream().wait_event(self.done)
        # the arrays may be freed now: later work on the compute stream comes after the transfer
        self.keep = None


def process_start(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (from Linux's /proc, to about a
    second); None where that is not known."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()   # (after the command's name, which may hold spaces)
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22, starttime, in clock ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def share_unique_id(path: str, rank: int, timeout: float = 300.0) -> bytes:
    """Rank 0 makes a unique id and writes it to ``path`` (atomically); the others wait for the
    file (at most ``timeout`` seconds) and read it. A file older than the process that started
    this one (the launcher, which started every rank) is one an earlier run left behind: it is
    not read, but waited past. Elsewhere than Linux such a file would be read: name it after the
    run."""
    if rank == 0:
        uid = unique_id()
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(uid)
        os.replace(tmp, path)
        return uid
    deadline = time.monotonic() + timeout
    launched = process_start(os.getppid())
    while True:
        try:
            with open(path, "rb") as f:
                fresh = launched is None or os.fstat(f.fileno()).st_mtime >= launched - 1   # (btime's second)
                data = f.read()
            if fresh and len(data) == UNIQUE_ID_BYTES:
                return data
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise RingTimeoutError(f"rank {rank}: rank 0's NCCL unique id did not appear in {path} "
                                   f"within {timeout:g} s")
        time.sleep(0.05)
