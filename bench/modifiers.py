#!/usr/bin/env python3
"""Score modifiers (softcap, ALiBi, sinks, bias, dropout): cuflash against itself without them, FlexAttention, SDPA.

cuflash with each modifier against the same cuflash call without it, FlexAttention compiled by
torch.compile on the same modifier, and torch SDPA where it takes it, forward and backward, in
one process on one GPU.

    python bench/modifiers.py --out DIR              # the grid and the model rows
    python bench/modifiers.py --out DIR --quick      # bf16, D 128, causal, N 4096, and the model rows
    python bench/modifiers.py --list [--quick ...]   # the cases and their planned skips (no GPU)

Cases (the keywords of cuflash.attention and attention_backward, docs/contract.md), each its own:
  none             the plain call: the baseline ("plain", "x plain") of the shape's other cases
  softcap50, 30    softcap=50.0, softcap=30.0
  alibi            alibi_slopes: BLOOM's slopes for the query heads (float32, one per head)
  sinks            sinks: one float32 logit per query head (drawn from N(0, 1)); the backward
                   also returns dsinks
  bias-table       bias: an (Nq, Nk) table of the inputs' dtype (drawn from N(0, 1))
  bias-heads       bias: a (1, H, Nq, Nk) table of the inputs' dtype
  bias-*-grad      the backward alone, with bias_grad=True (dbias summed to the table's shape)
  dropout0.1       dropout_p=0.1 with a fixed seed
Providers: cuflash (with the case's keywords; window and causal as the shape has them).
flex: torch's FlexAttention, compiled (torch.compile, fullgraph, static shapes) afresh for each
case (torch._dynamo.reset() first), with the modifier as its score_mod: c*tanh(s/c),
s - a[h]*|i - j|, s + table[i, j] (the table captured; in the -grad cases it requires grad);
sinks as out * sigmoid(lse - z[h]) from its lse (the extra logit's share of each row, the
gradient flowing through lse); causal and windows as a block mask. The warning
"flex_attention called without torch.compile" is turned into an error and hitting dynamo's
recompile limit raises, so every flex time is a compiled kernel's; the first call's seconds
(compilation) are in "flex_compile_s". Dropout has no FlexAttention counterpart.
torch-sdpa: bias cases, the table as SDPA's float attn_mask, in the backend torch picks
(its name in "sdpa_backend"); with causal the mask also holds -inf above the diagonal (SDPA
takes no mask with is_causal), and in the -grad cases it requires grad.
torch-flash, torch-cudnn: dropout, SDPA's FLASH and cuDNN backends with dropout_p.

Grid: float16 and bfloat16, B 2, H 16, D 64 and 128, causal and not, N 2048..16384, layout
(B, H, N, D). Model rows (bfloat16, causal; N and B are this benchmark's choice):
  gemma2-9b   Hq 16, Hkv 8, D 256, softcap 50, window of 4096 keys: (4095, 0), B 2, N 8192
  gpt-oss     Hq 64, Hkv 8, D 64, sinks, window of 128 keys: (127, 0), B 2, N 8192
  bloom       H 32, D 128, ALiBi, B 4, N 2048
A window of W keys is (W - 1, 0) with causal: the row's own key and the W - 1 before it, as in
Gemma 2's and gpt-oss's masks. Grouped heads: cuflash reads q as (B, Hkv, G, N, D) against k, v
(B, Hkv, 1, N, D) (per-head arrays as (Hkv, G)); the rivals take (B, Hq, N, D) against
(B, Hkv, N, D) with enable_gqa.
Timing and FLOPs as in bench/bench_attention.py: CUDA-event medians of --repeat runs over two
input sets, the backward timed alone; forward 4*B*Hq*N*N*D, halved when causal (a window: the
(i, j) pairs it leaves, counted exactly), backward 2.5x that; one count for every provider of a
row (SDPA with a causal mask computes the masked half too).
A provider that does not run a case is left out of the row's "tflops" and named in its
"skipped" with the reason: the planned ones (no dropout in FlexAttention, torch missing), and
any error, such as cuflash's TypeError for a keyword it does not know yet or its
NotImplementedError (a modifier not on the GPU yet), a case FlexAttention cannot compile, or
running out of memory.
Writes results.json (rewritten after every row) and, with matplotlib, charts (x_plain_DTYPE.png,
x_flex_DTYPE.png: a panel per (direction, D, causal), a line per case; models.png); prints the
tables. --charts-from draws the charts and tables of earlier runs (several: merged, a later
file's row replacing an earlier one of the same cell) into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402
import bench_attention  # noqa: E402
import model_shapes  # noqa: E402
from bench_attention import TORCH_BACKENDS, free, log, pyplot, run_meta, time_torch_fn, torch  # noqa: E402

try:
    import cupy
    import ml_dtypes  # noqa: F401
except ImportError:
    cupy = None

FLEX_MISSING = "torch is not installed" if torch is None else None
AuxRequest = None
if torch is not None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        FLEX_MISSING = f"torch {torch.__version__} has no FlexAttention"
    try:   # its lse, as asked for since torch 2.9 (return_lse before)
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        pass

MODIFIERS = ("none", "softcap50", "softcap30", "alibi", "sinks", "bias-table", "bias-table-grad",
             "bias-heads", "bias-heads-grad", "dropout0.1")
SEED = 1234
NOT_IN_FLEX = {"dropout": "FlexAttention has no dropout"}
# name: (B, Hq, Hkv, N, D, window (left, right) or None, the model's case); causal, bfloat16
MODELS = {
    "gemma2-9b": (2, 16, 8, 8192, 256, (4095, 0), "softcap50"),
    "gpt-oss": (2, 64, 8, 8192, 64, (127, 0), "sinks"),
    "bloom": (4, 32, 32, 2048, 128, None, "alibi"),
}
GRID = {"dtype": ("float16", "bfloat16"), "D": (64, 128), "causal": (False, True), "N": (2048, 4096, 8192, 16384)}
QUICK = {"dtype": ("bfloat16",), "D": (128,), "causal": (True,), "N": (4096,)}
GRID_B, GRID_H = 2, 16
RIVALS = ("flex", "torch-sdpa", "torch-flash", "torch-cudnn")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One problem: "grid" or a model row's name, and its sizes; window as cuflash takes it."""

    name: str
    dtype: str
    b: int
    hq: int
    hkv: int
    n: int
    d: int
    causal: bool
    window: tuple | None = None

    def flops(self, direction):
        if self.window is None:
            return model_shapes.flops(self.b, self.hq, self.n, self.n, self.d, self.causal, direction)
        # model_shapes.flops counts Nq * Nk pairs per head: here, the pairs the window leaves
        return model_shapes.flops(self.b, self.hq, 1, window_pairs(self.n, self.n, self.causal, self.window),
                                  self.d, False, direction)

    def label(self):
        heads = f"H {self.hq}" if self.hq == self.hkv else f"Hq:Hkv {self.hq}:{self.hkv}"
        mask = ("causal" if self.causal else "non-causal") + (f", window {tuple(self.window)}" if self.window else "")
        return f"{self.name} {self.dtype} ({heads}, D {self.d}, B {self.b}, N {self.n}, {mask})"


