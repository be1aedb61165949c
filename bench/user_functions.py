#!/usr/bin/env python3
"""Score and mask functions: cuflash against FlexAttention on the same functions, and against its built-ins.

Each function of the gallery (examples/score_functions.py) as cuflash's score_mod or mask_mod,
against torch.compile(flex_attention) with the same function (its mask as a block mask from
create_block_mask), and against cuflash's built-in keyword that computes the same attention,
where one exists; forward and backward, in one process on one GPU.

    python bench/user_functions.py --out DIR            # fp16 and bf16, D 64 and 128, N 2048..16384
    python bench/user_functions.py --out DIR --quick    # bf16, D 128, N 4096
    python bench/user_functions.py --list               # the cases (no GPU)

Functions (B 2, H 16, N x N, layout (B, H, N, D)), and the built-in each is compared with:
  causal             mask i >= j                       causal=True
  window 256         mask j <= i, j >= i - 256         causal=True, window=(256, 0)
  softcap 50         50 tanh(s / 50)                   softcap=50.0
  alibi              s - slope[h] |i - j| (BLOOM's)    alibi_slopes
  relative position  s + table[h, clamp(j - i, -128, 128) + 128], a float32 (H, 257) table
  table gradient     relative position's backward with the table's gradient too (score_mod_grads;
                     in flex, a table that requires grad); backward only
  prefix-LM          j <= i or j < prefix[b], prefixes drawn in [0, N)
  document           64 documents per entry, causal within each (drawn lengths)
                                                       the same batch packed: cu_seqlens, causal=True
A mask function reaches cuflash as a block mask (cuflash.block_mask, built once per case as
create_block_mask is, per batch entry where the function reads b; its milliseconds after a first
build in "block_mask_ms"), so the kernels skip its empty tiles and test no element of its full
ones. FlexAttention: compiled afresh per case (torch._dynamo.reset()),
fullgraph, static shapes; its first call's seconds in "flex_compile_s". cuflash's first call
with a new function (trace and compile; kernels cached on disk from an earlier run are not
recompiled) in "first_call_s"; "host_us": the host time a repeat call with the function adds to
the same call without it (on one small problem, host time alone: batches of calls timed with the
GPU synchronized between them, untimed, as bench/host_overhead.py times a call).
Times are CUDA-event medians of --repeat runs over two input sets, the backward timed alone.
Writes results.json (rewritten after every row) and prints the table: milliseconds, and the
ratios "x flex" (flex's time over cuflash's) and "x built-in" (the built-in's over the function's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import cuflash  # noqa: E402
import bench_attention  # noqa: E402
import model_shapes  # noqa: E402
import score_functions as gallery  # noqa: E402
from bench_attention import free, log, run_meta, time_torch_fn, torch  # noqa: E402
from modifiers import FLEX_MISSING, bloom_alibi_slopes  # noqa: E402

try:
    import cupy
except ImportError:
    cupy = None

if torch is not None and FLEX_MISSING is None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FUNCTIONS = ("causal", "window 256", "softcap 50", "alibi", "relative position", "table gradient", "prefix-LM",
             "document")
BACKWARD_ONLY = ("table gradient",)
GRID = {"dtype": ("float16", "bfloat16"), "D": (64, 128), "N": (2048, 4096, 8192, 16384)}
QUICK = {"dtype": ("bfloat16",), "D": (128,), "N": (4096,)}
B, H, WINDOW, REACH, DOCUMENTS = 2, 16, 256, 128, 64


def captures(n, seed=0):
    """The arrays the functions read (NumPy), drawn from `seed`: slopes, the relative-position
    table, the prefixes and the document ids with their lengths."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n), DOCUMENTS - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [n]]))
    return {"slopes": bloom_alibi_slopes(H), "table": rng.standard_normal((H, 2 * REACH + 1)).astype(np.float32),
            "prefix": rng.integers(0, n, B).astype(np.int32),
            "docs": np.tile(np.repeat(np.arange(DOCUMENTS), lengths), (B, 1)).astype(np.int32), "lengths": lengths}


def cuflash_keywords(name, c):
    """cuflash's keywords for function `name` (captured arrays as CuPy arrays), its built-in's
    (None where there is none), and those the backward alone takes (or None)."""
    g = {key: cupy.asarray(value) for key, value in c.items() if key != "lengths"}
    if name == "table gradient":
        return {"score_mod": gallery.relative_position(g["table"])}, None, {"score_mod_grads": [g["table"]]}
    return {
        "causal": ({"mask_mod": gallery.causal()}, {"causal": True}),
        "window 256": ({"mask_mod": gallery.sliding_window(WINDOW)}, {"causal": True, "window": (WINDOW, 0)}),
        "softcap 50": ({"score_mod": gallery.softcap(50.0)}, {"softcap": 50.0}),
        "alibi": ({"score_mod": gallery.alibi(g["slopes"])}, {"alibi_slopes": g["slopes"]}),
        "relative position": ({"score_mod": gallery.relative_position(g["table"])}, None),
        "prefix-LM": ({"mask_mod": gallery.prefix_lm(g["prefix"])}, None),
        "document": ({"mask_mod": gallery.document(g["docs"])}, "packed"),
    }[name] + (None,)


