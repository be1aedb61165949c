"""Context parallelism: attention over a sequence sharded across ranks, by ring attention.

``ring_attention(q, k, v, comm, ...)`` is called by every rank at once with its own shard of the
sequence (axis -2); K/V shards travel round the ring while each is computed, and the partial
results merge by their logsumexp. ``comm`` is an `NcclCommunicator` (one process per GPU, started
by torchrun or by `launch`) or a rank of the single-process stand-in (`run_ranks`, `LocalWorld`),
which runs the ranks as threads on the CPU reference (NumPy arrays) or on one GPU (CuPy arrays).

``import cuflash`` does not import this package; it needs neither CuPy nor a GPU until an
`NcclCommunicator` is made or CuPy arrays are given. docs/contract.md, "Ring attention", has
the rules; docs/design.md the algorithm.
"""

from ._comm import Communicator, PeerError, Request, RingError, RingTimeoutError
from ._launch import LaunchError, launch
from ._local import LocalCommunicator, LocalWorld, run_ranks
from ._nccl import NcclCommunicator, share_unique_id, unique_id
from ._plan import LAYOUTS, shard_lengths
from ._ring import (
    ring_attention, ring_attention_backward, ring_attention_vjp, shard, shard_positions, unshard,
)

__all__ = [
    "LAYOUTS", "Communicator", "LaunchError", "LocalCommunicator", "LocalWorld", "NcclCommunicator", "PeerError",
    "Request", "RingError", "RingTimeoutError", "launch", "ring_attention", "ring_attention_backward",
    "ring_attention_vjp", "run_ranks", "shard", "shard_lengths", "shard_positions", "share_unique_id", "unique_id",
    "unshard",
]