def window_pairs(nq, nk, causal, window):
    """How many (i, j) pairs row i sees key j in: i + off - left <= j <= i + off + right, off = Nk - Nq
    (right 0 with causal; None: unbounded)."""
    left, right = window[0], 0 if causal else window[1]
    i = np.arange(nq, dtype=np.int64) + (nk - nq)
    lo = np.zeros_like(i) if left is None else np.maximum(0, i - left)
    hi = np.full_like(i, nk - 1) if right is None else np.minimum(nk - 1, i + right)
    return int(np.maximum(0, hi - lo + 1).sum())


def bloom_alibi_slopes(heads):
    """BLOOM's ALiBi slopes (its build_alibi_tensor): 2^(-8 i / n), i = 1..n, for the largest power
    of two n <= heads, then every other slope of the sequence for 2n for the remaining heads."""
    n = 2 ** int(math.floor(math.log2(heads)))
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    slopes += [2.0 ** (-8.0 * i / (2 * n)) for i in range(1, 2 * (heads - n), 2)]
    return np.array(slopes, dtype=np.float32)


def directions(mod, wanted):
    return [d for d in ("fwd", "bwd") if d in wanted and (d == "bwd" or not mod.endswith("-grad"))]


def plan(mod, flex):
    """The providers that time case `mod` and the planned skips {provider: reason}."""
    providers, skipped = ["cuflash"], {}
    rivals = (["flex"] if flex else []) + (["torch-sdpa"] if mod.startswith("bias") else []) + \
        (["torch-flash", "torch-cudnn"] if mod.startswith("dropout") else [])
    for p in rivals:
        if p == "flex" and any(mod.startswith(m) for m in NOT_IN_FLEX):
            skipped[p] = next(r for m, r in NOT_IN_FLEX.items() if mod.startswith(m))
        elif p == "flex" and FLEX_MISSING:
            skipped[p] = FLEX_MISSING
        elif torch is None:
            skipped[p] = "torch is not installed"
        else:
            providers.append(p)
    return providers, skipped


