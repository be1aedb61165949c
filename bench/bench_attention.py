"""Attention benchmark: cuflash against torch SDPA's FlashAttention-2 and cuDNN backends and
against naive CuPy attention, forward and backward, in one process on one GPU.

    python bench/bench_attention.py --out DIR            # the full grid
    python bench/bench_attention.py --out DIR --quick    # a smoke test

Providers: cuflash (its defaults), cuflash-any (the backward with deterministic=False, timed
only in the cells where that runs other kernels: on Hopper at head dim 64 from 2048 queries),
torch-flash, torch-cudnn, naive.

Grid: dtype x head dim D x causal x N, with batch = 16384 / N and heads = 2048 / D, layout
(B, H, N, D). FLOPs: forward 4*B*H*N*N*D (halved when causal), backward 2.5x that, the
backward timed alone (given out, lse / the autograd graph). Times are CUDA-event medians of
--repeat runs after warm-up, cycling through two input sets so the L2 cache does not flatter.
Prints a table of TFLOP/s and cuflash/rival ratios, writes results.json and, when matplotlib is
there, one PNG chart per dtype with a panel per (direction, D, causal); without matplotlib,
`--charts-from DIR/results.json` draws them later on another machine. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402
from cuflash import naive  # noqa: E402

try:   # --charts-from needs neither CuPy nor a GPU
    import cupy
    import ml_dtypes  # noqa: F401
except ImportError:
    cupy = None

try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    TORCH_BACKENDS = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}
except ImportError:  # the benchmark still runs cuflash and naive
    torch = None
    TORCH_BACKENDS = {}

NAIVE_MAX_SCORE_BYTES = 9 * 2**30  # naive attention stores B*H*N*N float32 scores several times over


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def median_ms(fn, inputs, repeat, warmup=3, before=None):
    """The median of `repeat` timed calls of fn (CUDA events), cycling through `inputs`;
    `before()`, where given, runs ahead of each, untimed."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    times = []
    for i in range(repeat):
        if before is not None:
            before()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn(*inputs[i % len(inputs)])
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def make_inputs(b, h, n, d, dtype, sets=2):
    """`sets` independent (q, k, v, dout) sets, drawn on the GPU. Each tensor of the grid is
    64 MiB, beyond the 50 MiB L2 cache, and the timing loop alternates between sets."""
    rng = cupy.random.default_rng(n * d)
    return [
        tuple(rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(dtype) for _ in range(4))
        for _ in range(sets)
    ]


def queued_ms(fn, calls: int = 10, repeat: int = 3) -> float:
    """Median over `repeat` samples of `calls` calls queued back to back, per call (host time hidden)."""
    fn()
    times = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / calls)
    return float(np.median(times))


def free():
    """Returns the cached GPU memory of CuPy's pool (and torch's) between cells."""
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def time_attention(impl, data, causal, direction, repeat, deterministic=True, backward_only=None, **kwargs):
    """`impl`'s (cuflash or naive) forward or backward; the backward's out and lse come from cuflash
    (`deterministic` is the backward's, given only when False; `backward_only`, a dict of keywords
    the backward alone takes, such as bias_grad)."""
    if direction == "fwd":
        return median_ms(lambda q, k, v, do: impl.attention(q, k, v, causal=causal, **kwargs), data, repeat)
    saved = [(q, k, v, do) + cuflash.attention(q, k, v, causal=causal, return_lse=True, **kwargs)
             for q, k, v, do in data]
    options = dict(kwargs, **(backward_only or {}), **({} if deterministic else {"deterministic": False}))
    return median_ms(
        lambda q, k, v, do, out, lse: impl.attention_backward(do, q, k, v, out, lse, causal=causal, **options),
        saved, repeat,
    )


def time_torch(backend, data, causal, direction, repeat, **kwargs):
    """torch SDPA's `backend` forward or backward (autograd), `kwargs` passed on to SDPA."""
    tdata = [tuple(torch.from_dlpack(x) for x in item) for item in data]
    with sdpa_kernel(backend):
        return time_torch_fn(lambda q, k, v: sdpa(q, k, v, is_causal=causal, **kwargs), tdata, direction, repeat)


