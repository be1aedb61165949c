#!/usr/bin/env python3
"""Ring attention (cuflash.distributed over NCCL): weak and strong scaling on 2, 4 and 8 GPUs.

    python bench/ring_attention.py --out DIR                  # spawns one process per GPU, per count
    python bench/ring_attention.py --out DIR --quick          # short sequences: a smoke test
    python bench/ring_attention.py --list [--quick ...]       # the cases, on any machine
    torchrun --nproc-per-node 8 bench/ring_attention.py --out DIR   # the count torchrun starts

Problem: B 1, Hq 32, Hkv 8 (GQA: q (1, 8, 4, N, 128) against k, v (1, 8, 1, N, 128)), D 128,
float16 and bfloat16; "causal" (zigzag shards) and "full" (no mask, contiguous shards).
Weak scaling: 128K tokens per GPU (N = 128K x P: 256K, 512K, 1M); strong scaling: N 128K and
1M whatever P. A case runs on every rank of its GPU count; its "single" row is cuflash.attention
on one GPU over the tokens one GPU has in weak scaling (128K), or over the whole N in strong
scaling (the speed-up's baseline; skipped where it does not fit).

Per case and direction (the backward timed alone, given out and lse): the ring's time (the
slowest rank's median over --repeat calls, CUDA events on its compute stream), the same ring
with its transfers replaced by a copy on the GPU ("no sends": compute and merges only) and the
transfers alone ("sends only": the ring's sends and receives, nothing computed). FLOPs: forward
4*B*Hq*N*N*D (halved causal), backward 2.5x; "TFLOP/s per GPU" divides by P. "hidden", the
share of the transfers' time hidden under computation: 1 - (ring - no sends) / sends only,
clipped to [0, 1]. With torch installed (and --torch), torch's context parallelism
(torch.distributed.tensor.experimental.context_parallel around SDPA, k and v expanded to
every query head) on the same ranks, where it runs; any failure is recorded in "skipped".

Writes results.json (rewritten after each GPU count) and, with matplotlib, scaling.png; prints
a Markdown table. Progress goes to stderr. Not yet run on several GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402
import bench_attention  # noqa: E402
from bench_attention import log, pyplot  # noqa: E402

B, HQ, HKV, D = 1, 32, 8, 128
K = 1024
GPUS = (2, 4, 8)
WEAK_PER_GPU = 128 * K
STRONG_N = (128 * K, 1024 * K)
QUICK = {"weak_per_gpu": 16 * K, "strong_n": (32 * K,)}
MASKS = {"causal": ("zigzag", True), "full": ("contiguous", False)}
DTYPES = ("bfloat16", "float16")


def flops(n, causal, direction):
    f = 4 * B * HQ * n * n * D / (2 if causal else 1)
    return f * (2.5 if direction == "bwd" else 1)


def cases(args):
    """(kind, P, N, dtype, mask) of every ring case, then the single-GPU baselines (P 1)."""
    weak = QUICK["weak_per_gpu"] if args.quick else WEAK_PER_GPU
    strong = QUICK["strong_n"] if args.quick else STRONG_N
    todo = []
    for dtype in args.dtypes:
        for mask in args.masks:
            for p in args.gpus:
                todo.append(("weak", p, weak * p, dtype, mask))
                todo += [("strong", p, n, dtype, mask) for n in strong]
            todo += [("single", 1, n, dtype, mask) for n in sorted({weak, *strong})]
    return todo


def print_plan(args):
    todo = cases(args)
    torch_cp = "torch-cp" if args.torch else None
    print(f"ring attention: B {B}, Hq {HQ}, Hkv {HKV}, D {D}; {', '.join(args.dtypes)}; "
          f"{', '.join(f'{m} ({MASKS[m][0]})' for m in args.masks)}; {', '.join(args.directions)}")
    for kind, p, n, dtype, mask in todo:
        what = "cuflash.attention on one GPU" if kind == "single" else \
            ", ".join(x for x in ("ring", "no sends", "sends only", torch_cp) if x)
        print(f"  {kind} P {p} N {n} {dtype} {mask}: {what}")
    rows = len(todo) * len(args.directions)
    counts = sorted({p for _, p, *_ in todo if p > 1})
    print(f"{len(todo)} cases, {rows} rows; one process per GPU for {', '.join(map(str, counts))} GPUs")


# ---------------------------------------------------------------------------------------------
# On each rank
# ---------------------------------------------------------------------------------------------


class NoSends:
    """The rank's communicator with its transfers replaced by a copy of what would be sent into
    what would be received (equal shards: the same shapes), so the ring computes on real data."""

    def __init__(self, comm):
        self.comm, self.rank, self.size, self.xp = comm, comm.rank, comm.size, comm.xp
        self.device = comm.device

    def sendrecv(self, send, dest, recv, source):
        for dst, src in zip(recv, send):
            if dst.shape == src.shape:
                dst[...] = src
        return self

    def wait(self):
        pass

    def allgather_bytes(self, payload):
        return self.comm.allgather_bytes(payload)

    def abort(self, reason):
        self.comm.abort(reason)


def slowest_median_ms(comm, fn, repeat):
    """The median over ``repeat`` calls of ``fn`` on this rank (CUDA events on its compute
    stream, the ranks aligned by a barrier before each), the slowest rank's."""
    mine = bench_attention.median_ms(fn, [()], repeat, warmup=1, before=comm.barrier)
    return max(float(x) for x in comm.allgather_bytes(repr(mine).encode()))