def shapes(args):
    """The grid's shapes, then the model rows' (each with its cases)."""
    grid = QUICK if args.quick else GRID
    out = []
    for dtype, d, causal, n in itertools.product(args.dtypes or grid["dtype"], args.head_dims or grid["D"],
                                                 args.causal or grid["causal"], args.seqlens or grid["N"]):
        out.append((Shape("grid", dtype, GRID_B, GRID_H, GRID_H, n, d, causal), list(args.modifiers)))
    for name in args.models:
        b, hq, hkv, n, d, window, mod = MODELS[name]
        out.append((Shape(name, model_shapes.DTYPE, b, hq, hkv, n, d, True, window),
                    [m for m in ("none", mod) if m in args.modifiers]))
    return out


def modifier_arrays(mod, shape):
    """cuflash's keywords for case `mod` (CuPy arrays laid out for its batch dims: (H,) or, grouped,
    (Hkv, G)), and those of the backward alone."""
    rng = cupy.random.default_rng(shape.n + shape.d)
    heads = (shape.hq,) if shape.hq == shape.hkv else (shape.hkv, shape.hq // shape.hkv)
    if mod.startswith("softcap"):
        return {"softcap": float(mod[len("softcap"):])}, {}
    if mod == "alibi":
        return {"alibi_slopes": cupy.asarray(bloom_alibi_slopes(shape.hq).reshape(heads))}, {}
    if mod == "sinks":
        return {"sinks": rng.standard_normal(heads, dtype=cupy.float32)}, {}
    if mod.startswith("bias"):
        bias = cupy.empty((shape.n, shape.n) if mod.startswith("bias-table") else (1, *heads, shape.n, shape.n),
                          dtype=shape.dtype)
        for table in bias.reshape(-1, shape.n, shape.n):   # drawn a head at a time: no float32 copy of the whole
            table[...] = rng.standard_normal((shape.n, shape.n), dtype=cupy.float32).astype(shape.dtype)
        return {"bias": bias}, ({"bias_grad": True} if mod.endswith("-grad") else {})
    if mod.startswith("dropout"):
        return {"dropout_p": float(mod[len("dropout"):]), "seed": SEED}, {}
    return {}, {}


def as_torch(kwargs, shape):
    """The modifier arrays as torch tensors of the rivals' layout: per head (Hq,), bias (N, N) or
    (1, Hq, N, N); new tensor objects on the same memory."""
    out = {}
    for key, x in kwargs.items():
        if key in ("alibi_slopes", "sinks"):
            out[key] = torch.from_dlpack(x).reshape(shape.hq)
        elif key == "bias":
            out[key] = torch.from_dlpack(x).reshape(x.shape if x.ndim == 2 else (1, shape.hq, shape.n, shape.n))
    return out


def flex_call(mod, shape, mods, device="cuda"):
    """The case's FlexAttention function (q, k, v) -> out on the rivals' layout, compiled."""
    score_mod = None
    if mod.startswith("softcap"):
        cap = float(mod[len("softcap"):])

        def score_mod(s, b, h, i, j):
            return cap * torch.tanh(s / cap)
    elif mod == "alibi":
        slopes = mods["alibi_slopes"]

        def score_mod(s, b, h, i, j):   # Nq == Nk: off = 0
            return s - slopes[h] * (i - j).abs()
    elif mod.startswith("bias-table"):
        table = mods["bias"]

        def score_mod(s, b, h, i, j):
            return s + table[i, j]
    elif mod.startswith("bias-heads"):
        table = mods["bias"]

        def score_mod(s, b, h, i, j):
            return s + table[0, h, i, j]
    block_mask = None
    if shape.causal:
        left = shape.window[0] if shape.window else None

        def visible(b, h, i, j):
            return (i >= j) & (i - j <= left) if left is not None else i >= j

        block_mask = create_block_mask(visible, None, None, shape.n, shape.n, device=device)
    elif shape.window:
        raise NotImplementedError("windows without causal are not in this benchmark")
    gqa = shape.hq != shape.hkv
    if mod == "sinks":
        sinks = mods["sinks"]

        def call(q, k, v):
            if AuxRequest is not None:
                out, aux = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa,
                                          return_aux=AuxRequest(lse=True))
                lse = aux.lse
            else:
                out, lse = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_lse=True)
            # the row's softmax over its keys and the sink: out scaled by exp(lse) / (exp(lse) + exp(z))
            return out * torch.sigmoid(lse - sinks[:, None]).unsqueeze(-1).to(out.dtype)
    else:
        def call(q, k, v):
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)
    # (the backward is timed by replaying one graph, retain_graph=True, which compiled
    # autograd's donated buffers refuse)
    torch._functorch.config.donated_buffer = False
    return torch.compile(call, fullgraph=True, dynamic=False)


