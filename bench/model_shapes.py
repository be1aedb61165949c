"""The shapes language models run: grouped-query attention, short sequences and a packed batch
of sequences of different lengths, cuflash against torch SDPA's FlashAttention-2 and cuDNN
backends (``enable_gqa=True``) in one process on one GPU.

    python bench/model_shapes.py --out DIR
    python bench/model_shapes.py --out DIR --quick     # two shapes and a small packed batch

Dense shapes (bfloat16, layout (B, H, N, D); cuflash reads q as (B, Hkv, G, N, D) against
k, v (B, Hkv, 1, N, D), the same memory): each is timed for cuflash, for cuflash on the same
problem with k and v expanded to every query head ("cuflash-expanded", the ungrouped
baseline), and for the two SDPA backends. The backward's peak memory-pool growth is measured
for cuflash grouped and expanded. FLOPs: forward 2*B*Hq*N*N*(D + Dv) (4*B*Hq*N*N*D when the
value head dim Dv is D; halved when causal), backward 2.5x that. A shape whose Dv differs from
D (DeepSeek-V3's 192 / 128) is skipped by the rivals that need them equal, SDPA's FLASH
backend among them, with the reason in the row's "skipped".

The packed batch: 64 sequences with lengths drawn log-uniform in [64, 8192] (seed 0), GQA 4:1
(Hq = 32, Hkv = 8), D = 128, causal, held as (total, H, D) arrays read in place as
(Hkv, G, total, D). Against it: the same batch padded to its longest sequence and run densely
by SDPA's cuDNN backend, and cuflash dense at a uniform length with the same total tokens. All
TFLOP/s of the packed rows count the real FLOPs, the sum over sequences of each one's count.

Prints a table, writes results.json and a chart (model_shapes.png, with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402
import bench_attention  # noqa: E402
from bench_attention import TORCH_BACKENDS, free, log, pyplot, run_meta  # noqa: E402

try:
    import cupy
    import ml_dtypes  # noqa: F401
except ImportError:
    cupy = None

# name: (B, Hq, Hkv, N, D, causal), or (B, Hq, Hkv, N, D, causal, Dv) where v's head dim differs
SHAPES = {
    "llama3-8b (GQA 4:1)": (2, 32, 8, 4096, 128, True),
    "llama3-8b, Hkv = 32": (2, 32, 32, 4096, 128, True),
    "MQA 16:1, D = 64": (4, 16, 1, 4096, 64, True),
    "llama3-70b (GQA 8:1)": (1, 64, 8, 8192, 128, True),
    "64 x N = 256, not causal": (64, 16, 16, 256, 128, False),
    "128 x N = 128, GQA 4:1": (128, 32, 8, 128, 64, True),
    "32 x N = 512, GQA 4:1": (32, 32, 8, 512, 128, True),
    # training (MLA expanded to heads): q, k 128 + 64 rotary dims, v 128
    "deepseek-v3 (D 192, Dv 128)": (1, 128, 128, 4096, 192, True, 128),
}
# rivals that need Dv == D: the reason their cell is skipped
NEEDS_EQUAL_HEAD_DIMS = {
    "torch-flash": "SDPA's FLASH backend (FlashAttention-2) needs the head dims of q, k and v equal",
}
QUICK = ("llama3-8b (GQA 4:1)", "128 x N = 128, GQA 4:1")
PACKED = {"sequences": 64, "shortest": 64, "longest": 8192, "Hq": 32, "Hkv": 8, "D": 128, "seed": 0}
DTYPE = "bfloat16"


def flops(b, hq, nq, nk, d, causal, direction, dv=None):
    """The two products' FLOPs, 2*Nq*Nk*D for q k^T and 2*Nq*Nk*Dv for p v per head (causal: half
    of them), the backward 2.5x the forward."""
    f = 2 * b * hq * nq * nk * (d + (d if dv is None else dv)) / (2 if causal and nq == nk else 1)
    return f * (2.5 if direction == "bwd" else 1)


def dense_inputs(b, hq, hkv, n, d, sets=2, dv=None):
    """`sets` sets of q (B, Hq, N, D), k (B, Hkv, N, D), v (B, Hkv, N, Dv), dout (B, Hq, N, Dv)."""
    dv = d if dv is None else dv
    rng = cupy.random.default_rng(n * d + hq)
    draw = lambda *shape: rng.standard_normal(shape, dtype=cupy.float32).astype(DTYPE)  # noqa: E731
    return [(draw(b, hq, n, d), draw(b, hkv, n, d), draw(b, hkv, n, dv), draw(b, hq, n, dv)) for _ in range(sets)]


def grouped(q, k, v, do, hkv):
    """cuflash's view of (B, Hq, N, D) q against (B, Hkv, N, D) k, v: native GQA by broadcasting."""
    b, hq, n, d = q.shape
    g = hq // hkv
    return q.reshape(b, hkv, g, n, d), k[:, :, None], v[:, :, None], do.reshape(b, hkv, g, n, do.shape[-1])


