#!/usr/bin/env python3
"""Decoding against a KV cache: cuflash.attention_kvcache against SDPA's FLASH and cuDNN backends.

    python bench/decode.py --out DIR            # the whole grid, the paged caches, the loop
    python bench/decode.py --out DIR --quick    # fp16, D 128, a few cells

Cells: fp16 and bf16, D in {64, 128}, B in {1, 8, 64}, Hq:Hkv in {32:32, 32:8, 64:8},
Nk in {4K, 32K, 128K} keys already cached, Nq in {1, 4} new query rows; cells whose K and V
pass 40 GB are skipped. Bandwidth: the bytes of K and V read once / time, in TB/s. Timing:
a model reads each layer's cache once per step, with the other layers' work in between, so
a cell whose K and V are small holds several copies of them (together past 256 MB, five
times the H200's L2) and consecutive calls read different copies, none of them in L2. The
implementations of a cell take turns, round by round (rotated starting order; 7 rounds):
each round times, per implementation, one replay of a CUDA graph of its calls (the device's
time alone, as a decoding loop captured in a graph runs: the headline), the same calls
queued back to back eagerly (about 2 ms of them, 3 to 20 calls, at least two per copy: the
host's time wherever a call launches slower than its kernels run, as at B = 1) and one
synchronized call; a cell reports the medians over the rounds. Taking turns cancels drift
between implementations measured one after the other (clocks, the cache, the memory's state). cuflash reads
q as (B, Hkv, G, Nq, D) against (B, Hkv, 1, Nk, D) caches; SDPA gets (B, Hq, Nq, D) against
(B, Hkv, Nk, D) with enable_gqa. With Nq = 4 cuflash's rows are causal (bottom-right: the
new rows see the cache and the new rows before them); SDPA's is_causal aligns to the top-left
corner, which would skip the cache, so the rivals run those cells without a mask: the same
bytes, 6 of Nk * 4 scores apart. cuflash also runs on the same keys in pages of 16, 64 and
256 rows, placed in a shuffled order, taking turns with each other (or alone, one page size
at a time, where the three do not fit beside the contiguous cache). Then a loop of 256
decoding steps, each appending one key to every sequence (device lengths, check=False),
timed end to end: eagerly, and as one CUDA graph. Writes results.json and decode.png;
prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402
import bench_attention  # noqa: E402
from bench_attention import TORCH_BACKENDS, free, log, pyplot, run_meta, torch  # noqa: E402

try:
    import cupy
    import ml_dtypes  # noqa: F401
except ImportError:
    cupy = None

MAX_CACHE_BYTES = 40 * 10**9
PAGE_SIZES = (16, 64, 256)
LOOP_STEPS = 256
GRID = {
    "dtype": ("float16", "bfloat16"), "D": (64, 128), "B": (1, 8, 64),
    "heads": ((32, 32), (32, 8), (64, 8)), "Nk": (4096, 32768, 131072), "Nq": (1, 4),
}
QUICK = {"dtype": ("float16",), "D": (128,), "B": (1, 8), "heads": ((32, 8),), "Nk": (32768,), "Nq": (1, 4)}


L2_SPAN = 256 * 10**6   # bytes of K and V that consecutive calls cycle through (5x the L2)
MAX_COPIES = 32
QUEUED_MS = 2.0         # a queued sample lasts about this long: up to 20 calls, at least 3


def one_call_ms(fn) -> float:
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop)


def queued_calls_ms(fns, calls: int) -> float:
    """Per call, `calls` calls queued back to back, cycling through the copies' calls `fns`."""
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for i in range(calls):
        fns[i % len(fns)]()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / calls


class CupyGraph:
    """`calls` calls (cycling through `fns`) captured into one CUDA graph on a CuPy stream;
    replay_ms() times one replay per call: the device's time alone, no host in between."""

    def __init__(self, fns, calls: int):
        self.calls, self.stream = calls, cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.stream.begin_capture()
            self.outputs = [fns[i % len(fns)]() for i in range(calls)]   # kept: the replays write them
            self.graph = self.stream.end_capture()

    def replay_ms(self) -> float:
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(self.stream)
        self.graph.launch(self.stream)
        stop.record(self.stream)
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop) / self.calls


class TorchGraph:
    """The same for calls that launch through PyTorch (captured by torch.cuda.graph)."""

    def __init__(self, fns, calls: int):
        self.calls, self.stream, self.graph = calls, torch.cuda.Stream(), torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):   # warm on the capturing stream first
            for fn in fns:
                fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self.outputs = [fns[i % len(fns)]() for i in range(calls)]

    def replay_ms(self) -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / self.calls


@dataclass
class Impl:
    """An implementation of a cell: its calls, one per copy of the data; a function that makes
    the context its turns run in (SDPA's backend), or None; how its calls are captured."""

    fns: list
    context: object = None
    graph: type = CupyGraph