def sends_only(comm, k, v, direction):
    """The ring's transfers without its computation: P - 1 K/V shards (and for the backward P
    pairs of float32 dK/dV sums), each waited for as the ring waits."""
    import cupy

    size, rank = comm.size, comm.rank
    kv = [cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)]
    sums = [cupy.zeros(k.shape, cupy.float32), cupy.zeros(v.shape, cupy.float32)]
    for t in range(size):
        pending = []
        if t + 1 < size:
            incoming = [cupy.empty_like(x) for x in kv]
            pending.append(comm.sendrecv(kv, (rank + 1) % size, incoming, (rank - 1) % size))
        if direction == "bwd":
            pending.append(comm.sendrecv(sums, (rank + 1) % size, [cupy.empty_like(x) for x in sums],
                                         (rank - 1) % size))
        for p in pending:
            p.wait()
        if t + 1 < size:
            kv = incoming


def shard_inputs(comm, n, dtype):
    """This rank's shard of q (1, 8, 4, n / P, 128), k, v (1, 8, 1, n / P, 128) and dout, drawn
    on its GPU (times do not depend on the values: each rank draws its own)."""
    import cupy

    rng = cupy.random.default_rng(comm.rank)
    rows = n // comm.size
    return [rng.standard_normal((B, *heads, rows, D), dtype=cupy.float32).astype(dtype)
            for heads in ((HKV, HQ // HKV), (HKV, 1), (HKV, 1), (HKV, HQ // HKV))]


def time_torch_cp(comm, n, dtype, causal, direction, repeat):
    """torch's context parallelism on these ranks (their own process group over NCCL): SDPA on
    q (1, 32, n, 128) and k, v expanded to 32 heads. Raises where torch cannot run it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if not dist.is_initialized():   # a store named by rank 0, fresh for this run
        token = comm.allgather_bytes(os.urandom(8).hex().encode())[0].decode()
        store = os.path.join(tempfile.gettempdir(), f"cuflash-ring-bench-torch-{token}")
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=comm.rank, world_size=comm.size)
    torch.cuda.set_device(comm.device)
    mesh = init_device_mesh("cuda", (comm.size,))
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda: torch.randn(B, HQ, n, D, device="cuda", dtype=getattr(torch, dtype), generator=gen)  # noqa: E731
    q, k, v, do = make(), make(), make(), make()
    if direction == "bwd":
        for x in (q, k, v):
            x.requires_grad_()
    times = []
    with context_parallel(mesh, buffers=(q, k, v, do), buffer_seq_dims=(2, 2, 2, 2)):
        for i in range(repeat + 1):
            dist.barrier()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if direction == "fwd":
                start.record()
                sdpa(q, k, v, is_causal=causal)
                stop.record()
            else:
                out = sdpa(q, k, v, is_causal=causal)
                start.record()
                torch.autograd.grad(out, (q, k, v), do)
                stop.record()
            stop.synchronize()
            if i:
                times.append(start.elapsed_time(stop))
    return max(float(x) for x in comm.allgather_bytes(repr(float(np.median(times))).encode()))


def run_ring_case(comm, n, dtype, mask, directions, repeat, torch_cp):
    """One ring case on this rank: rows of rank 0's view (every rank computes them alike)."""
    import cupy

    from cuflash import distributed

    layout, causal = MASKS[mask]
    q, k, v, dout = shard_inputs(comm, n, dtype)
    kw = {"causal": causal, "layout": layout}
    rows = []
    for direction in directions:
        row = {"P": comm.size, "N": n, "dtype": dtype, "mask": mask, "layout": layout, "direction": direction,
               "flops": flops(n, causal, direction), "ms": {}, "skipped": {}}
        if direction == "fwd":
            def run(c):
                return lambda: distributed.ring_attention(q, k, v, c, **kw)
        else:
            out, lse = distributed.ring_attention(q, k, v, comm, return_lse=True, **kw)

            def run(c):
                return lambda: distributed.ring_attention_backward(dout, q, k, v, out, lse, c, **kw)
        for name, fn in (("ring", run(comm)), ("no sends", run(NoSends(comm))),
                         ("sends only", lambda: sends_only(comm, k, v, direction))):
            try:
                row["ms"][name] = slowest_median_ms(comm, fn, repeat)
            except cupy.cuda.memory.OutOfMemoryError as err:
                row["skipped"][name] = f"OutOfMemoryError: {str(err)[:120]}"
            cupy.get_default_memory_pool().free_all_blocks()
        if torch_cp:
            try:
                row["ms"]["torch-cp"] = time_torch_cp(comm, n, dtype, causal, direction, repeat)
            except Exception as err:   # noqa: BLE001 - torch's CP where it runs; why not, where not
                row["skipped"]["torch-cp"] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
        rows.append(row)
        if comm.rank == 0:
            log(f"P {comm.size} N {n} {dtype} {mask} {direction}: " +
                ", ".join(f"{k_} {v_:.1f} ms" for k_, v_ in row["ms"].items()))
    return rows


def rank_main(comm, todo, directions, repeat, torch_cp):
    """Every case of this GPU count, on this rank; rank 0 returns the rows."""
    rows = []
    for kind, _, n, dtype, mask in todo:
        for row in run_ring_case(comm, n, dtype, mask, directions, repeat, torch_cp):
            rows.append(dict(row, kind=kind))
    return rows if comm.rank == 0 else None


def run_single(n, dtype, mask, directions, repeat):
    """cuflash.attention on this process's GPU over the whole n: the baseline rows."""
    import cupy

    rows = []
    causal = MASKS[mask][1]
    for direction in directions:
        row = {"kind": "single", "P": 1, "N": n, "dtype": dtype, "mask": mask, "layout": None, "direction": direction,
               "flops": flops(n, causal, direction), "ms": {}, "skipped": {}}
        try:
            rng = cupy.random.default_rng(0)
            q = rng.standard_normal((B, HKV, HQ // HKV, n, D), dtype=cupy.float32).astype(dtype)
            k, v = (rng.standard_normal((B, HKV, 1, n, D), dtype=cupy.float32).astype(dtype) for _ in range(2))
            do = rng.standard_normal(q.shape, dtype=cupy.float32).astype(dtype)
            ms = bench_attention.time_attention(cuflash, [(q, k, v, do)], causal, direction, repeat)
            row["ms"]["single"] = ms
        except cupy.cuda.memory.OutOfMemoryError as err:
            row["skipped"]["single"] = f"OutOfMemoryError: {str(err)[:120]}"
        finally:
            bench_attention.free()
        rows.append(row)
        log(f"single N {n} {dtype} {mask} {direction}: {row['ms'] or row['skipped']}")
    return rows


# ---------------------------------------------------------------------------------------------
# Tables and charts
# ---------------------------------------------------------------------------------------------


def derived(row, singles):
    """TFLOP/s per GPU of each provider, the share of transfers hidden, and the speed-up against
    the row's single-GPU baseline where there is one."""
    ms, p = row["ms"], row["P"]
    tflops = {name: row["flops"] / t / 1e9 / p for name, t in ms.items() if name not in ("no sends", "sends only")}
    hidden = None
    if {"ring", "no sends", "sends only"} <= set(ms) and ms["sends only"] > 0:
        hidden = min(1.0, max(0.0, 1 - (ms["ring"] - ms["no sends"]) / ms["sends only"]))
    base = singles.get((row["N"] if row["kind"] == "strong" else row["N"] // p, row["dtype"], row["mask"],
                        row["direction"]))
    speedup = None
    if base is not None and "ring" in ms:
        speedup = base / ms["ring"] if row["kind"] == "strong" else (row["flops"] / p / ms["ring"]) / (
            flops(row["N"] // p, MASKS[row["mask"]][1], row["direction"]) / base)
    return tflops, hidden, speedup


def single_times(rows):
    return {(r["N"], r["dtype"], r["mask"], r["direction"]): r["ms"]["single"]
            for r in rows if r["kind"] == "single" and "single" in r["ms"]}


def print_table(rows):
    singles = single_times(rows)
    head = ["kind", "P", "N", "dtype", "mask", "dir", "ring ms", "TFLOP/s per GPU", "no sends ms", "sends only ms",
            "hidden", "speed-up / efficiency", "torch-cp TFLOP/s per GPU"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        if r["kind"] == "single":
            continue
        tflops, hidden, speedup = derived(r, singles)
        ms = r["ms"]
        cells = [r["kind"], str(r["P"]), str(r["N"]), r["dtype"], r["mask"], r["direction"],
                 f"{ms['ring']:.1f}" if "ring" in ms else "", f"{tflops['ring']:.0f}" if "ring" in tflops else "",
                 f"{ms['no sends']:.1f}" if "no sends" in ms else "", f"{ms['sends only']:.1f}" if "sends only" in ms
                 else "", f"{hidden:.2f}" if hidden is not None else "", f"{speedup:.2f}" if speedup else "",
                 f"{tflops['torch-cp']:.0f}" if "torch-cp" in tflops else ""]
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        for name, why in r.get("skipped", {}).items():
            print(f"skipped: {r['kind']} P {r['P']} N {r['N']} {r['dtype']} {r['mask']} {r['direction']} {name}: {why}")
    print("speed-up (strong): single-GPU time / ring time; efficiency (weak): ring TFLOP/s per GPU / single-GPU "
          "TFLOP/s on the tokens of one GPU")


def draw_chart(rows, out_dir):
    plt = pyplot("matplotlib not available: no chart")
    if plt is None:
        return
    singles = single_times(rows)
    series = {}
    for r in rows:
        if r["kind"] == "single" or "ring" not in r["ms"]:
            continue
        key = (r["kind"], r["N"] if r["kind"] == "strong" else "per GPU", r["dtype"], r["mask"], r["direction"])
        series.setdefault(key, []).append((r["P"], derived(r, singles)[0]["ring"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, kind in zip(axes, ("weak", "strong")):
        for key, points in sorted(series.items()):
            if key[0] == kind:
                points.sort()
                ax.plot([p for p, _ in points], [t for _, t in points], marker="o", label=" ".join(map(str, key[1:])))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_title(f"{kind} scaling")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "scaling.png"), dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for results.json and the chart")
    ap.add_argument("--list", action="store_true", help="print the cases, run nothing")
    ap.add_argument("--quick", action="store_true", help="16K tokens per GPU (weak), N 32K (strong)")
    ap.add_argument("--gpus", nargs="+", type=int, default=list(GPUS), help="GPU counts (default: 2 4 8)")
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    ap.add_argument("--masks", nargs="+", choices=list(MASKS), default=list(MASKS))
    ap.add_argument("--directions", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--torch", action=argparse.BooleanOptionalAction, default=bench_attention.torch is not None,
                    help="also time torch's context parallelism (default: where torch is installed)")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if under_torchrun:
        args.gpus = [int(os.environ["WORLD_SIZE"])]
    if args.list:
        print_plan(args)
        return
    if not args.out:
        sys.exit("ring_attention.py: --out is required (except with --list)")
    try:
        cuflash.require_gpu()
    except RuntimeError as err:
        sys.exit(f"ring_attention.py: {err}")
    from cuflash import distributed

    todo = cases(args)
    meta = {"B": B, "Hq": HQ, "Hkv": HKV, "D": D, "quick": args.quick, "torch_cp": args.torch}
    rows: list = []

    def save():
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    if under_torchrun:
        comm = distributed.NcclCommunicator.from_env()
        got = rank_main(comm, [c for c in todo if c[0] != "single"], args.directions, args.repeat, args.torch)
        if comm.rank != 0:
            return
        os.makedirs(args.out, exist_ok=True)
        meta.update(bench_attention.run_meta(args.repeat), gpus=comm.size)
        rows.extend(got)
    else:
        import cupy

        os.makedirs(args.out, exist_ok=True)
        meta.update(bench_attention.run_meta(args.repeat), gpus_here=cupy.cuda.runtime.getDeviceCount())
        for kind, _, n, dtype, mask in [c for c in todo if c[0] == "single"]:
            rows.extend(run_single(n, dtype, mask, args.directions, args.repeat))
            save()
        for p in sorted({c[1] for c in todo if c[0] != "single"}):
            if p > meta["gpus_here"]:
                log(f"{p} GPUs: only {meta['gpus_here']} here, skipped")
                continue
            mine = [c for c in todo if c[1] == p and c[0] != "single"]
            rows.extend(distributed.launch(rank_main, p, mine, args.directions, args.repeat, args.torch)[0])
            save()
    save()
    draw_chart(rows, args.out)
    print(f"{meta['device']}, {meta['date']}, CuPy {meta['cupy']}, torch {meta['torch']}")
    print_table(rows)


if __name__ == "__main__":
    main()
