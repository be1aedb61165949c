"""The README's performance table from a grid run's results.json.

    python bench/summarize.py bench/results/<run>/results.json [--min-n 2048] [--against OTHER.json]

Per (D, causal, direction): the range over N >= --min-n of cuflash / FlashAttention-2 for
each dtype, of cuflash / cuDNN over both dtypes, and the TFLOP/s at the largest N; then the
cells where cuflash trails FlashAttention-2 (target: at least 1.0, 0.9 at D = 256), how many
cells reach 0.95 of cuDNN forward and 0.90 backward, and the backward with deterministic=False
(cuflash-any) where it was timed.
--against: each cell of every N against another run's (cuflash and FlashAttention-2 each
against their own there): per (D, causal, direction) cuflash's median and least, FA2's median
(cells where either run lacks a provider are left out). Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="results.json of bench/bench_attention.py")
    ap.add_argument("--min-n", type=int, default=2048, help="smallest N in the ranges (default: 2048)")
    ap.add_argument("--against", help="results.json of an earlier run to compare every cell with")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        rows = json.load(f)["rows"]

    def ratio(row, rival):
        return row["tflops"]["cuflash"] / row["tflops"][rival]

    long = [r for r in rows if r["N"] >= args.min_n]
    n_max = max(r["N"] for r in rows)
    label = f"{n_max // 1024}K" if n_max % 1024 == 0 else str(n_max)
    print(f"| D | causal | dir | fp16 / FA2 | bf16 / FA2 | / cuDNN | cuflash at N = {label}, fp16 / bf16 (TFLOP/s) "
          f"| FA2 at N = {label}, fp16 (TFLOP/s) |")
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["D"], r["causal"], r["direction"]) for r in rows}, key=lambda k: (k[0], k[1], k[2] != "fwd"))
    for d, causal, direction in keys:
        cell = [r for r in long if (r["D"], r["causal"], r["direction"]) == (d, causal, direction)]

        def span(values):
            return f"{min(values):.2f}–{max(values):.2f}"

        fa2 = {dt: span([ratio(r, "torch-flash") for r in cell if r["dtype"] == dt]) for dt in ("float16", "bfloat16")}
        cudnn = span([ratio(r, "torch-cudnn") for r in cell])
        top = {r["dtype"]: r for r in rows
               if (r["D"], r["causal"], r["direction"], r["N"]) == (d, causal, direction, n_max)}
        print(f"| {d} | {'yes' if causal else 'no'} | {direction} | {fa2['float16']} | {fa2['bfloat16']} | {cudnn} "
              f"| {top['float16']['tflops']['cuflash']:.0f} / {top['bfloat16']['tflops']['cuflash']:.0f} "
              f"| {top['float16']['tflops']['torch-flash']:.0f} |")
    for direction, bar in (("fwd", 0.95), ("bwd", 0.90)):
        mine = [r for r in long if r["direction"] == direction and "torch-cudnn" in r["tflops"]]
        print(f"{direction} cells (N >= {args.min_n}) at {bar:.2f} of cuDNN or more: "
              f"{sum(ratio(r, 'torch-cudnn') >= bar for r in mine)} of {len(mine)}")
    anyorder = [r for r in long if "cuflash-any" in r["tflops"] and "torch-cudnn" in r["tflops"]]
    for d in sorted({r["D"] for r in anyorder}):   # the backward with deterministic=False, where it runs other kernels
        xs = [r["tflops"]["cuflash-any"] / r["tflops"]["torch-cudnn"] for r in anyorder if r["D"] == d]
        gain = [r["tflops"]["cuflash-any"] / r["tflops"]["cuflash"] for r in anyorder if r["D"] == d]
        print(f"bwd with deterministic=False, D = {d}, {len(xs)} cells: {min(xs):.2f}–{max(xs):.2f} of cuDNN "
              f"({sum(x >= 0.90 for x in xs)} at 0.90 or more), {min(gain):.2f}–{max(gain):.2f}x the default")
    if anyorder:   # every backward cell as deterministic=False runs it (the default's kernels where it does not differ)
        called = [r["tflops"].get("cuflash-any", r["tflops"]["cuflash"]) / r["tflops"]["torch-cudnn"]
                  for r in long if r["direction"] == "bwd" and "torch-cudnn" in r["tflops"]]
        print(f"bwd cells at 0.90 of cuDNN or more, called with deterministic=False: "
              f"{sum(x >= 0.90 for x in called)} of {len(called)}")
    below = [r for r in long if ratio(r, "torch-flash") < (0.9 if r["D"] == 256 else 1.0)]
    print(f"\ntarget cells (N >= {args.min_n}): {len(long) - len(below)} of {len(long)} met")
    for r in sorted(rows, key=lambda r: ratio(r, "torch-flash")):
        if r["N"] < args.min_n and ratio(r, "torch-flash") < 1.0:
            print(f"below FA2 at N = {r['N']}: {r['dtype']} D={r['D']} causal={r['causal']} {r['direction']} "
                  f"{ratio(r, 'torch-flash'):.2f}")
    for r in below:
        print(f"below target: {r['dtype']} D={r['D']} causal={r['causal']} {r['direction']} N={r['N']} "
              f"{ratio(r, 'torch-flash'):.2f}")
    if args.against:
        with open(args.against) as f:
            compare(rows, json.load(f)["rows"], keys)


def compare(rows, earlier, keys):
    """Each cell's TFLOP/s over the earlier run's, for cuflash and FlashAttention-2."""
    cell = lambda r: (r["dtype"], r["D"], r["causal"], r["direction"], r["N"])  # noqa: E731
    before = {cell(r): r for r in earlier}
    print("\n| D | causal | dir | cuflash / earlier: median, least (cell) | FA2 / earlier: median |")
    print("|---|---|---|---|---|")
    def ratios(pairs, name):
        return [(now["tflops"][name] / old["tflops"][name], now) for now, old in pairs
                if name in now["tflops"] and name in old["tflops"]]

    for d, causal, direction in keys:
        pairs = [(r, before[cell(r)]) for r in rows
                 if (r["D"], r["causal"], r["direction"]) == (d, causal, direction) and cell(r) in before]
        ours, fa2 = ratios(pairs, "cuflash"), ratios(pairs, "torch-flash")
        if not ours:
            continue
        least, r = min(ours, key=lambda x: x[0])
        fa2_median = f"{statistics.median(x for x, _ in fa2):.2f}" if fa2 else ""
        print(f"| {d} | {'yes' if causal else 'no'} | {direction} | {statistics.median(x for x, _ in ours):.2f}, "
              f"{least:.2f} ({r['dtype']} N = {r['N']}) | {fa2_median} |")


if __name__ == "__main__":
    main()
