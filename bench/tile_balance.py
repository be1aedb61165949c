"""How evenly a persistent forward's blocks share a causal launch's work, on the host alone.

Lists the tiles of the benchmark grid's causal shapes (batch = 16384 / N, heads = 2048 / D,
128-row tiles over 128-key blocks) in the kernels' grid order (kernels/attention/params.cuh:
grid_position, groups of cuflash._params.grid_group's size, heaviest first within each),
then shares them among the GPU's blocks two ways: a fixed stride (block b runs tiles b,
b + blocks, ...) and drawn one at a time by whichever block is free first
(kernels/attention/tile_queue.cuh). Prints each way's balance: the mean block's work over
the largest one's, the fraction of the launch's time the blocks are busy.

    python bench/tile_balance.py [--blocks 132] [--tile-cost 2]
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cuflash._params import GRID_GROUP_BYTES  # noqa: E402

BLOCK = 128


def tile_steps(entries: int, m_blocks: int, group: int) -> list[int]:
    """Each tile's key blocks under a causal mask, in the grid order."""
    steps = []
    for first in range(0, entries, group):
        size = min(group, entries - first)
        for r in range(size * m_blocks):
            steps.append(m_blocks - r // size)   # rank 0: the last query block, all key blocks
    return steps


def balance(steps: list[int], blocks: int, tile_cost: float, drawn: bool) -> float:
    work = [s + tile_cost for s in steps]
    if drawn:
        free = [(0.0, b) for b in range(blocks)]
        for w in work:
            t, b = heapq.heappop(free)
            heapq.heappush(free, (t + w, b))
        longest = max(t for t, _ in free)
    else:
        longest = max(sum(work[b::blocks]) for b in range(blocks))
    return sum(work) / (blocks * longest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=132, help="blocks at once (an H200's SMs)")
    ap.add_argument("--tile-cost", type=float, default=2.0, help="a tile's fixed cost, in key blocks")
    args = ap.parse_args()
    print("| D | N | tiles | stride | drawn |\n|---|---|---|---|---|")
    for d in (64, 128, 256):
        for n in (1024, 2048, 4096, 8192, 16384):
            entries, m_blocks = (16384 // n) * (2048 // d), -(-n // BLOCK)
            group = max(1, min(entries, GRID_GROUP_BYTES // (n * 2 * d * 2)))
            steps = tile_steps(entries, m_blocks, group)
            print(f"| {d} | {n} | {len(steps)} | {balance(steps, args.blocks, args.tile_cost, False):.3f} | "
                  f"{balance(steps, args.blocks, args.tile_cost, True):.3f} |")


if __name__ == "__main__":
    main()