def take_turns(impls: dict, rounds: int) -> dict:
    """{name: {"graph_ms", "queued_ms", "call_ms"}}: medians over `rounds` rounds in which every
    implementation takes its turn, the starting one rotating from round to round."""
    names = list(impls)
    calls, graphs = {}, {}
    for name, impl in impls.items():   # compiled, planned, warm and captured
        with impl.context() if impl.context else contextlib.nullcontext():
            for fn in impl.fns:
                fn()
            first = queued_calls_ms(impl.fns, len(impl.fns))
            calls[name] = max(2 * len(impl.fns), min(20, max(3, math.ceil(QUEUED_MS / max(first, 1e-3)))))
            graphs[name] = impl.graph(impl.fns, calls[name])
    samples = {n: {"graph_ms": [], "queued_ms": [], "call_ms": []} for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            impl = impls[name]
            with impl.context() if impl.context else contextlib.nullcontext():
                samples[name]["graph_ms"].append(graphs[name].replay_ms())
                samples[name]["queued_ms"].append(queued_calls_ms(impl.fns, calls[name]))
                samples[name]["call_ms"].append(one_call_ms(impl.fns[r % len(impl.fns)]))
    return {n: {kind: float(np.median(v)) for kind, v in samples[n].items()} for n in names}


def draw(shape, dtype, rng):
    return rng.standard_normal(shape, dtype=cupy.float32).astype(dtype)


def paged_copy(k, page_size, rng):
    """k (B, Hkv, 1, Nk, D) as pages (P, Hkv, 1, page_size, D) in a shuffled order, and the table."""
    b, hkv, _, nk, d = k.shape
    per_seq = nk // page_size
    order = cupy.asarray(np.random.default_rng(page_size).permutation(b * per_seq).astype(np.int32))
    pages = cupy.empty((b * per_seq, hkv, 1, page_size, d), dtype=k.dtype)
    pages[order] = k.reshape(b, hkv, 1, per_seq, page_size, d).transpose(0, 3, 1, 2, 4, 5).reshape(pages.shape)
    return pages, order.reshape(b, per_seq)


def run_cell(dtype, d, b, hq, hkv, nk, nq, repeat) -> dict | None:
    kv_bytes = 2 * b * hkv * nk * d * 2
    if kv_bytes > MAX_CACHE_BYTES:
        return None
    copies = max(1, min(MAX_COPIES, -(-L2_SPAN // kv_bytes)))
    rng = cupy.random.default_rng(nk + b)
    g = hq // hkv
    data = [(draw((b, hkv, g, nq, d), dtype, rng), draw((b, hkv, 1, nk, d), dtype, rng),
             draw((b, hkv, 1, nk, d), dtype, rng)) for _ in range(copies)]
    row = {"dtype": dtype, "D": d, "B": b, "Hq": hq, "Hkv": hkv, "Nk": nk, "Nq": nq, "bytes": kv_bytes,
           "copies": copies, "ms": {}}
    causal = nq > 1
    impls = {"cuflash": Impl([lambda q=q, k=k, v=v: cuflash.attention_kvcache(q, k, v, causal=causal, check=False)
                              for q, k, v in data])}
    views = []
    if torch is not None:
        views = [(torch.from_dlpack(q.reshape(b, hq, nq, d)), torch.from_dlpack(k.reshape(b, hkv, nk, d)),
                  torch.from_dlpack(v.reshape(b, hkv, nk, d))) for q, k, v in data]
        fns = [lambda t=t: bench_attention.sdpa(*t, enable_gqa=g > 1) for t in views]
        for name, backend in TORCH_BACKENDS.items():
            try:
                with bench_attention.sdpa_kernel(backend):
                    fns[0]()
            except RuntimeError as err:   # a backend without a kernel for the shape
                log(f"  {name}: {str(err).splitlines()[0]}")
                continue
            impls[name] = Impl(fns, lambda backend=backend: bench_attention.sdpa_kernel(backend), TorchGraph)
    row["ms"].update(take_turns(impls, repeat))
    del impls, views
    # the same keys in pages: the three page sizes take turns where they fit beside the cache
    seqlens = cupy.full((b,), nk, dtype=cupy.int32)
    together = (1 + len(PAGE_SIZES)) * kv_bytes * copies <= MAX_CACHE_BYTES
    groups = [PAGE_SIZES] if together else [(p,) for p in PAGE_SIZES if 2 * kv_bytes * copies <= MAX_CACHE_BYTES]
    for group in groups:
        impls, pages = {}, []
        for page_size in group:
            paged = [(q, *paged_copy(k, page_size, rng), paged_copy(v, page_size, rng)[0]) for q, k, v in data]
            pages.append(paged)
            impls[f"cuflash paged {page_size}"] = Impl([
                lambda q=q, kp=kp, vp=vp, table=table: cuflash.attention_kvcache(
                    q, kp, vp, cache_seqlens=seqlens, block_table=table, causal=causal, check=False)
                for q, kp, table, vp in paged])
        row["ms"].update(take_turns(impls, repeat))
        del impls, pages
    del data
    free()
    return row


def run_loop(dtype, d, b, hq, hkv, nk) -> dict:
    """LOOP_STEPS decoding steps with one appended key each, from nk - LOOP_STEPS cached keys."""
    rng = cupy.random.default_rng(7)
    g = hq // hkv
    k, v = draw((b, hkv, 1, nk, d), dtype, rng), draw((b, hkv, 1, nk, d), dtype, rng)
    q = draw((LOOP_STEPS, b, hkv, g, 1, d), dtype, rng)
    kn, vn = draw((LOOP_STEPS, b, hkv, 1, 1, d), dtype, rng), draw((LOOP_STEPS, b, hkv, 1, 1, d), dtype, rng)
    lengths = [cupy.full((b,), nk - LOOP_STEPS + i, dtype=cupy.int32) for i in range(LOOP_STEPS)]

    def steps():
        return [cuflash.attention_kvcache(q[i], k, v, k_new=kn[i], v_new=vn[i], cache_seqlens=lengths[i], check=False)
                for i in range(LOOP_STEPS)]

    steps()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    steps()
    stop.record()
    stop.synchronize()
    eager = cupy.cuda.get_elapsed_time(start, stop)
    graph = CupyGraph([steps], 1)   # the whole loop as one graph
    graph.replay_ms()               # (a first replay, not timed)
    replay = graph.replay_ms()
    result = {"dtype": dtype, "D": d, "B": b, "Hq": hq, "Hkv": hkv, "Nk": nk, "steps": LOOP_STEPS,
              "eager_ms": eager, "graph_ms": replay}
    del k, v, q, kn, vn, graph
    free()
    return result


def tbps(row, name, kind):
    t = row["ms"].get(name)
    return row["bytes"] / t[kind] / 1e9 if t else float("nan")


def print_tables(rows, loops):
    names = list(dict.fromkeys(n for r in rows for n in r["ms"]))
    for kind, title in (("graph_ms", "calls replayed from a CUDA graph (the device's time)"),
                        ("queued_ms", "calls queued back to back (eager: the host's time where it is longer)"),
                        ("call_ms", "one synchronized call per sample")):
        print(f"\nTB/s of K and V read once, {title}")
        print("| dtype | D | B | Hq:Hkv | Nk | Nq | " + " | ".join(names) + " | / cuDNN |")
        print("|---" * (7 + len(names)) + "|")
        for r in rows:
            cells = [tbps(r, n, kind) for n in names]
            ratio = tbps(r, "cuflash", kind) / tbps(r, "torch-cudnn", kind)
            print(f"| {r['dtype']} | {r['D']} | {r['B']} | {r['Hq']}:{r['Hkv']} | {r['Nk']} | {r['Nq']} | "
                  + " | ".join(f"{c:.2f}" for c in cells) + f" | {ratio:.2f} |")
    if loops:
        print(f"\n{LOOP_STEPS} decoding steps with appends, end to end (ms)")
        print("| dtype | D | B | Hq:Hkv | Nk | eager | one CUDA graph |")
        print("|---|---|---|---|---|---|---|")
        for r in loops:
            print(f"| {r['dtype']} | {r['D']} | {r['B']} | {r['Hq']}:{r['Hkv']} | {r['Nk']} | "
                  f"{r['eager_ms']:.2f} | {r['graph_ms']:.2f} |")


def draw_chart(rows, out):
    plt = pyplot("matplotlib missing: no chart")
    if plt is None:
        return
    names = list(dict.fromkeys(n for r in rows for n in r["ms"]))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.5), 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ax.bar([j + i * width for j in range(len(rows))], [tbps(r, name, "graph_ms") for r in rows], width, label=name)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['dtype'][:4]} D{r['D']} B{r['B']} {r['Hq']}:{r['Hkv']} {r['Nk'] // 1024}K q{r['Nq']}"
                        for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("TB/s (K and V read once), calls replayed from a CUDA graph")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "decode.png"), dpi=130)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-loop", action="store_true")
    args = ap.parse_args()
    try:
        cuflash.require_gpu()
    except RuntimeError as err:
        sys.exit(f"decode.py: {err}")
    grid = QUICK if args.quick else GRID
    os.makedirs(args.out, exist_ok=True)
    meta = run_meta(args.repeat)
    rows, loops = [], []

    def save():
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "loops": loops}, f, indent=1)

    for dtype, d, b, (hq, hkv), nk, nq in itertools.product(*grid.values()):
        log(f"{dtype} D={d} B={b} {hq}:{hkv} Nk={nk} Nq={nq}")
        row = run_cell(dtype, d, b, hq, hkv, nk, nq, args.repeat)
        if row is not None:
            rows.append(row)
            save()
    if not args.no_loop:
        for b, (hq, hkv) in ((1, (32, 8)), (8, (32, 8)), (64, (32, 8))):
            loops.append(run_loop("float16", 128, b, hq, hkv, 4096))
            save()
    draw_chart(rows, args.out)
    print(f"{meta['device']}, {meta['date']}, torch {meta['torch']}, cuDNN {meta['cudnn']}, CuPy {meta['cupy']}")
    print_tables(rows, loops)


if __name__ == "__main__":
    main()