def time_torch_fn(fn, tdata, direction, repeat, leaves=()):
    """`fn(q, k, v) -> out` on the torch tensors of `tdata` ((q, k, v, dout) sets), forward, or its
    backward alone (autograd, the graph built beforehand): the gradients of q, k, v and `leaves`
    (other tensors fn reads that require grad)."""
    if direction == "fwd":
        return median_ms(lambda q, k, v, do: fn(q, k, v), tdata, repeat)
    graphs = []
    for q, k, v, do in tdata:
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        graphs.append((fn(q, k, v), (q, k, v, *leaves), do))
    return median_ms(lambda out, inputs, do: torch.autograd.grad(out, inputs, do, retain_graph=True), graphs, repeat)


def torch_first_call_s(fn, data, direction, leaves=()):
    """Seconds of `fn(q, k, v)`'s first call on one (q, k, v, dout) set of torch tensors (its
    compilation, for a compiled fn): forward, or forward and backward (the gradients of q, k, v
    and `leaves`)."""
    start = time.perf_counter()
    q, k, v, do = data
    if direction == "fwd":
        fn(q, k, v)
    else:
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        torch.autograd.grad(fn(q, k, v), (q, k, v, *leaves), do)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def any_order_differs(data, causal) -> bool:
    """Whether cuflash's backward with deterministic=False runs other kernels on these inputs."""
    from cuflash import _plans

    q, k, v, do = data[0]
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    plan, _ = _plans.backward(do, q, k, v, out, lse, causal, None, None, None, False)
    return plan.launches.dq_sums is not None