def sdpa_bias_call(shape, bias, grad):
    """SDPA with the bias as its float attn_mask (causal: -inf above the diagonal, in a copy), the
    backend torch picks; and the mask when its gradient is asked for."""
    mask = bias
    if shape.causal:
        above = torch.ones(shape.n, shape.n, dtype=torch.bool, device=bias.device).triu(1)
        mask = bias.masked_fill(above, float("-inf"))
    mask = mask.detach().requires_grad_(grad)
    gqa = {"enable_gqa": True} if shape.hq != shape.hkv else {}
    return (lambda q, k, v: bench_attention.sdpa(q, k, v, attn_mask=mask, **gqa)), mask


def sdpa_backend(q, k, v, mask, grad):
    """The backend SDPA picks for q, k, v (requiring grad when `grad`) and `mask` as it is, by its
    own choice function (None where unknown)."""
    from torch.nn.attention import SDPBackend

    try:
        choice = int(torch._fused_sdp_choice(*(x.detach().requires_grad_(grad) for x in (q, k, v)), mask, 0.0, False))
    except Exception:   # a private function: absent or changed in another torch
        return None
    return next((name for name, b in SDPBackend.__members__.items() if int(b.value) == choice), str(choice))


def not_yet(reason):
    """cuflash's error `reason` ("Type: message"), marked where it is a modifier not on the GPU yet: a
    keyword it does not know (TypeError) or NotImplementedError."""
    unknown = reason.startswith("NotImplementedError") or (reason.startswith("TypeError") and "keyword" in reason)
    return f"not in this cuflash yet: {reason}" if unknown else reason


class Case:
    """One (shape, modifier) case: its inputs, timed per direction and provider into rows."""

    def __init__(self, shape, mod, data, repeat):
        self.shape, self.mod, self.data, self.repeat = shape, mod, data, repeat
        grouped = shape.hq != shape.hkv
        self.cdata = [model_shapes.grouped(*x, shape.hkv) for x in data] if grouped else data
        self.kwargs, self.backward_only = modifier_arrays(mod, shape)
        self.tdata = [tuple(torch.from_dlpack(x) for x in item) for item in data] if torch is not None else None
        self.mods = as_torch(self.kwargs, shape) if torch is not None else {}
        self.flex = None

    def time(self, provider, direction, row):
        s = self.shape
        if provider == "cuflash":
            return bench_attention.time_attention(cuflash, self.cdata, s.causal, direction, self.repeat,
                                                  backward_only=self.backward_only, window=s.window, **self.kwargs)
        if provider == "flex":
            if self.flex is None:
                self.flex = flex_call(self.mod, s, self.mods)
            leaves = []
            if direction == "bwd":   # the gradients cuflash's backward returns too
                leaves = [self.mods[key].requires_grad_() for key in ("sinks",) if key in self.mods]
                leaves += [self.mods["bias"].requires_grad_()] if self.backward_only.get("bias_grad") else []
            row["flex_compile_s"] = bench_attention.torch_first_call_s(self.flex, self.tdata[0], direction, leaves)
            return time_torch_fn(self.flex, self.tdata, direction, self.repeat, leaves)
        if provider == "torch-sdpa":
            grad = direction == "bwd" and bool(self.backward_only.get("bias_grad"))
            call, mask = sdpa_bias_call(s, self.mods["bias"], grad)
            row["sdpa_backend"] = sdpa_backend(*self.tdata[0][:3], mask, direction == "bwd")
            return time_torch_fn(call, self.tdata, direction, self.repeat, [mask] if grad else [])
        gqa = {"enable_gqa": True} if s.hq != s.hkv else {}
        return bench_attention.time_torch(TORCH_BACKENDS[provider], self.data, s.causal, direction, self.repeat,
                                          dropout_p=self.kwargs["dropout_p"], **gqa)


