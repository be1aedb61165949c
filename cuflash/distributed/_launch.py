"""One process per GPU, started here: `launch` spawns them, hands each an `NcclCommunicator`
and collects what they return. (Under torchrun, use `NcclCommunicator.from_env` instead.)"""

from __future__ import annotations

import functools
import multiprocessing
import queue as queues
import time
import traceback

from ._nccl import NcclCommunicator, unique_id
from ._plan import check_int

_LAST_WORDS = 5.0   # seconds a process that exited with 0 has for its result to arrive


class LaunchError(RuntimeError):
    """A rank of `launch` failed; the message holds each failed rank's traceback, ``results``
    what the other ranks returned (by rank)."""

    def __init__(self, message: str, results: dict):
        super().__init__(message)
        self.results = results


def _nccl(size, uid, rank, device, timeout):
    """Rank ``rank``'s communicator, its GPU made this process's current one."""
    import cupy

    comm = NcclCommunicator(size, uid, rank, device=device, timeout=timeout)
    cupy.cuda.Device(comm.device).use()
    return comm


def _rank_main(fn, rank, size, uid, device, args, results, make_comm):
    comm = None
    try:
        comm = make_comm(size, uid, rank, device)
        results.put((rank, True, fn(comm, *args)))
    except BaseException:   # noqa: BLE001 - sent to the parent as text
        results.put((rank, False, traceback.format_exc()))
    finally:
        if comm is not None:
            comm.close()


def launch(fn, size: int, *args, devices=None, timeout: float = 3600.0, comm_timeout: float = 300.0) -> list:
    """Runs ``fn(comm, *args)`` in ``size`` new processes (multiprocessing's "spawn"), rank r on
    GPU ``devices[r]`` (default r, made the process's current GPU), and returns their results in
    rank order.

    ``fn`` must be importable by name (a module's top-level function) and its results and
    ``args`` picklable: host data, not CuPy arrays. ``comm_timeout`` is each communicator's
    (`NcclCommunicator`); ``timeout`` bounds the whole run, after which the processes left are
    killed. A rank that fails makes the call raise `LaunchError` with its traceback (the others
    then fail on their communicators' timeouts, or finish).
    """
    devices = _devices(size, devices)   # before the unique id, which needs a GPU
    return _spawn(fn, size, args, devices, timeout, functools.partial(_nccl, timeout=comm_timeout), unique_id())


def _devices(size, devices) -> list:
    check_int("size", size, 1)
    devices = list(range(size)) if devices is None else list(devices)
    if len(devices) != size:
        raise ValueError(f"devices must name {size} GPUs, got {devices}")
    return devices


def _spawn(fn, size, args, devices, timeout, make_comm, uid):
    """`launch` with the communicators made by ``make_comm(size, uid, rank, device)`` (picklable)."""
    devices = _devices(size, devices)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_rank_main, args=(fn, r, size, uid, devices[r], args, results, make_comm),
                             name=f"cuflash-rank-{r}") for r in range(size)]
    for p in procs:
        p.start()
    got: dict = {}
    exited: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < size:
            try:
                rank, ok, value = results.get(timeout=1.0)
                got[rank] = (ok, value)
            except queues.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):   # gone without a word (killed, crashed, os._exit)
                    if r not in got and p.exitcode is not None:
                        exited.setdefault(r, now)
                        if p.exitcode != 0 or now - exited[r] > _LAST_WORDS:
                            got[r] = (False, f"the process exited with code {p.exitcode}")
                if now > deadline:
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) if len(got) == size else 5.0)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    missing = [r for r in range(size) if r not in got]
    if failed or missing:
        text = "".join(f"\n--- rank {r} ---\n{v}" for r, v in sorted(failed.items()))
        if missing:
            text += f"\n--- ranks {missing}: no answer within {timeout:g} s (killed)"
        raise LaunchError(f"{len(failed) + len(missing)} of {size} ranks failed:{text}",
                          {r: v for r, (ok, v) in got.items() if ok})
    return [got[r][1] for r in range(size)]