def expanded(q, k, v, do, hkv):
    """The same problem with k and v repeated for every query head (no grouping)."""
    g = q.shape[1] // hkv
    return q, cupy.repeat(k, g, axis=1), cupy.repeat(v, g, axis=1), do


def time_cuflash(data, causal, direction, repeat, **seqs):
    return bench_attention.time_attention(cuflash, data, causal, direction, repeat, **seqs)


def time_torch(backend, data, causal, direction, repeat):
    gqa = data[0][0].shape[1] != data[0][1].shape[1]
    return bench_attention.time_torch(backend, data, causal, direction, repeat, enable_gqa=gqa)


def backward_growth_mib(q, k, v, do, causal):
    """Growth of CuPy's memory pool over one backward (its outputs included), MiB."""
    pool = cupy.get_default_memory_pool()
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
    cupy.cuda.Device().synchronize()
    grown = pool.total_bytes() - before
    del grads
    return grown / 2**20


def describe(err) -> str:
    """'Type: first line' of an error, and of its cause where it has one (torch.compile's errors
    say little more than that they have one)."""
    text = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:120]}"
    cause = err.__cause__
    return text + (f" (from {type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0][:160]})"
                   if cause is not None else "")


def attempt(rows_tflops, name, f, fn, skipped=None):
    """Times fn() into rows_tflops[name] as TFLOP/s of `f` FLOPs; on an error, logs it (and
    records it in `skipped`, where given)."""
    try:
        ms = fn()
    except Exception as err:   # a rival without a kernel for this shape, or out of memory
        reason = describe(err)
        log(f"  {name}: {reason}")
        if skipped is not None:
            skipped[name] = reason
        return
    finally:
        free()
    rows_tflops[name] = f / ms / 1e9
    log(f"  {name:18s} {ms:9.3f} ms  {f / ms / 1e9:7.1f} TFLOP/s")


def run_dense(name, providers, repeat):
    b, hq, hkv, n, d, causal, *rest = SHAPES[name]
    dv = rest[0] if rest else d
    data = dense_inputs(b, hq, hkv, n, d, dv=dv)
    rows = []
    for direction in ("fwd", "bwd"):
        log(f"{name} {direction}")
        f = flops(b, hq, n, n, d, causal, direction, dv=dv)
        row = {"shape": name, "B": b, "Hq": hq, "Hkv": hkv, "N": n, "D": d, "Dv": dv, "causal": causal,
               "direction": direction, "tflops": {}, "skipped": {}}
        attempt(row["tflops"], "cuflash", f,
                lambda: time_cuflash([grouped(*x, hkv) for x in data], causal, direction, repeat), row["skipped"])
        if hkv != hq:
            attempt(row["tflops"], "cuflash-expanded", f,
                    lambda: time_cuflash([expanded(*x, hkv) for x in data], causal, direction, repeat), row["skipped"])
        for p in providers:
            if p in TORCH_BACKENDS and dv != d and p in NEEDS_EQUAL_HEAD_DIMS:
                row["skipped"][p] = f"{NEEDS_EQUAL_HEAD_DIMS[p]} (D {d}, Dv {dv})"
                log(f"  {p}: skipped: {row['skipped'][p]}")
            elif p in TORCH_BACKENDS:
                attempt(row["tflops"], p, f, lambda: time_torch(TORCH_BACKENDS[p], data, causal, direction, repeat),
                        row["skipped"])
        if direction == "bwd":
            row["bwd_growth_mib"] = {"cuflash": backward_growth_mib(*grouped(*data[0], hkv), causal)}
            if hkv != hq:
                row["bwd_growth_mib"]["cuflash-expanded"] = backward_growth_mib(*expanded(*data[0], hkv), causal)
            free()
        rows.append(row)
    return rows