def run_cell(dtype, d, causal, n, direction, providers, repeat, naive_max_n):
    b, h = 16384 // n, 2048 // d
    flops = 4 * b * h * n * n * d / (2 if causal else 1) * (2.5 if direction == "bwd" else 1)
    data = make_inputs(b, h, n, d, dtype)
    row = {"dtype": dtype, "D": d, "causal": causal, "N": n, "B": b, "H": h, "direction": direction, "tflops": {}}
    for name in providers:
        try:
            if name == "cuflash":
                ms = time_attention(cuflash, data, causal, direction, repeat)
            elif name == "cuflash-any":
                if direction != "bwd" or not any_order_differs(data, causal):
                    continue
                ms = time_attention(cuflash, data, causal, direction, repeat, deterministic=False)
            elif name == "naive":
                if n > naive_max_n or b * h * n * n * 4 > NAIVE_MAX_SCORE_BYTES:
                    continue
                ms = time_attention(naive, data, causal, direction, repeat)
            else:
                ms = time_torch(TORCH_BACKENDS[name], data, causal, direction, repeat)
        except Exception as err:  # a rival without a kernel for this cell, or out of memory
            log(f"  {name}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
            continue
        finally:
            free()
        row["tflops"][name] = flops / ms / 1e9
        log(f"  {name:12s} {ms:9.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
    return row


def print_table(rows, providers):
    rivals = [p for p in providers if not p.startswith("cuflash")]
    head = ["dtype", "D", "causal", "dir", "N"] + [f"{p}" for p in providers] + [f"x {r}" for r in rivals]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        t = r["tflops"]
        cells = [r["dtype"], str(r["D"]), str(r["causal"]), r["direction"], str(r["N"])]
        cells += [f"{t[p]:.0f}" if p in t else "" for p in providers]
        cells += [f"{t['cuflash'] / t[p]:.2f}" if "cuflash" in t and p in t else "" for p in rivals]
        print("| " + " | ".join(cells) + " |")


def pyplot(missing: str):
    """matplotlib.pyplot on the Agg backend (files, no display), or None after logging `missing`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(missing)
        return None
    return plt


def run_meta(repeat: int, cuda_runtime: bool = False, **settings) -> dict:
    """results.json's "meta": GPU, date, versions (the CUDA runtime's if asked), `repeat`, then `settings`."""
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    meta = {
        "device": props["name"].decode(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cupy": cupy.__version__,
    }
    if cuda_runtime:  # key order as in earlier results.json files: after "cupy"
        meta["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    meta.update({
        "torch": torch.__version__ if torch is not None else None,
        "cudnn": torch.backends.cudnn.version() if torch is not None else None,
        "python": platform.python_version(),
        "repeat": repeat,
        **settings,
    })
    return meta


def draw_charts(rows, providers, out_dir):
    """One PNG per dtype: TFLOP/s against N, a panel per (direction, D, causal), a line per provider."""
    plt = pyplot("matplotlib not available: no charts")
    if plt is None:
        return
    for dtype in sorted({r["dtype"] for r in rows}):
        mine = [r for r in rows if r["dtype"] == dtype]
        lines = sorted({(r["direction"] == "bwd", r["causal"]) for r in mine})  # one row each
        dims = sorted({r["D"] for r in mine})  # one column each
        fig, axes = plt.subplots(len(lines), len(dims), figsize=(3.6 * len(dims), 2.6 * len(lines)), squeeze=False)
        for (i, (bwd, causal)), (j, d) in itertools.product(enumerate(lines), enumerate(dims)):
            ax = axes[i][j]
            sel = [r for r in mine if (r["direction"] == "bwd", r["D"], r["causal"]) == (bwd, d, causal)]
            for p in providers:
                pts = sorted((r["N"], r["tflops"][p]) for r in sel if p in r["tflops"])
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, label=p)
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{'bwd' if bwd else 'fwd'} D={d} {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.set_xlabel("N", fontsize=8)
            ax.set_ylabel("TFLOP/s", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"attention {dtype}, batch = 16384 / N, heads = 2048 / D", fontsize=10)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"tflops_{dtype}.png"), dpi=90)
        plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for results.json and charts")
    ap.add_argument("--quick", action="store_true", help="fp16, D=128, N in {1024, 4096}")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", nargs="+", choices=["false", "true"], default=["false", "true"])
    ap.add_argument("--directions", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    ap.add_argument("--providers", nargs="+", default=["cuflash", "cuflash-any", *TORCH_BACKENDS, "naive"])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--naive-max-n", type=int, default=2048,
                    help="longest N for naive CuPy (it is 20-60x slower and stores the N x N scores)")
    ap.add_argument("--no-charts", action="store_true")
    ap.add_argument("--charts-from", metavar="JSON", help="draw the charts and table of an earlier run into --out")
    args = ap.parse_args()
    if args.charts_from:
        with open(args.charts_from) as f:
            saved = json.load(f)
        os.makedirs(args.out, exist_ok=True)
        providers = list(dict.fromkeys(p for r in saved["rows"] for p in r["tflops"]))
        draw_charts(saved["rows"], providers, args.out)
        print_table(saved["rows"], providers)
        return
    try:
        cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
    except RuntimeError as err:
        sys.exit(f"bench_attention.py: {err}")
    if args.quick:
        args.dtypes, args.head_dims, args.seqlens = ["float16"], [128], [1024, 4096]
    os.makedirs(args.out, exist_ok=True)

    meta = run_meta(args.repeat, cuda_runtime=True)
    rows = []
    for dtype in args.dtypes:
        for d in args.head_dims:
            for causal in (c == "true" for c in args.causal):
                for n in args.seqlens:
                    for direction in args.directions:
                        log(f"{dtype} D={d} causal={causal} N={n} {direction}")
                        rows.append(run_cell(dtype, d, causal, n, direction, args.providers, args.repeat, args.naive_max_n))
                        # rewritten after every cell, so that an interrupted run keeps what it measured
                        with open(os.path.join(args.out, "results.json"), "w") as f:
                            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if not args.no_charts:
        draw_charts(rows, args.providers, args.out)
    print(f"{meta['device']}, {meta['date']}, torch {meta['torch']}, cuDNN {meta['cudnn']}, CuPy {meta['cupy']}")
    print_table(rows, args.providers)


if __name__ == "__main__":
    main()