def run_case(shape, mod, data, args):
    providers, planned = plan(mod, not args.no_flex)
    if "flex" in providers:
        torch._dynamo.reset()   # each case compiles afresh
    case = Case(shape, mod, data, args.repeat)
    rows = []
    for direction in directions(mod, args.directions):
        log(f"{shape.label()} {mod} {direction}")
        f = shape.flops(direction)
        row = {"shape": shape.name, "dtype": shape.dtype, "B": shape.b, "Hq": shape.hq, "Hkv": shape.hkv,
               "N": shape.n, "D": shape.d, "causal": shape.causal, "window": shape.window, "modifier": mod,
               "direction": direction, "flops": f, "tflops": {}, "skipped": dict(planned)}
        for p in providers:   # an error (not implemented yet, not expressible, out of memory): in "skipped"
            model_shapes.attempt(row["tflops"], p, f, lambda: case.time(p, direction, row), row["skipped"])
            if p == "cuflash" and p in row["skipped"]:
                row["skipped"][p] = not_yet(row["skipped"][p])
        rows.append(row)
    case = None   # its arrays back to the pools
    free()
    return rows


def inputs(shape):
    """Two input sets of (B, Hq, N, D) q, dout and (B, Hkv, N, D) k, v, as the other scripts draw them."""
    if shape.hq == shape.hkv:
        return bench_attention.make_inputs(shape.b, shape.hq, shape.n, shape.d, shape.dtype)
    assert shape.dtype == model_shapes.DTYPE
    return model_shapes.dense_inputs(shape.b, shape.hq, shape.hkv, shape.n, shape.d)


def cell(row):
    """A row's cell without its case: the rows of one cell share their "plain" (the "none" row's)."""
    return (row["shape"], row["dtype"], row["B"], row["Hq"], row["Hkv"], row["N"], row["D"], row["causal"],
            tuple(row["window"]) if row["window"] else None, row["direction"])


def ratios(rows):
    """{id(row): {"plain": ..., rival: ...}}: cuflash's TFLOP/s over the plain call's and each rival's."""
    plain = {cell(r): r["tflops"]["cuflash"] for r in rows if r["modifier"] == "none" and "cuflash" in r["tflops"]}
    out = {}
    for r in rows:
        t, mine = r["tflops"], r["tflops"].get("cuflash")
        x = {p: mine / t[p] for p in RIVALS if mine and p in t}
        if mine and r["modifier"] != "none" and cell(r) in plain:
            x["plain"] = mine / plain[cell(r)]
        out[id(r)] = x
    return out