def packed_lengths(cfg):
    rng = np.random.default_rng(cfg["seed"])
    lo, hi = np.log(cfg["shortest"]), np.log(cfg["longest"])
    return np.round(np.exp(rng.uniform(lo, hi, cfg["sequences"]))).astype(np.int64)


def run_packed(cfg, providers, repeat):
    lengths = packed_lengths(cfg)
    hq, hkv, d = cfg["Hq"], cfg["Hkv"], cfg["D"]
    g, s, total, longest = hq // hkv, len(lengths), int(lengths.sum()), int(lengths.max())
    real = {dr: sum(flops(1, hq, int(n), int(n), d, True, dr) for n in lengths) for dr in ("fwd", "bwd")}
    cu = cupy.asarray(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
    seqs = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": longest, "max_seqlen_k": longest, "check": False}
    rng = cupy.random.default_rng(1)
    draw = lambda *shape: rng.standard_normal(shape, dtype=cupy.float32).astype(DTYPE)  # noqa: E731
    # (total, H, D) arrays, as training code holds them, read in place as (Hkv, G, total, D)
    packed = [(draw(total, hq, d).transpose(1, 0, 2).reshape(hkv, g, total, d),
               draw(total, hkv, d).transpose(1, 0, 2)[:, None], draw(total, hkv, d).transpose(1, 0, 2)[:, None],
               draw(total, hq, d).transpose(1, 0, 2).reshape(hkv, g, total, d)) for _ in range(2)]
    n_uniform = total // s
    meta = {"lengths": lengths.tolist(), "total": total, "longest": longest, "uniform_N": n_uniform}
    rows = []
    for direction in ("fwd", "bwd"):
        log(f"packed batch {direction}: {s} sequences, {total} tokens, longest {longest}")
        row = {"shape": "packed", "direction": direction, "tflops": {}, **meta}
        attempt(row["tflops"], "cuflash packed", real[direction],
                lambda: time_cuflash(packed, True, direction, repeat, **seqs))
        dense = dense_inputs(s, hq, hkv, n_uniform, d)
        attempt(row["tflops"], "cuflash uniform", flops(s, hq, n_uniform, n_uniform, d, True, direction),
                lambda: time_cuflash([grouped(*x, hkv) for x in dense], True, direction, repeat))
        del dense
        free()
        if "torch-cudnn" in providers:
            padded = dense_inputs(s, hq, hkv, longest, d, sets=1)
            attempt(row["tflops"], "torch-cudnn padded", real[direction],
                    lambda: time_torch(TORCH_BACKENDS["torch-cudnn"], padded, True, direction, max(3, repeat // 3)))
            del padded
            free()
        rows.append(row)
    return rows


def print_tables(dense, packed):
    cols = ["cuflash", "cuflash-expanded", "torch-flash", "torch-cudnn"]
    head = ["shape", "dir", *cols, "x FA2", "x cuDNN", "x expanded", "bwd MiB (grouped / expanded)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in dense:
        t = r["tflops"]
        ratio = lambda p: f"{t['cuflash'] / t[p]:.2f}" if "cuflash" in t and p in t else ""  # noqa: E731
        mem = r.get("bwd_growth_mib", {})
        mem_cell = " / ".join(f"{mem[p]:.0f}" for p in ("cuflash", "cuflash-expanded") if p in mem)
        cells = [r["shape"], r["direction"], *(f"{t[p]:.0f}" if p in t else "" for p in cols),
                 ratio("torch-flash"), ratio("torch-cudnn"), ratio("cuflash-expanded"), mem_cell]
        print("| " + " | ".join(cells) + " |")
    for r in dense:
        for p, reason in r.get("skipped", {}).items():
            print(f"skipped: {r['shape']} {r['direction']} {p}: {reason}")
    if packed:
        print()
        print(f"Packed batch: {len(packed[0]['lengths'])} sequences, {packed[0]['total']} tokens, "
              f"longest {packed[0]['longest']}; uniform N = {packed[0]['uniform_N']}")
        cols = ["cuflash packed", "cuflash uniform", "torch-cudnn padded"]
        print("| dir | " + " | ".join(cols) + " | packed / uniform | packed / cuDNN padded |")
        print("|---|" + "---|" * (len(cols) + 2))
        for r in packed:
            t = r["tflops"]
            ratio = lambda p: f"{t['cuflash packed'] / t[p]:.2f}" if "cuflash packed" in t and p in t else ""  # noqa: E731
            cells = [r["direction"], *(f"{t[p]:.0f}" if p in t else "" for p in cols),
                     ratio("cuflash uniform"), ratio("torch-cudnn padded")]
            print("| " + " | ".join(cells) + " |")


def draw_bars(rows, label, title, path):
    """TFLOP/s bars: a panel per direction, a group per row (`label(row)` under it), a bar per provider."""
    plt = pyplot("matplotlib not available: no chart")
    if plt is None:
        return
    fig, axes = plt.subplots(2, 1, figsize=(12, 7))
    for ax, direction in zip(axes, ("fwd", "bwd")):
        rows_ = [r for r in rows if r["direction"] == direction]
        names = list(dict.fromkeys(p for r in rows_ for p in r["tflops"]))
        width = 0.8 / max(1, len(names))
        for i, p in enumerate(names):
            ax.bar([j + i * width for j in range(len(rows_))], [r["tflops"].get(p, 0) for r in rows_], width, label=p)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows_))])
        ax.set_xticklabels([label(r) for r in rows_], fontsize=7, rotation=15)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{direction}, {title}", fontsize=9)
        ax.legend(fontsize=7, ncol=4)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def draw_chart(dense, packed, out_dir):
    draw_bars(dense + packed, lambda r: r["shape"], DTYPE, os.path.join(out_dir, "model_shapes.png"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for results.json and the chart")
    ap.add_argument("--quick", action="store_true", help="two shapes and 16 packed sequences up to 2048")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--no-packed", action="store_true")
    ap.add_argument("--providers", nargs="+", default=list(TORCH_BACKENDS))
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    try:
        cuflash.require_gpu()
    except RuntimeError as err:
        sys.exit(f"model_shapes.py: {err}")
    cfg = dict(PACKED)
    if args.quick:
        args.shapes = list(QUICK)
        cfg.update(sequences=16, longest=2048)
    os.makedirs(args.out, exist_ok=True)
    meta = run_meta(args.repeat, dtype=DTYPE, packed=cfg)
    dense, packed = [], []

    def save():
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "dense": dense, "packed": packed}, f, indent=1)

    for name in args.shapes:
        dense.extend(run_dense(name, args.providers, args.repeat))
        save()
    if not args.no_packed:
        packed.extend(run_packed(cfg, args.providers, args.repeat))
        save()
    draw_chart(dense, packed, args.out)
    print(f"{meta['device']}, {meta['date']}, torch {meta['torch']}, cuDNN {meta['cudnn']}, CuPy {meta['cupy']}")
    print_tables(dense, packed)


if __name__ == "__main__":
    main()
