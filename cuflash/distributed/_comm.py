"""What the ring asks of a communicator, and the errors of communication."""

from __future__ import annotations

from types import ModuleType
from typing import Protocol, Sequence, runtime_checkable


class RingError(RuntimeError):
    """Communication between the ranks failed, or a communicator was used after it failed."""


class PeerError(RingError):
    """Another rank failed (the stand-in), or NCCL reported an error; this rank stopped."""


class RingTimeoutError(RingError, TimeoutError):
    """A transfer or a setup ran past the communicator's timeout: a peer failed or stopped."""


class Request(Protocol):
    """A transfer started by `Communicator.sendrecv`."""

    def wait(self) -> None:
        """Returns once the received arrays may be read by work queued after this call (on
        the calling thread's current stream); raises `RingError` if the transfer failed or
        ran past the communicator's timeout."""


@runtime_checkable
class Communicator(Protocol):
    """One rank's view of a group of ``size`` ranks, as the ring uses it.

    ``xp`` is the array module of the arrays it moves (numpy or cupy): the ring computes
    with ``cuflash.reference`` on NumPy arrays and with cuflash's GPU functions on CuPy ones.
    """

    rank: int
    size: int
    xp: ModuleType

    def sendrecv(self, send: Sequence, dest: int, recv: Sequence, source: int) -> Request:
        """Starts sending each array of ``send`` to rank ``dest`` and receiving, in order, as
        many arrays into the preallocated, contiguous ``recv`` from rank ``source``, which
        sends them with its own ``sendrecv`` (shapes and dtypes agreed beforehand). Returns at
        once; the arrays of ``send`` must not change and those of ``recv`` must not be read
        before `Request.wait`."""

    def allgather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload`` (at most 8192 bytes), in rank order; blocks (within the
        timeout) until all ranks have called it."""

    def barrier(self) -> None:
        """Returns once every rank has called it."""

    def abort(self, reason: str) -> None:
        """Stops this rank's communication for good after a failure (``reason`` says which),
        so that peers waiting on it get an error rather than wait for ever."""


MAX_PAYLOAD = 8192
