"""What the ranks of test_ring_attention.py's launch test do, importable by the processes that
launch spawns (kept light: each process imports it afresh)."""

import os


class FakeComm:
    """Stands in for an NcclCommunicator, made in each process."""

    def __init__(self, size, uid, rank, device):
        self.size, self.uid, self.rank, self.device = size, uid, rank, device

    def close(self):
        pass


def rank_says(comm, x):
    return comm.rank, comm.size, comm.device, comm.uid, x * comm.rank


def rank_fails(comm):
    if comm.rank == 1:
        raise ValueError("rank 1 cannot go on")
    if comm.rank == 2:
        os._exit(3)
    return comm.rank