def print_tables(rows):
    x = ratios(rows)
    plain = {cell(r): r["tflops"]["cuflash"] for r in rows if r["modifier"] == "none" and "cuflash" in r["tflops"]}
    cols = ["cuflash", "plain", *RIVALS]
    for title, mine, lead in (("Grid (B 2, H 16), TFLOP/s", [r for r in rows if r["shape"] == "grid"],
                               lambda r: [r["dtype"], str(r["D"]), str(r["causal"]), str(r["N"])]),
                              ("Model rows (bfloat16, causal), TFLOP/s", [r for r in rows if r["shape"] != "grid"],
                               lambda r: [Shape(r["shape"], r["dtype"], r["B"], r["Hq"], r["Hkv"], r["N"], r["D"],
                                                r["causal"], r["window"]).label()])):
        if not mine:
            continue
        head = (["dtype", "D", "causal", "N"] if mine[0]["shape"] == "grid" else ["shape"]) + \
            ["case", "dir", *cols, *(f"x {c}" for c in ("plain", *RIVALS)), "skipped"]
        print(f"\n{title}; x: cuflash's TFLOP/s over the plain call's and each rival's")
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in mine:
            t = dict(r["tflops"], plain=plain.get(cell(r))) if r["modifier"] != "none" else r["tflops"]
            cells = lead(r) + [r["modifier"], r["direction"]]
            cells += [f"{t[c]:.0f}" if t.get(c) else "" for c in cols]
            cells += [f"{x[id(r)][c]:.2f}" if c in x[id(r)] else "" for c in ("plain", *RIVALS)]
            cells.append(", ".join(r["skipped"]))
            print("| " + " | ".join(cells) + " |")
    reasons = {}
    for r in rows:
        for p, why in r["skipped"].items():
            reasons.setdefault((p, r["modifier"], why), []).append(r)
    if reasons:
        print("\nSkipped (provider, case: reason, rows):")
        for (p, mod, why), rs in reasons.items():
            print(f"- {p}, {mod}: {why} ({len(rs)} rows)")
    backends = sorted({(r["modifier"], r["direction"], r["sdpa_backend"]) for r in rows if r.get("sdpa_backend")})
    for mod, direction, name in backends:
        print(f"torch-sdpa picked {name} for {mod} {direction}")


def draw_charts(rows, out_dir):
    """Per dtype, cuflash over the plain call (x_plain_DTYPE.png) and over FlexAttention
    (x_flex_DTYPE.png) against N, a panel per (direction, D, causal), a line per case; the model
    rows' TFLOP/s per provider (models.png)."""
    plt = pyplot("matplotlib not available: no charts")
    if plt is None:
        return
    x = ratios(rows)
    grid = [r for r in rows if r["shape"] == "grid"]
    for kind, dtype in itertools.product(("plain", "flex"), sorted({r["dtype"] for r in grid})):
        mine = [r for r in grid if r["dtype"] == dtype and kind in x[id(r)]]
        if not mine:
            continue
        lines = sorted({(r["direction"] == "bwd", r["causal"]) for r in mine})
        dims = sorted({r["D"] for r in mine})
        fig, axes = plt.subplots(len(lines), len(dims), figsize=(3.8 * len(dims), 2.8 * len(lines)), squeeze=False)
        for (i, (bwd, causal)), (j, d) in itertools.product(enumerate(lines), enumerate(dims)):
            ax = axes[i][j]
            sel = [r for r in mine if (r["direction"] == "bwd", r["D"], r["causal"]) == (bwd, d, causal)]
            for mod in dict.fromkeys(r["modifier"] for r in sel):
                pts = sorted((r["N"], x[id(r)][kind]) for r in sel if r["modifier"] == mod)
                ax.plot(*zip(*pts), marker="o", markersize=3, label=mod, color=f"C{MODIFIERS.index(mod) % 10}")
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{'bwd' if bwd else 'fwd'} D={d} {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.set_xlabel("N", fontsize=8)
            ax.set_ylabel(f"cuflash / {'without the modifier' if kind == 'plain' else 'FlexAttention'}", fontsize=7)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        legend = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels())}
        fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=5, fontsize=7)
        fig.suptitle(f"score modifiers, {dtype}, B = {GRID_B}, H = {GRID_H}: cuflash's TFLOP/s over "
                     f"{'the same call without the modifier' if kind == 'plain' else 'FlexAttention (torch.compile)'}",
                     fontsize=9)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        fig.savefig(os.path.join(out_dir, f"x_{kind}_{dtype}.png"), dpi=90)
        plt.close(fig)
    models = [r for r in rows if r["shape"] != "grid"]
    if models:
        model_shapes.draw_bars(models, lambda r: f"{r['shape']} {r['modifier']}", "model rows, bfloat16",
                               os.path.join(out_dir, "models.png"))