def flex_keywords(name, c, n):
    """FlexAttention's score_mod and block mask for function `name` (the arrays as torch tensors),
    and the tensors they read whose gradients the backward takes too."""
    t = {key: torch.from_dlpack(cupy.asarray(value)) for key, value in c.items() if key != "lengths"}
    score_mod, mask, per_batch, leaves = None, None, False, ()
    if name == "table gradient":
        t["table"] = t["table"].detach().requires_grad_()
        leaves, name = (t["table"],), "relative position"
    if name == "causal":
        def mask(b, h, i, j):
            return i >= j
    elif name == "window 256":
        def mask(b, h, i, j):
            return (j <= i) & (j >= i - WINDOW)
    elif name == "softcap 50":
        def score_mod(s, b, h, i, j):
            return 50.0 * torch.tanh(s / 50.0)
    elif name == "alibi":
        def score_mod(s, b, h, i, j):
            return s - t["slopes"][h] * (i - j).abs()
    elif name == "relative position":
        def score_mod(s, b, h, i, j):
            return s + t["table"][h, (j - i).clamp(-REACH, REACH) + REACH]
    elif name == "prefix-LM":
        per_batch = True

        def mask(b, h, i, j):
            return (j <= i) | (j < t["prefix"][b])
    else:
        per_batch = True

        def mask(b, h, i, j):
            return (t["docs"][b, i] == t["docs"][b, j]) & (j <= i)
    block_mask = None if mask is None else create_block_mask(mask, B if per_batch else None, None, n, n, device="cuda")
    return {"score_mod": score_mod, "block_mask": block_mask}, leaves


def flex_first_call_s(row, flex, data, direction, leaves):
    """Seconds of flex's first call (its compile), into row["flex_compile_s"]; its error, such as
    no Triton configuration that fits the GPU's shared memory, is attempt's to record."""
    row["flex_compile_s"] = bench_attention.torch_first_call_s(flex, data, direction, leaves)
    return row["flex_compile_s"]


def flex_call(keywords):
    def call(q, k, v):
        return flex_attention(q, k, v, **keywords)
    return call


def attempt(row, provider, fn):
    """Times fn() into row["ms"][provider]; an error goes to row["skipped"] instead."""
    try:
        ms = fn()
    except Exception as err:   # not in this cuflash yet, not compiled by flex, out of memory
        row["skipped"][provider] = model_shapes.describe(err)
        log(f"  {provider}: {row['skipped'][provider]}")
        return
    finally:
        free()
    row["ms"][provider] = ms
    log(f"  {provider:10s} {ms:9.3f} ms")


def with_block_mask(kwargs, name, n):
    """cuflash's keywords with the mask function as its block mask (per batch entry for the
    functions that read b), and the block mask's build time in milliseconds (after a first build,
    which compiles its kernel); the keywords unchanged and None without a mask function."""
    if "mask_mod" not in kwargs:
        return kwargs, None
    kw = dict(kwargs)
    mask = kw.pop("mask_mod")
    batch = (B, 1) if name in ("prefix-LM", "document") else (1, 1)
    cuflash.block_mask(mask, batch, n, n)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    kw["block_mask"] = cuflash.block_mask(mask, batch, n, n)
    end.record()
    end.synchronize()
    return kw, cupy.cuda.get_elapsed_time(start, end)


def packed(data, c):
    """The input sets as packed sequences (H, B * N, D), and cu_seqlens of the documents."""
    cu = np.concatenate([[0], np.cumsum(np.tile(c["lengths"], B))]).astype(np.int32)
    sets = [tuple(cupy.ascontiguousarray(x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])) for x in s)
            for s in data]
    cu = cupy.asarray(cu)
    return sets, {"cu_seqlens_q": cu, "cu_seqlens_k": cu}


def first_call_s(data, kwargs):
    """Seconds of cuflash's first forward and backward with these functions, made afresh here:
    the trace, the generated source and its kernels (compiled, or read from the disk cache)."""
    q, k, v, do = data[0]
    start = time.perf_counter()
    out, vjp = cuflash.attention_vjp(q, k, v, **kwargs)
    vjp(do)
    cupy.cuda.Device().synchronize()
    return time.perf_counter() - start


def host_us(functions, calls=300):
    """The host time per call that the functions (a mask function as its block mask) add to the
    same forward without them, on a small problem (B 1, H 2, N 128, D 64), each timed as
    bench/host_overhead.py times it: batches of calls with the GPU synchronized between them,
    untimed, so that no kernel's time counts (a kernel longer than the host's time per call
    would set the pace of a synchronized loop)."""
    from host_overhead import host_us as per_call_us   # checks for a GPU when imported: only here

    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 128, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    builtin = {"causal": True} if "mask_mod" in functions else {}
    kwargs = dict(functions)
    if "mask_mod" in kwargs:   # (the gallery's mask functions read b at most through a clamped index)
        kwargs["block_mask"] = cuflash.block_mask(kwargs.pop("mask_mod"), (1, 1), 128, 128)
    for kw in (kwargs, builtin):   # (compiled and planned before the timing)
        for _ in range(20):
            cuflash.attention(q, k, v, **kw)
    return (per_call_us(lambda: cuflash.attention(q, k, v, **kwargs), calls)
            - per_call_us(lambda: cuflash.attention(q, k, v, **builtin), calls))


