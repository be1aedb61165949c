"""The README's decoding tables from a run of bench/decode.py (its results.json).

    python bench/summarize_decode.py bench/results/<run>/decode.json [--against OTHER.json]

All ratios use one kind of time (--kind): the CUDA graph replays (graph_ms, the device's time;
the default where the run has them) or the calls queued eagerly (queued_ms, the default for
runs before graph replays were timed). Per (dtype, D, Nq): the cells, the
median and least of cuflash / cuDNN, and how many cells are at 1.0 or more and at 0.95 or more.
Then:
- Nq > 1 with and without grouped heads, as ranges;
- the cells with B * Hkv * Nk >= 2^20 keys at 4.3 TB/s or more, cuflash's and cuDNN's;
- each page size against the contiguous cache (median, least, cells at 0.9 or more);
- the decoding loops.
--against: per Nq = 1 cell present in both runs, this run's cuflash / cuDNN over the other's
(10th percentile, median, 90th), where both runs have that kind of time. Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics

LARGE_KEYS = 2**20
BAR_TBPS = 4.3


KIND = "graph_ms"   # set by main(): which time every ratio uses


def tbps(row, name):
    t = row["ms"].get(name)
    return row["bytes"] / t[KIND] / 1e9 if t and KIND in t else None


def over_cudnn(row):
    a, b = tbps(row, "cuflash"), tbps(row, "torch-cudnn")
    return a / b if a and b else None


def key(row):
    return row["dtype"], row["D"], row["B"], row["Hq"], row["Hkv"], row["Nk"], row["Nq"]


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="results.json of bench/decode.py")
    ap.add_argument("--against", help="results.json of another run to compare every Nq = 1 cell with")
    ap.add_argument("--kind", choices=("graph_ms", "queued_ms"),
                    help="the time every ratio uses (default: graph_ms where the run has it)")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        run = json.load(f)
    global KIND
    timed = all("graph_ms" in t for r in run["rows"] for t in r["ms"].values())
    KIND = args.kind or ("graph_ms" if timed else "queued_ms")
    print(f"times: {KIND}")
    rows = [r for r in run["rows"] if over_cudnn(r) is not None]

    print("| dtype | D | Nq | cells | median | least | cells at 1.0 or more | at 0.95 or more |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, d, nq in sorted({(r["dtype"], r["D"], r["Nq"]) for r in rows}, key=lambda k: (k[0] != "float16", k[1:])):
        xs = [over_cudnn(r) for r in rows if (r["dtype"], r["D"], r["Nq"]) == (dtype, d, nq)]
        name = {"float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype)
        print(f"| {name} | {d} | {nq} | {len(xs)} | {statistics.median(xs):.2f} | {min(xs):.2f} | "
              f"{sum(x >= 1.0 for x in xs)} | {sum(x >= 0.95 for x in xs)} |")

    single = [r for r in rows if r["Nq"] == 1]
    for label, pick in (("grouped", lambda r: r["Hq"] != r["Hkv"]), ("not grouped", lambda r: r["Hq"] == r["Hkv"])):
        xs = [over_cudnn(r) for r in rows if r["Nq"] > 1 and pick(r)]
        if xs:
            print(f"Nq > 1, {label}: {len(xs)} cells, {min(xs):.2f}-{max(xs):.2f}x cuDNN, "
                  f"{sum(x >= 1.0 for x in xs)} at 1.0 or more")
    large = [r for r in single if r["B"] * r["Hkv"] * r["Nk"] >= LARGE_KEYS]
    print(f"Nq = 1 with B*Hkv*Nk >= 2^20: {len(large)} cells; at {BAR_TBPS} TB/s or more: cuflash "
          f"{sum(tbps(r, 'cuflash') >= BAR_TBPS for r in large)}, cuDNN "
          f"{sum(tbps(r, 'torch-cudnn') >= BAR_TBPS for r in large)}")
    pages = sorted({int(n.rsplit(' ', 1)[1]) for r in rows for n in r["ms"] if n.startswith("cuflash paged ")})
    for page in pages:
        xs = [tbps(r, f"cuflash paged {page}") / tbps(r, "cuflash") for r in rows if f"cuflash paged {page}" in r["ms"]]
        print(f"pages of {page}: {len(xs)} cells, median {statistics.median(xs):.2f} of contiguous, least "
              f"{min(xs):.2f}, {sum(x >= 0.9 for x in xs)} at 0.9 or more")
    for loop in run.get("loops", []):
        print(f"loop of {loop['steps']} steps, {loop['dtype']} D={loop['D']} B={loop['B']} {loop['Hq']}:{loop['Hkv']} "
              f"Nk={loop['Nk']}: eager {loop['eager_ms']:.2f} ms, one CUDA graph {loop['graph_ms']:.2f} ms")

    if args.against:
        with open(args.against) as f:
            other = {key(r): r for r in json.load(f)["rows"] if over_cudnn(r) is not None}
        xs = [over_cudnn(r) / over_cudnn(other[key(r)]) for r in single if key(r) in other]
        if not xs:
            print(f"against {args.against}: no Nq = 1 cell timed by {KIND} in both runs")
        else:
            print(f"against {args.against}: {len(xs)} Nq = 1 cells, cuflash / cuDNN here over there: "
                  f"{percentile(xs, 0.1):.2f} / {statistics.median(xs):.2f} / {percentile(xs, 0.9):.2f} "
                  f"(10th percentile / median / 90th)")


if __name__ == "__main__":
    main()