def print_plan(todo, args):
    flex = not args.no_flex
    rows = compiles = 0
    for shape, mods in todo:
        print(shape.label())
        for mod in mods:
            providers, skipped = plan(mod, flex)
            dirs = directions(mod, args.directions)
            rows += len(dirs)
            compiles += len(dirs) if "flex" in providers else 0
            skips = "; skipped: " + ", ".join(f"{p} ({why})" for p, why in skipped.items()) if skipped else ""
            print(f"  {mod} ({', '.join(dirs)}): {', '.join(providers)}{skips}")
    print(f"{len(todo)} shapes, {rows} rows, {compiles} FlexAttention compilations "
          "(a case's forward and backward each)")


def load(paths):
    """The rows of earlier results.json files, a later file's row replacing an earlier one of the same cell."""
    merged = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                merged[cell(r) + (r["modifier"],)] = r
    return list(merged.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for results.json and the charts")
    ap.add_argument("--quick", action="store_true", help="bfloat16, D 128, causal, N 4096 (and the model rows)")
    ap.add_argument("--no-flex", action="store_true", help="without FlexAttention (no compilation)")
    ap.add_argument("--list", action="store_true", help="print the cases and their planned skips, run nothing")
    ap.add_argument("--dtypes", nargs="+", choices=GRID["dtype"], help="grid dtypes (default: both)")
    ap.add_argument("--head-dims", nargs="+", type=int, help="grid head dims (default: 64 128)")
    ap.add_argument("--seqlens", nargs="+", type=int, help="grid N (default: 2048 4096 8192 16384)")
    ap.add_argument("--causal", nargs="+", choices=["false", "true"], help="grid masks (default: both)")
    ap.add_argument("--directions", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    ap.add_argument("--modifiers", nargs="+", choices=MODIFIERS, default=list(MODIFIERS),
                    help="the cases (default: all; the model rows run theirs and none where listed)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--no-models", action="store_true", help="the grid only")
    ap.add_argument("--no-grid", action="store_true", help="the model rows only")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-charts", action="store_true")
    ap.add_argument("--charts-from", nargs="+", metavar="JSON",
                    help="draw the charts and tables of earlier runs into --out (several: merged)")
    args = ap.parse_args()
    if args.causal:
        args.causal = [c == "true" for c in args.causal]
    if args.no_models:
        args.models = []
    todo = shapes(args)
    if args.no_grid:
        todo = [(s, m) for s, m in todo if s.name != "grid"]
    if args.list:
        print_plan(todo, args)
        return
    if not args.out:
        ap.error("--out is required (except with --list)")
    if args.charts_from:
        rows = load(args.charts_from)
        os.makedirs(args.out, exist_ok=True)
        if not args.no_charts:
            draw_charts(rows, args.out)
        print_tables(rows)
        return
    try:
        cuflash.require_gpu()
    except RuntimeError as err:
        sys.exit(f"modifiers.py: {err}")
    os.makedirs(args.out, exist_ok=True)
    if not args.no_flex and FLEX_MISSING is None:
        # a FlexAttention time is a compiled kernel's or none: the eager fallback's warning is an
        # error, and so is running into dynamo's recompile limit (past it, dynamo runs eagerly)
        warnings.filterwarnings("error", message=r".*flex_attention called without torch\.compile")
        if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
            torch._dynamo.config.fail_on_recompile_limit_hit = True
    meta = run_meta(args.repeat, cuda_runtime=True, flex=not args.no_flex and FLEX_MISSING is None,
                    quick=args.quick, dropout_seed=SEED, models={m: MODELS[m] for m in args.models})
    rows = []
    for shape, mods in todo:
        data = inputs(shape)
        for mod in mods:
            rows.extend(run_case(shape, mod, data, args))
            # rewritten after every case, so that an interrupted run keeps what it measured
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
        del data
        free()
    if not args.no_charts:
        draw_charts(rows, args.out)
    print(f"{meta['device']}, {meta['date']}, torch {meta['torch']}, cuDNN {meta['cudnn']}, CuPy {meta['cupy']}")
    print_tables(rows)


if __name__ == "__main__":
    main()