def run_shape(dtype, d, n, args, names):
    """The shape's rows, one at a time."""
    c = captures(n)
    data = bench_attention.make_inputs(B, H, n, d, dtype)
    tdata = [tuple(torch.from_dlpack(x) for x in s) for s in data] if torch is not None else None
    for name in names:
        mine, builtin, backward_only = cuflash_keywords(name, c)
        functions = mine
        mine, block_mask_ms = with_block_mask(mine, name, n)
        flex, leaves = None, ()
        if not args.no_flex and FLEX_MISSING is None:
            torch._dynamo.reset()
            fk, leaves = flex_keywords(name, c, n)
            torch._functorch.config.donated_buffer = False   # (the backward replays one graph)
            flex = torch.compile(flex_call(fk), fullgraph=True, dynamic=False)
        for direction in args.directions:
            if direction == "fwd" and name in BACKWARD_ONLY:
                continue
            log(f"{dtype} D {d} N {n} {name} {direction}")
            row = {"function": name, "dtype": dtype, "D": d, "N": n, "B": B, "H": H, "direction": direction,
                   "ms": {}, "skipped": {}}
            if direction == "fwd":
                row["first_call_s"] = first_call_s(data, mine)
                row["host_us"] = host_us(functions)
                if block_mask_ms is not None:
                    row["block_mask_ms"] = block_mask_ms
            attempt(row, "cuflash", lambda: bench_attention.time_attention(cuflash, data, False, direction,
                                                                           args.repeat, backward_only=backward_only,
                                                                           **mine))
            if builtin == "packed":
                sets, cu = packed(data, c)
                attempt(row, "built-in", lambda: bench_attention.time_attention(cuflash, sets, True, direction,
                                                                                args.repeat, **cu))
                sets = None
            elif builtin is not None:
                kw = dict(builtin)
                causal = kw.pop("causal", False)
                attempt(row, "built-in", lambda: bench_attention.time_attention(cuflash, data, causal, direction,
                                                                                args.repeat, **kw))
            if flex is not None:
                attempt(row, "flex", lambda: flex_first_call_s(row, flex, tdata[0], direction, leaves)
                        and time_torch_fn(flex, tdata, direction, args.repeat, leaves))
            yield row
            free()


def print_table(rows):
    head = ["dtype", "D", "N", "function", "dir", "cuflash ms", "flex ms", "built-in ms", "x flex", "x built-in",
            "first call s", "host us", "block mask ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        ms = r["ms"]
        mine = ms.get("cuflash")
        cells = [r["dtype"], str(r["D"]), str(r["N"]), r["function"], r["direction"],
                 f"{mine:.3f}" if mine else "-", f"{ms['flex']:.3f}" if "flex" in ms else "",
                 f"{ms['built-in']:.3f}" if "built-in" in ms else "",
                 f"{ms['flex'] / mine:.2f}" if mine and "flex" in ms else "",
                 f"{ms['built-in'] / mine:.2f}" if mine and "built-in" in ms else "",
                 f"{r['first_call_s']:.2f}" if "first_call_s" in r else "",
                 f"{r['host_us']:.1f}" if "host_us" in r else "",
                 f"{r['block_mask_ms']:.2f}" if "block_mask_ms" in r else ""]
        print("| " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/user_functions")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU)")
    parser.add_argument("--dtypes", nargs="+")
    parser.add_argument("--head-dims", nargs="+", type=int)
    parser.add_argument("--seqlens", nargs="+", type=int)
    parser.add_argument("--functions", nargs="+", choices=FUNCTIONS, default=list(FUNCTIONS))
    parser.add_argument("--directions", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    grid = QUICK if args.quick else GRID
    cells = list(itertools.product(args.dtypes or grid["dtype"], args.head_dims or grid["D"],
                                   args.seqlens or grid["N"]))
    if args.list:
        for dtype, d, n in cells:
            print(f"{dtype} D {d} N {n}: {', '.join(args.functions)} ({' '.join(args.directions)})"
                  + ("" if args.no_flex or FLEX_MISSING is None else f"; flex skipped: {FLEX_MISSING}"))
        return
    try:
        cuflash.require_gpu()   # without a GPU: the reason in one line, not a CUDA traceback
    except RuntimeError as err:
        sys.exit(f"user_functions.py: {err}")
    os.makedirs(args.out, exist_ok=True)
    results = {"meta": run_meta(args.repeat, flex=not args.no_flex and FLEX_MISSING is None), "rows": []}
    for dtype, d, n in cells:
        for row in run_shape(dtype, d, n, args, args.functions):
            results["rows"].append(row)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
    print_table(results["rows"])


if __name__ == "__main__":
    main()
