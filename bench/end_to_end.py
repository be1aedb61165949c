#!/usr/bin/env python3
"""End to end: a Llama-like model of 1.02B parameters trained and decoded with cuflash as its
transformers attention, against torch SDPA, in one process on one GPU.

    python bench/end_to_end.py --out DIR                 # the default run (estimated: 5 to 8 minutes on an H100)
    python bench/end_to_end.py --out DIR --quick         # N 2048 and 8192, fewer steps (estimated: 2 to 3 minutes)
    python bench/end_to_end.py --list [--quick ...]      # the planned cases, runs nothing
    python bench/end_to_end.py --out DIR --device cpu --tiny   # the plumbing on the CPU (cuflash's reference)

The model: transformers' Llama built from a LlamaConfig with random weights (seed 0), hidden
2048, 16 layers, 32 query heads and 8 key/value heads (GQA 4:1) of head dim 128, MLP 5632,
vocabulary 32000, untied embeddings: 1.02B parameters, bfloat16, AdamW (lr 3e-4, fused). The
providers, each an attention implementation of that same model (weights restored between
them):
  cuflash     cuflash.torch.register_transformers() (attn_implementation="cufa")
  sdpa        attn_implementation="sdpa", the backend torch picks
  sdpa-cudnn  the same within torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
  sdpa-flash  the same within sdpa_kernel(SDPBackend.FLASH_ATTENTION)
Sections:
  train    one step (forward, loss, backward, AdamW) at batch 1 for N in --seqlens (default
           2048, 8192, 32768) on random tokens: --warmup steps, then --steps timed, each by
           CUDA events; tokens/s from the median, peak memory (torch.cuda.max_memory_allocated
           over the timed steps). --compile adds each provider compiled (torch.compile of the
           model, fullgraph, --compile-backend), its first step's seconds in "compile_s".
  longest  the longest N each provider trains at batch 1: one step at 2048, 4096, ... until
           out of memory (caught), --max-seqlen, or --longest-budget seconds per provider.
  decode   prefill N tokens into a DynamicCache (logits of the last token only), then
           --decode-steps greedy steps of one token: tokens/s of each, timed by CUDA events
           (one untimed warm-up run at 512 tokens first).
  loss     --loss-steps steps at N 2048 from the same weights and data (each sequence a run of
           random tokens then the same run again, so attention has something to learn): the
           loss curves, and the largest relative difference between cuflash's and each rival's
           over the steps; between two SDPA backends the same number is the noise of bfloat16.
  host     microseconds of host time per call on small inputs (B 1, H 2, N 128, D 64, float16),
           as bench/host_overhead.py times them: cuflash.attention on CuPy arrays,
           cuflash.torch.attention on the same memory as torch tensors (the difference: what
           the adapter adds), transformers' attention function for cuflash, and SDPA; the
           forward, and the backward alone.
CuPy allocates through torch's caching allocator here (cupy.cuda.set_allocator), so that
cuflash's results count in torch's peak memory and the two do not keep separate caches.
A cell that cannot run (out of memory, a backend without a kernel for the shape, a compile
error) becomes "skipped: reason" in its row, and the run goes on. Writes results.json
(rewritten after every row) and, with matplotlib, end_to_end.png; prints the tables, with
cuflash's ratios to each rival of the same run; each row holds its wall seconds. Cost: the
estimates rest on about 2 s a training step at N 32768 on an H100 (not yet measured), with cuflash's
kernels already compiled (tools/warm_cache.py; else its first warm-up step compiles those it
needs); each section can be left out (--sections), and each compiled (provider, N) compiles once
(compile_s: not in the default run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402
from bench_attention import TORCH_BACKENDS, log, pyplot, run_meta, torch  # noqa: E402
from model_shapes import describe  # noqa: E402

try:
    import transformers
except ImportError:
    transformers = None
if torch is not None:
    import cuflash.torch  # noqa: E402

PROVIDERS = ("cuflash", "sdpa", "sdpa-cudnn", "sdpa-flash")
SDPA_BACKEND = {"sdpa-cudnn": "torch-cudnn", "sdpa-flash": "torch-flash"}   # TORCH_BACKENDS' names
SECTIONS = ("host", "train", "longest", "decode", "loss")
# the model's sizes: LlamaConfig keywords
MODEL = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             intermediate_size=5632, vocab_size=32000)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            intermediate_size=128, vocab_size=128)
# run settings: the default, --quick, --tiny
SETTINGS = {
    "default": dict(seqlens=[2048, 8192, 32768], warmup=2, steps=5, decode_steps=128, loss_steps=50, loss_seqlen=2048,
                    longest_from=2048, max_seqlen=131072, longest_budget=60.0),
    "quick": dict(seqlens=[2048, 8192], warmup=2, steps=3, decode_steps=32, loss_steps=20, loss_seqlen=2048,
                  longest_from=2048, max_seqlen=65536, longest_budget=30.0),
    "tiny": dict(seqlens=[64], warmup=1, steps=2, decode_steps=4, loss_steps=3, loss_seqlen=64, longest_from=64,
                 max_seqlen=256, longest_budget=30.0),
}
LR = 3e-4
SEED = 0


def parameter_count(m):
    """Parameters of a Llama with sizes `m` (untied embeddings, RMSNorm weights)."""
    h, d, inner = m["hidden_size"], m["head_dim"], m["intermediate_size"]
    attention = h * d * (2 * m["num_attention_heads"] + 2 * m["num_key_value_heads"])
    layer = attention + 3 * h * inner + 2 * h
    return m["num_hidden_layers"] * layer + 2 * m["vocab_size"] * h + h


def is_oom(err):
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


class Run:
    """The model, its initial weights, the device, and the timers."""

    def __init__(self, sizes, device, max_seqlen, compile_backend):
        self.device, self.compile_backend = device, compile_backend
        self.cuda = device == "cuda"
        config = transformers.LlamaConfig(**sizes, max_position_embeddings=max(max_seqlen, 4096), attention_dropout=0.0,
                                          tie_word_embeddings=False)
        torch.manual_seed(SEED)
        with torch.device(device):
            self.model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                       attn_implementation="sdpa").to(device)
        # kept on the host: not in the peak memory of the GPU
        self.initial = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        self.name = cuflash.torch.register_transformers()

    def use(self, provider):
        """Restores the initial weights, sets `provider`'s attention; returns (the model to call, the
        context to call it in)."""
        self.model.load_state_dict(self.initial)
        self.model.zero_grad(set_to_none=True)
        base = provider.removesuffix(" compiled")
        self.model.set_attn_implementation(self.name if base == "cuflash" else "sdpa")
        context = (torch.nn.attention.sdpa_kernel(TORCH_BACKENDS[SDPA_BACKEND[base]]) if base in SDPA_BACKEND
                   else contextlib.nullcontext())
        model = self.model
        if provider.endswith(" compiled"):
            torch._dynamo.reset()   # each compiles afresh, never past dynamo's recompile limit (eager beyond it)
            model = torch.compile(self.model, fullgraph=True, backend=self.compile_backend, dynamic=False)
        return model, context

    def optimizer(self):
        return torch.optim.AdamW(self.model.parameters(), lr=LR, fused=self.cuda)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def timed_ms(self, fn):
        """(fn()'s result, its milliseconds: CUDA events on the GPU, the host's clock on the CPU)."""
        if not self.cuda:
            start = time.perf_counter()
            out = fn()
            return out, (time.perf_counter() - start) * 1e3
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        stop.record()
        stop.synchronize()
        return out, start.elapsed_time(stop)

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        return torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def tokens(self, n, seed, batch=1):
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.model.config.vocab_size, (batch, n), generator=gen).to(self.device)


def train_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def run_train(run, provider, n, cfg):
    row = {"section": "train", "provider": provider, "N": n, "B": 1}
    model, context = run.use(provider)
    opt = run.optimizer()
    ids = run.tokens(n, n)
    with context:
        if provider.endswith(" compiled"):
            row["compile_s"] = run.timed_ms(lambda: train_step(model, opt, ids))[1] / 1e3
        for _ in range(cfg["warmup"]):
            train_step(model, opt, ids)
        run.sync()
        run.reset_peak()
        times = [run.timed_ms(lambda: train_step(model, opt, ids))[1] for _ in range(cfg["steps"])]
    ms = statistics.median(times)
    row.update(step_ms=ms, tokens_per_s=n / ms * 1e3, peak_gib=run.peak_gib())
    return row


def run_longest(run, provider, cfg):
    row = {"section": "longest", "provider": provider, "longest": None, "tried": []}
    model, context = run.use(provider)
    opt = run.optimizer()
    start, n = time.perf_counter(), cfg["longest_from"]
    with context:
        while True:
            if n > cfg["max_seqlen"]:
                row["stopped"] = f"the cap, --max-seqlen {cfg['max_seqlen']}"
                break
            if time.perf_counter() - start > cfg["longest_budget"]:
                row["stopped"] = f"the time budget, --longest-budget {cfg['longest_budget']:g} s"
                break
            ids = run.tokens(n, n)
            run.reset_peak()
            try:
                ms = run.timed_ms(lambda: train_step(model, opt, ids))[1]
            except Exception as err:   # out of memory, or a backend without a kernel at this length
                opt.zero_grad(set_to_none=True)
                row["stopped"] = f"{'out of memory' if is_oom(err) else type(err).__name__} at N {n}"
                if not is_oom(err):
                    row["error"] = describe(err)
                break
            finally:
                del ids
                run.free()
            row["tried"].append({"N": n, "step_s": ms / 1e3, "peak_gib": run.peak_gib()})
            row["longest"] = n
            log(f"  {provider} trains at N {n}: {ms / 1e3:.2f} s")
            n *= 2
    return row


def run_decode(run, provider, n, cfg):
    model, context = run.use(provider)
    row = {"section": "decode", "provider": provider, "N": n, "steps": cfg["decode_steps"]}

    def generate(prompt, steps):
        cache = transformers.DynamicCache(config=model.config)
        out, prefill_ms = run.timed_ms(lambda: model(input_ids=prompt, past_key_values=cache, use_cache=True,
                                                     logits_to_keep=1))
        token = out.logits[:, -1:].argmax(-1)

        def loop():
            t = token
            for _ in range(steps):
                t = model(input_ids=t, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            return t

        return prefill_ms, run.timed_ms(loop)[1]

    with torch.no_grad(), context:
        generate(run.tokens(min(n, 512), 1), 2)   # warm-up
        run.reset_peak()
        prefill_ms, decode_ms = generate(run.tokens(n, n), cfg["decode_steps"])
    row.update(prefill_ms=prefill_ms, prefill_tokens_per_s=n / prefill_ms * 1e3, decode_ms=decode_ms,
               decode_tokens_per_s=cfg["decode_steps"] / decode_ms * 1e3, peak_gib=run.peak_gib())
    return row


def copy_task(run, n, steps):
    """`steps` batches of one sequence: a run of random tokens, then the same run again."""
    gen = torch.Generator().manual_seed(SEED + 1)
    half = torch.randint(0, run.model.config.vocab_size, (steps, 1, n // 2), generator=gen)
    return torch.cat([half, half], -1).to(run.device)


def run_loss(run, provider, cfg):
    model, context = run.use(provider)
    opt = run.optimizer()
    data = copy_task(run, cfg["loss_seqlen"], cfg["loss_steps"])
    with context:
        losses = [train_step(model, opt, ids).item() for ids in data]
    return {"section": "loss", "provider": provider, "N": cfg["loss_seqlen"], "losses": losses}


def run_host():
    """Host microseconds per call (bench/host_overhead.py's host_us), cuflash direct and through
    the adapter, and SDPA."""
    import cupy
    from host_overhead import host_us   # checks for a GPU when imported: only here

    from cuflash import transformers as hf

    rng = cupy.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 2, 128, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    tq, tk, tv = (torch.from_dlpack(x).requires_grad_() for x in (q, k, v))
    tdo = torch.from_dlpack(do)

    class Module:
        is_causal = True

    mask = hf.attention_mask(1, 128, 128)
    tout = cuflash.torch.attention(tq, tk, tv, causal=True)
    sout = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    calls = {
        "cuflash.attention (CuPy)": lambda: cuflash.attention(q, k, v, causal=True),
        "cuflash.torch.attention": lambda: cuflash.torch.attention(tq, tk, tv, causal=True),
        "transformers attention function (cuflash)": lambda: hf.attention_forward(Module(), tq, tk, tv, mask),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True),
        "cuflash.attention_backward (CuPy)": lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=True),
        "cuflash.torch.attention backward": lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True),
        "sdpa backward": lambda: torch.autograd.grad(sout, (tq, tk, tv), tdo, retain_graph=True),
    }
    rows = []
    for name, fn in calls.items():
        row = {"section": "host", "call": name}
        try:
            row["us"] = host_us(fn, 1000)
        except Exception as err:
            row["skipped"] = describe(err)
        rows.append(row)
    return rows


def cases(args, cfg):
    """The planned rows: (section, provider, N or None)."""
    out = [("host", None, None)] if "host" in args.sections else []
    providers = list(args.providers) + ([f"{p} compiled" for p in args.providers] if args.compile else [])
    for section in ("train", "longest", "decode", "loss"):
        if section not in args.sections:
            continue
        for p in (providers if section == "train" else args.providers):
            lengths = cfg["seqlens"] if section in ("train", "decode") else [None]
            out += [(section, p, n) for n in lengths]
    return out


def print_plan(args, cfg, sizes):
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    print(f"model: Llama, hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, {heads} heads "
          f"({kv} key/value heads, GQA {heads // kv}:1) of head dim {sizes['head_dim']}, MLP "
          f"{sizes['intermediate_size']}, vocabulary {sizes['vocab_size']}: {parameter_count(sizes):,} parameters, "
          "bfloat16, AdamW")
    print(f"providers: {', '.join(args.providers)}{' (and each compiled, for train)' if args.compile else ''}")
    todo = cases(args, cfg)
    for section in SECTIONS:
        mine = [c for c in todo if c[0] == section]
        if not mine:
            continue
        what = {"host": "host microseconds per call, forward and backward",
                "train": f"batch 1, N {' '.join(map(str, cfg['seqlens']))}: {cfg['warmup']} warm-up and "
                         f"{cfg['steps']} timed steps each",
                "longest": f"doubling from N {cfg['longest_from']} to the cap {cfg['max_seqlen']}, "
                           f"{cfg['longest_budget']:g} s per provider",
                "decode": f"prefill N {' '.join(map(str, cfg['seqlens']))}, then {cfg['decode_steps']} steps",
                "loss": f"{cfg['loss_steps']} steps at N {cfg['loss_seqlen']}, seed {SEED}"}[section]
        print(f"{section}: {what}: {len(mine)} rows")
        for _, p, n in mine:
            if p is not None:
                print(f"  {p}" + (f", N {n}" if n else ""))
    print(f"{len(todo)} rows")


def table(title, head, lines):
    print(f"\n{title}")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for cells in lines:
        print("| " + " | ".join(cells) + " |")


def fmt(x, spec):
    return x if isinstance(x, str) else "" if x is None else format(x, spec)


# (section, key, format, title) of the tables by N
METRICS = (("train", "tokens_per_s", ".0f", "training tokens/s"),
           ("train", "peak_gib", ".1f", "training peak memory, GiB"),
           ("decode", "prefill_tokens_per_s", ".0f", "prefill tokens/s"),
           ("decode", "decode_tokens_per_s", ".1f", "decode tokens/s"),
           ("decode", "peak_gib", ".1f", "prefill and decode peak memory, GiB"))


def print_tables(rows):
    names = list(dict.fromkeys(r["provider"] for r in rows if "provider" in r))
    for section, key, spec, title in METRICS:
        data = {}   # {N: {provider: value, or 'skipped: reason'}}
        for r in rows:
            if r["section"] == section and "N" in r:
                data.setdefault(r["N"], {})[r["provider"]] = r.get(key) if "skipped" not in r else "skipped"
        for compiled in (False, True):   # the compiled providers against each other
            group = [p for p in names if p.endswith(" compiled") == compiled and any(p in v for v in data.values())]
            mine = "cuflash compiled" if compiled else "cuflash"
            if mine not in group:
                continue
            rivals = [p for p in group if p != mine]
            lines = []
            for n, values in sorted(data.items()):
                ours = values.get(mine)
                ratios = [f"{ours / values[p]:.2f}" if isinstance(ours, float) and isinstance(values.get(p), float)
                          and values[p] else "" for p in rivals]
                lines.append([str(n), *(fmt(values.get(p), spec) for p in group), *ratios])
            if any(isinstance(values.get(p), float) for values in data.values() for p in group):
                table(f"{title}{', compiled' if compiled else ''}; x: cuflash's over the rival's",
                      ["N", *group, *(f"x {p}" for p in rivals)], lines)
    longest = [r for r in rows if r["section"] == "longest"]
    if longest:
        table("longest N trained at batch 1", ["provider", "longest N", "stopped by", "step s at the longest"],
              [[r["provider"], fmt(r.get("longest"), "d"), r.get("stopped", f"skipped: {r.get('skipped')}"),
                fmt(r["tried"][-1]["step_s"], ".2f") if r.get("tried") else ""] for r in longest])
    losses = {r["provider"]: r["losses"] for r in rows if r["section"] == "loss" and "losses" in r}
    if len(losses) > 1:
        pairs = [(a, b) for i, a in enumerate(losses) for b in list(losses)[i + 1:]]
        table("loss curves: the largest relative difference over the steps (between two SDPA backends: "
              "bfloat16's noise)", ["pair", "max |a - b| / |b|", "final losses"],
              [[f"{a} / {b}", f"{max_relative_difference(losses[a], losses[b]):.4f}",
                f"{losses[a][-1]:.4f} / {losses[b][-1]:.4f}"] for a, b in pairs])
    host = [r for r in rows if r["section"] == "host"]
    if host:
        table("host microseconds per call (B 1, H 2, N 128, D 64, float16)", ["call", "us"],
              [[r["call"], fmt(r.get("us"), ".1f") or f"skipped: {r.get('skipped')}"] for r in host])
        us = {r["call"]: r.get("us") for r in host}
        for direct, adapter in (("cuflash.attention (CuPy)", "cuflash.torch.attention"),
                                ("cuflash.attention_backward (CuPy)", "cuflash.torch.attention backward")):
            if us.get(direct) and us.get(adapter):
                print(f"added by the adapter, {adapter}: {us[adapter] - us[direct]:.1f} us per call")
    reasons = {}
    for r in rows:
        if "skipped" in r:
            reasons.setdefault((r["section"], r.get("provider") or r.get("call"), r["skipped"]), []).append(r.get("N"))
    if reasons:
        print("\nSkipped (section, provider: reason, N):")
        for (section, who, why), ns in reasons.items():
            print(f"- {section}, {who}: {why}" + (f" (N {', '.join(map(str, ns))})" if ns[0] else ""))


def max_relative_difference(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def draw_chart(rows, out_dir):
    plt = pyplot("matplotlib not available: no chart")
    if plt is None:
        return
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (section, key, label) in zip(axes.flat[:3], (("train", "tokens_per_s", "training tokens/s"),
                                                         ("train", "peak_gib", "training peak memory, GiB"),
                                                         ("decode", "decode_tokens_per_s", "decode tokens/s"))):
        mine = [r for r in rows if r["section"] == section and r.get(key) is not None]
        for p in dict.fromkeys(r["provider"] for r in mine):
            pts = sorted((r["N"], r[key]) for r in mine if r["provider"] == p)
            ax.plot(*zip(*pts), marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        if mine:
            ax.legend(fontsize=7)
    ax = axes.flat[3]
    for r in rows:
        if r["section"] == "loss" and "losses" in r:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["provider"])
    ax.set_xlabel("step")
    ax.set_title("loss (copy task)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "end_to_end.png"), dpi=90)
    plt.close(fig)


def use_torch_allocator_for_cupy():
    """CuPy's allocations through torch's caching allocator, on CuPy's current stream (in
    cuflash.torch's calls, torch's current stream)."""
    import cupy

    def malloc(size, device):
        return torch.cuda.caching_allocator_alloc(size, device, cupy.cuda.get_current_stream().ptr)

    def free(ptr, device):
        torch.cuda.caching_allocator_delete(ptr)

    cupy.cuda.set_allocator(cupy.cuda.memory.PythonFunctionAllocator(malloc, free).malloc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="directory for results.json and the chart")
    ap.add_argument("--list", action="store_true", help="print the planned rows, run nothing")
    ap.add_argument("--quick", action="store_true", help="N 2048 and 8192, fewer steps")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model at N 64 (the plumbing, on the CPU)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--seqlens", nargs="+", type=int, help="N of train and decode")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--steps", type=int, help="timed training steps per cell")
    ap.add_argument("--decode-steps", type=int)
    ap.add_argument("--loss-steps", type=int)
    ap.add_argument("--max-seqlen", type=int, help="the longest search's cap")
    ap.add_argument("--longest-budget", type=float, help="seconds per provider for the longest search")
    ap.add_argument("--compile", action="store_true", help="also each provider compiled (train)")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--no-charts", action="store_true")
    args = ap.parse_args()
    cfg = dict(SETTINGS["tiny" if args.tiny else "quick" if args.quick else "default"])
    for key in ("seqlens", "warmup", "steps", "decode_steps", "loss_steps", "max_seqlen", "longest_budget"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    sizes = TINY if args.tiny else MODEL
    if "cuflash" not in args.providers:
        ap.error("--providers must include cuflash (the rows are its ratios to the others)")
    if args.list:
        print_plan(args, cfg, sizes)
        return
    if not args.out:
        ap.error("--out is required (except with --list)")
    if args.device == "cuda":
        try:
            cuflash.require_gpu()
        except RuntimeError as err:
            sys.exit(f"end_to_end.py: {err}")
    if torch is None or transformers is None:
        sys.exit("end_to_end.py: needs torch and transformers: pip install torch transformers")
    if args.device == "cuda":
        use_torch_allocator_for_cupy()
    os.makedirs(args.out, exist_ok=True)
    settings = dict(cfg, model=sizes, parameters=parameter_count(sizes), providers=args.providers,
                    compile=args.compile and args.compile_backend, transformers=transformers.__version__,
                    cupy_allocator="torch's caching allocator" if args.device == "cuda" else None)
    meta = (run_meta(cfg["steps"], **settings) if args.device == "cuda" else
            {"device": "cpu", "torch": torch.__version__, "repeat": cfg["steps"], **settings})
    rows = []

    def save():
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    if "host" in args.sections:
        if args.device == "cuda":
            rows.extend(run_host())
        else:
            rows.append({"section": "host", "call": "all", "skipped": "host times need a GPU"})
        save()
    run = Run(sizes, args.device, cfg["max_seqlen"], args.compile_backend)
    meta["parameters"] = sum(p.numel() for p in run.model.parameters())   # the model's, beside the --list count
    functions = {"train": lambda p, n: run_train(run, p, n, cfg), "longest": lambda p, n: run_longest(run, p, cfg),
                 "decode": lambda p, n: run_decode(run, p, n, cfg), "loss": lambda p, n: run_loss(run, p, cfg)}
    for section, provider, n in cases(args, cfg):
        if section == "host":
            continue
        log(f"{section} {provider}" + (f" N {n}" if n else ""))
        start = time.perf_counter()
        try:
            row = functions[section](provider, n)
        except Exception as err:   # out of memory, no kernel for the shape, a compile error: the row says why
            row = {"section": section, "provider": provider, "skipped": "out of memory" if is_oom(err) else describe(err)}
            if n is not None:
                row["N"] = n
            log(f"  skipped: {row['skipped']}")
        finally:
            run.free()
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        save()
    if not args.no_charts:
        draw_chart(rows, args.out)
    print(f"{meta['device']}, torch {meta['torch']}, transformers {transformers.__version__}, "
          f"{parameter_count(sizes):,} parameters")
    print_tables(rows)


if __name__ == "__main__":
    main()
