"""The examples and benchmark scripts, run where no GPU is visible, exit with cuflash's
one-line reason rather than a CUDA traceback.

CUDA_VISIBLE_DEVICES="" hides every GPU, so these run the same on a machine with GPUs
(the driver sees none) and on one without a driver.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cuflash

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [
    ("examples/train_attention.py", []),
    ("examples/torch_interop.py", []),
    ("examples/jax_interop.py", []),
    ("examples/ring_attention.py", []),
    ("bench/bench_attention.py", ["--out", "{tmp}"]),
    ("bench/model_shapes.py", ["--out", "{tmp}"]),
    ("bench/decode.py", ["--out", "{tmp}"]),
    ("bench/modifiers.py", ["--out", "{tmp}"]),
    ("bench/block_mask.py", ["--out", "{tmp}"]),
    ("bench/user_functions.py", ["--out", "{tmp}"]),
    ("bench/end_to_end.py", ["--out", "{tmp}"]),
    ("bench/ring_attention.py", ["--out", "{tmp}"]),
    ("bench/float32_accuracy.py", []),
    ("bench/host_overhead.py", []),
    ("bench/profile_case.py", []),
    ("bench/tune_tiles.py", []),
    ("bench/ab_trees.py", ["."]),
    ("bench/cudnn_deterministic.py", []),
    ("tools/warm_cache.py", []),
]


def no_gpu_env() -> dict:
    """The environment of a script run here: no GPU visible, and the cuflash under test on the
    path (also for the examples, which import whichever cuflash is installed)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(cuflash.__file__).parent.parent), env.get("PYTHONPATH", "")])
    return env


def run_script(script, *args, env=None, timeout=120):
    """A script run here with ``args`` (in ``no_gpu_env()`` unless ``env`` is given), its output captured."""
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=no_gpu_env() if env is None else env, timeout=timeout)


def in_checkout(path):
    """The file at ``path`` in the source checkout, or a skip where the tests run outside one."""
    script = ROOT / path
    if not script.is_file():
        pytest.skip(f"{path} is not beside the tests (they run outside a source checkout)")
    return script


@pytest.mark.parametrize("script, args", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_script_without_gpu_says_why_in_one_line(tmp_path, script, args):
    done = run_script(in_checkout(script), *(a.format(tmp=tmp_path) for a in args))
    lines = done.stderr.strip().splitlines()
    name = Path(script).name
    assert done.returncode == 1, f"{script} exited {done.returncode}: {done.stderr[-2000:]}"
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"{name}: cuflash's GPU functions need an NVIDIA GPU: "), lines[0]


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_example_help_works_without_gpu(script):
    """--help is read before the GPU check: it prints the usage and exits 0 on any machine."""
    done = run_script(ROOT / "examples" / script, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: {script} "), done.stdout + done.stderr


def run_against(script, tmp_path, now: dict, before: dict) -> list[str]:
    """The output lines of a summarizer run on ``now`` with --against ``before`` (written as JSON)."""
    import json

    (tmp_path / "now.json").write_text(json.dumps(now))
    (tmp_path / "before.json").write_text(json.dumps(before))
    done = run_script(script, str(tmp_path / "now.json"), "--against", str(tmp_path / "before.json"), timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_summarize_compares_two_runs(tmp_path):
    """bench/summarize.py on two small grids: the table, the cells below FA2, and --against
    (each provider against its own earlier cell; a cell one run lacks is left out)."""
    script = in_checkout("bench/summarize.py")

    def rows(cuflash_tflops, fa2=True):
        out = []
        for dtype in ("float16", "bfloat16"):
            for n, tflops in zip((512, 2048, 4096), cuflash_tflops):
                rivals = {"torch-flash": 100.0, "torch-cudnn": 200.0} if fa2 or n != 512 else {"torch-cudnn": 200.0}
                out.append({"dtype": dtype, "D": 64, "causal": True, "direction": "fwd", "N": n, "B": 1, "H": 1,
                            "tflops": {"cuflash": tflops, **rivals}})
        return out

    lines = run_against(script, tmp_path, {"rows": rows((90.0, 120.0, 130.0))},
                        {"rows": rows((90.0, 100.0, 130.0), fa2=False)})
    assert "| 64 | yes | fwd | 1.20–1.30 | 1.20–1.30 | 0.60–0.65 | 130 / 130 | 100 |" in lines
    assert "target cells (N >= 2048): 4 of 4 met" in lines
    assert any(line.startswith("below FA2 at N = 512: float16") for line in lines)
    # against the earlier run: cuflash 1.0, 1.2, 1.0 per dtype (median 1.00, least 1.00); FA2 1.0 where both have it
    assert "| 64 | yes | fwd | 1.00, 1.00 (float16 N = 512) | 1.00 |" in lines


def test_summarize_decode_counts_cells_pages_and_runs(tmp_path):
    """bench/summarize_decode.py on two small decoding runs: the per-dtype table, the grouped
    ranges, the large cells at 4.3 TB/s, the pages against contiguous and --against."""
    script = in_checkout("bench/summarize_decode.py")

    def row(b, hkv, nq, cuflash_ms, cudnn_ms, paged_ms=None, kinds=("graph_ms", "queued_ms")):
        # the eager (queued) times are the graph's plus 1 ms of host time: ratios from them differ
        def times(t):
            return {kind: t + (1.0 if kind == "queued_ms" else 0.0) for kind in kinds}

        ms = {"cuflash": times(cuflash_ms), "torch-cudnn": times(cudnn_ms)}
        if paged_ms is not None:
            ms["cuflash paged 16"] = times(paged_ms)
        return {"dtype": "float16", "D": 128, "B": b, "Hq": 32, "Hkv": hkv, "Nk": 2**17, "Nq": nq,
                "bytes": 2 * b * hkv * 2**17 * 128 * 2, "ms": ms}

    # both Nq = 1 cells are large (1 x 8 x 128K keys = 2^20): 2^29 bytes in 0.05 ms = 10.7 TB/s, in
    # 0.2 ms = 2.7; 2^31 bytes in 1.0 ms = 2.1, in 0.4 ms = 5.4
    now = [row(1, 8, 1, 0.05, 0.2, paged_ms=0.1), row(1, 32, 1, 1.0, 0.4), row(1, 8, 4, 0.05, 0.5)]
    before = [row(1, 8, 1, 0.05, 0.05), row(1, 32, 1, 0.4, 0.4)]
    loops = [{"dtype": "float16", "D": 128, "B": 1, "Hq": 32, "Hkv": 8, "Nk": 4096, "steps": 256,
              "eager_ms": 9.0, "graph_ms": 3.5}]
    lines = run_against(script, tmp_path, {"rows": now, "loops": loops}, {"rows": before})
    assert lines[0] == "times: graph_ms"
    # cuflash / cuDNN: 4.0 and 0.4 at Nq = 1 (1.0 and 1.0 before), 10 at Nq = 4
    assert "| fp16 | 128 | 1 | 2 | 2.20 | 0.40 | 1 | 1 |" in lines
    assert "| fp16 | 128 | 4 | 1 | 10.00 | 10.00 | 1 | 1 |" in lines
    assert "Nq > 1, grouped: 1 cells, 10.00-10.00x cuDNN, 1 at 1.0 or more" in lines
    assert "Nq = 1 with B*Hkv*Nk >= 2^20: 2 cells; at 4.3 TB/s or more: cuflash 1, cuDNN 1" in lines
    assert "pages of 16: 1 cells, median 0.50 of contiguous, least 0.50, 0 at 0.9 or more" in lines
    assert any(line.startswith("loop of 256 steps") and "one CUDA graph 3.50 ms" in line for line in lines)
    assert lines[-1].endswith("0.40 / 2.20 / 4.00 (10th percentile / median / 90th)"), lines[-1]
    # a run timed only eagerly (before graph replays): its queued times, 1.2 / 1.05 = 1.14 at
    # Nq = 1, and 1.14 in the graph-timed run's queued times too; but a graph-timed run has no
    # graph time in common with it
    eager = [row(1, 8, 1, 0.05, 0.2, kinds=("queued_ms",))]
    lines = run_against(script, tmp_path, {"rows": eager}, {"rows": now})
    assert lines[0] == "times: queued_ms"
    assert "| fp16 | 128 | 1 | 1 | 1.14 | 1.14 | 1 | 1 |" in lines
    assert lines[-1].endswith("1.00 / 1.00 / 1.00 (10th percentile / median / 90th)"), lines[-1]
    lines = run_against(script, tmp_path, {"rows": now}, {"rows": eager})
    assert lines[-1].endswith("no Nq = 1 cell timed by graph_ms in both runs"), lines[-1]


def test_modifiers_lists_its_cases_without_gpu():
    """bench/modifiers.py --help and --list run anywhere: --list prints every case with its
    providers and planned skips (dropout: no FlexAttention) and the count of rows."""
    script = in_checkout("bench/modifiers.py")
    done = run_script(script, "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: modifiers.py "), done.stdout + done.stderr
    done = run_script(script, "--list", "--quick")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "grid bfloat16 (H 16, D 128, B 2, N 4096, causal)"
    assert any(line.startswith("  dropout0.1 (fwd, bwd): cuflash") and "flex (FlexAttention has no dropout)" in line
               for line in lines)
    assert "  bias-table-grad (bwd): cuflash" in [line.split(",")[0].split(";")[0] for line in lines]
    assert "gemma2-9b bfloat16 (Hq:Hkv 16:8, D 256, B 2, N 8192, causal, window (4095, 0))" in lines
    # 10 grid cases (two of them backward only) and 3 models x 2 cases, both directions
    assert lines[-1].startswith("4 shapes, 30 rows, ")
    done = run_script(script, "--list", "--no-models", "--no-flex")
    assert done.stdout.splitlines()[-1].startswith("32 shapes, 576 rows, 0 FlexAttention compilations")


def test_ring_attention_bench_lists_its_cases_without_gpu():
    """bench/ring_attention.py --list runs anywhere: weak scaling at 128K tokens per GPU, strong
    scaling at N 128K and 1M, on 2, 4 and 8 GPUs, and the single-GPU baselines."""
    script = in_checkout("bench/ring_attention.py")
    env = no_gpu_env()
    env.pop("WORLD_SIZE", None)
    done = run_script(script, "--list", "--no-torch", env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("ring attention: B 1, Hq 32, Hkv 8, D 128; bfloat16, float16; causal (zigzag), "
                        "full (contiguous); fwd, bwd")
    assert "  weak P 8 N 1048576 bfloat16 causal: ring, no sends, sends only" in lines
    assert "  strong P 2 N 131072 float16 full: ring, no sends, sends only" in lines
    assert "  single P 1 N 1048576 bfloat16 causal: cuflash.attention on one GPU" in lines
    # per dtype and mask: 3 counts x (1 weak + 2 strong) + 3 single N (128K, 1M... and 128K weak once)
    assert lines[-1] == "44 cases, 88 rows; one process per GPU for 2, 4, 8 GPUs"
    done = run_script(script, "--list", "--quick", "--no-torch", "--dtypes", "float16", "--masks", "causal",
                      "--gpus", "2", "--directions", "fwd", env=env)
    assert done.stdout.splitlines()[1:] == ["  weak P 2 N 32768 float16 causal: ring, no sends, sends only",
                                            "  strong P 2 N 32768 float16 causal: ring, no sends, sends only",
                                            "  single P 1 N 16384 float16 causal: cuflash.attention on one GPU",
                                            "  single P 1 N 32768 float16 causal: cuflash.attention on one GPU",
                                            "4 cases, 4 rows; one process per GPU for 2 GPUs"]


def test_ring_attention_example_runs_the_stand_in_on_the_cpu():
    """examples/ring_attention.py --cpu: every rank's rows within rounding of the reference."""
    script = in_checkout("examples/ring_attention.py")
    done = run_script(script, "--cpu", "--ranks", "3", "--n", "48")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1", "rank 2"]
    assert all(float(word.rstrip(",")) < 1e-12 for line in lines for word in line.split()[6::2]), lines


def test_modifiers_counts_slopes_and_window_flops(monkeypatch):
    """BLOOM's ALiBi slopes, the pairs a window leaves and the FLOPs of bench/modifiers.py's rows,
    and model_shapes' FLOPs and grouped views with Dv != D."""
    import numpy as np

    in_checkout("bench/modifiers.py")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import model_shapes
    import modifiers

    assert modifiers.bloom_alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    # 12 heads: the 8 of 8 heads, then every other slope of 16 heads' (transformers' build_alibi_tensor)
    assert modifiers.bloom_alibi_slopes(12).tolist()[8:] == pytest.approx([2.0 ** -(i / 2) for i in (1, 3, 5, 7)])
    slopes = modifiers.bloom_alibi_slopes(32)
    assert len(slopes) == 32 and slopes[0] == pytest.approx(2.0 ** -0.25) and slopes[-1] == pytest.approx(2.0 ** -8)
    for nq, nk, causal, window in ((7, 7, True, (2, 0)), (5, 9, True, (3, 0)), (6, 6, False, (1, 2)),
                                   (6, 8, False, (None, 1)), (8, 5, True, (100, 0))):
        brute = sum(1 for i in range(nq) for j in range(nk)
                    if (window[0] is None or j >= i + nk - nq - window[0])
                    and j <= i + nk - nq + (0 if causal else window[1]))
        assert modifiers.window_pairs(nq, nk, causal, window) == brute, (nq, nk, causal, window)
    gemma = modifiers.Shape("gemma2-9b", "bfloat16", 2, 16, 8, 8192, 256, True, (4095, 0))
    pairs = 4096 * 4097 // 2 + 4096 * 4096
    assert gemma.flops("fwd") == 4 * 2 * 16 * pairs * 256 and gemma.flops("bwd") == 2.5 * gemma.flops("fwd")
    grid = modifiers.Shape("grid", "float16", 2, 16, 16, 4096, 128, True)
    assert grid.flops("fwd") == 4 * 2 * 16 * 4096 * 4096 * 128 / 2
    assert model_shapes.flops(1, 128, 4096, 4096, 192, True, "fwd", dv=128) == 2 * 128 * 4096 * 4096 * 320 / 2
    assert model_shapes.flops(1, 8, 64, 64, 128, False, "bwd") == 2.5 * 4 * 8 * 64 * 64 * 128
    # GQA views with Dv != D: dout takes v's head dim
    sizes = ((1, 8, 16, 192), (1, 2, 16, 192), (1, 2, 16, 128), (1, 8, 16, 128))
    q, k, v, do = (np.zeros(s, dtype=np.float32) for s in sizes)
    assert [x.shape for x in model_shapes.grouped(q, k, v, do, 2)] == [(1, 2, 4, 16, 192), (1, 2, 1, 16, 192),
                                                                      (1, 2, 1, 16, 128), (1, 2, 4, 16, 128)]
    assert model_shapes.SHAPES["deepseek-v3 (D 192, Dv 128)"] == (1, 128, 128, 4096, 192, True, 128)


def test_modifiers_tables_from_saved_runs(tmp_path):
    """bench/modifiers.py --charts-from: the tables of saved rows, several files merged (a later
    file's row replaces an earlier one of the same cell); x plain against the cell's "none" row,
    x flex and x torch-sdpa against the row's own rivals; the skip reasons listed once each."""
    import json

    script = in_checkout("bench/modifiers.py")

    def row(mod, direction, tflops, skipped=None, **extra):
        return {"shape": "grid", "dtype": "bfloat16", "B": 2, "Hq": 16, "Hkv": 16, "N": 4096, "D": 128,
                "causal": True, "window": None, "modifier": mod, "direction": direction, "flops": 1.0,
                "tflops": tflops, "skipped": skipped or {}, **extra}

    first = [row("none", "fwd", {"cuflash": 400.0, "flex": 200.0}),
             row("softcap50", "fwd", {"cuflash": 100.0, "flex": 50.0})]
    second = [row("softcap50", "fwd", {"cuflash": 300.0, "flex": 150.0}),
              row("bias-table-grad", "bwd", {"torch-sdpa": 50.0}, {"cuflash": "not in this cuflash yet: TypeError: x"},
                  sdpa_backend="EFFICIENT_ATTENTION"),
              row("dropout0.1", "fwd", {"cuflash": 360.0, "torch-flash": 300.0},
                  {"flex": "FlexAttention has no dropout", "torch-cudnn": "RuntimeError: no kernel"})]
    (tmp_path / "a.json").write_text(json.dumps({"rows": first}))
    (tmp_path / "b.json").write_text(json.dumps({"rows": second}))
    done = run_script(script, "--out", str(tmp_path / "out"), "--no-charts", "--charts-from", str(tmp_path / "a.json"),
                      str(tmp_path / "b.json"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "| bfloat16 | 128 | True | 4096 | none | fwd | 400 |  | 200 |  |  |  |  | 2.00 |  |  |  |  |" in lines
    assert "| bfloat16 | 128 | True | 4096 | softcap50 | fwd | 300 | 400 | 150 |  |  |  | 0.75 | 2.00 |  |  |  |  |" \
        in lines
    assert "| bfloat16 | 128 | True | 4096 | dropout0.1 | fwd | 360 | 400 |  |  | 300 |  | 0.90 |  |  | 1.20 |  " \
           "| flex, torch-cudnn |" in lines
    assert "- cuflash, bias-table-grad: not in this cuflash yet: TypeError: x (1 rows)" in lines
    assert "- flex, dropout0.1: FlexAttention has no dropout (1 rows)" in lines
    assert "torch-sdpa picked EFFICIENT_ATTENTION for bias-table-grad bwd" in lines


def run_end_to_end(*args, timeout=120):
    return run_script(in_checkout("bench/end_to_end.py"), *args, timeout=timeout)


def test_end_to_end_lists_its_cases_without_gpu():
    """bench/end_to_end.py --help and --list run anywhere (without torch too): the model, and a
    row per (section, provider, N)."""
    done = run_end_to_end("--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: end_to_end.py "), done.stdout + done.stderr
    done = run_end_to_end("--list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("model: Llama, hidden 2048, 16 layers, 32 heads (8 key/value heads, GQA 4:1) of head dim 128, "
                        "MLP 5632, vocabulary 32000: 1,020,332,032 parameters, bfloat16, AdamW")
    assert "train: batch 1, N 2048 8192 32768: 2 warm-up and 5 timed steps each: 12 rows" in lines
    assert "  sdpa-flash, N 32768" in lines
    # host 1, train 4 x 3, longest 4, decode 4 x 3, loss 4
    assert lines[-1] == "33 rows"
    done = run_end_to_end("--list", "--quick", "--compile", "--sections", "train", "loss", "--providers", "cuflash",
                          "sdpa")
    lines = done.stdout.splitlines()
    assert "  cuflash compiled, N 8192" in lines and lines[-1] == "10 rows"


def test_end_to_end_tiny_run_on_cpu(tmp_path):
    """bench/end_to_end.py --device cpu --tiny: every section's plumbing on a 2-layer model
    (cuflash's reference on the CPU), the compiled providers through aot_eager, and SDPA's cuDNN
    backend, which has no CPU kernel, skipped with its reason rather than stopping the run."""
    import json

    pytest.importorskip("torch", reason="bench/end_to_end.py needs torch")
    pytest.importorskip("transformers", reason="bench/end_to_end.py needs transformers")
    done = run_end_to_end("--device", "cpu", "--tiny", "--out", str(tmp_path), "--no-charts", "--max-seqlen", "128",
                          "--providers", "cuflash", "sdpa", "sdpa-cudnn", "--compile", "--compile-backend",
                          "aot_eager", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["parameters"] == 86336   # as --list counts them
    rows = results["rows"]
    train = {r["provider"]: r for r in rows if r["section"] == "train"}
    assert set(train) == {"cuflash", "sdpa", "sdpa-cudnn", "cuflash compiled", "sdpa compiled", "sdpa-cudnn compiled"}
    for p in ("cuflash", "sdpa", "cuflash compiled", "sdpa compiled"):
        assert train[p]["tokens_per_s"] > 0 and train[p]["N"] == 64, train[p]
    assert "compile_s" in train["cuflash compiled"]
    assert train["sdpa-cudnn"]["skipped"].startswith("RuntimeError")
    longest = {r["provider"]: r for r in rows if r["section"] == "longest"}
    assert longest["cuflash"]["longest"] == 128 and longest["cuflash"]["stopped"].startswith("the cap")
    assert longest["sdpa-cudnn"]["longest"] is None and longest["sdpa-cudnn"]["stopped"] == "RuntimeError at N 64"
    decode = {r["provider"]: r for r in rows if r["section"] == "decode"}
    assert decode["cuflash"]["decode_tokens_per_s"] > 0 and decode["cuflash"]["steps"] == 4
    losses = {r["provider"]: r["losses"] for r in rows if r["section"] == "loss" and "losses" in r}
    assert set(losses) == {"cuflash", "sdpa"} and len(losses["cuflash"]) == 3
    # the same weights and data: the curves agree to bfloat16's rounding
    assert max(abs(a - b) / b for a, b in zip(losses["cuflash"], losses["sdpa"])) < 1e-2
    lines = done.stdout.splitlines()
    assert "| N | cuflash | sdpa | sdpa-cudnn | x sdpa | x sdpa-cudnn |" in lines
    assert "| N | cuflash compiled | sdpa compiled | sdpa-cudnn compiled | x sdpa compiled | x sdpa-cudnn compiled |" \
        in lines
    assert any(line.startswith("| cuflash / sdpa | ") for line in lines)
    assert "- host, all: host times need a GPU" in lines


def test_ab_trees_takes_the_median_over_processes_per_tree():
    """bench/ab_trees.py's table: per cell, each tree's median over its processes' ratios to
    cuDNN, and new / old; a cell only one tree timed is left out."""
    import importlib.util

    path = in_checkout("bench/ab_trees.py")
    spec = importlib.util.spec_from_file_location("ab_trees", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    a, b = ("float16", 64, 2048, True, "fwd"), ("bfloat16", 64, 4096, False, "fwd")
    rows = ab.summarize({"old": {a: [0.90, 0.80, 0.95], b: [1.0]}, "new": {a: [0.99, 1.00]}})
    assert len(rows) == 1
    cell, old, new, gain = rows[0]
    assert cell == a and old == 0.90 and new == 0.995 and abs(gain - 0.995 / 0.90) < 1e-12
    args = ab.parse_args(["old", "--head-dims", "64", "128", "--seqlens", "2048", "--causal", "1"])
    assert ab.cells(args) == [(dt, d, 2048, True, "fwd") for dt in ("float16", "bfloat16") for d in (64, 128)]


def test_device_check_refuses_an_unknown_step_before_running_any(tmp_path):
    """tools/device_check.sh checks every step name first: a typo costs no device time."""
    script = in_checkout("tools/device_check.sh")
    done = subprocess.run(["bash", str(script), str(tmp_path / "out"), "warm_cache", "gird"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no step named gird" in done.stderr
    assert not (tmp_path / "out" / "steps.txt").exists() and not (tmp_path / "out" / "warm_cache.txt").exists()


def test_device_check_packs_its_outputs_into_one_archive(tmp_path):
    """With PACK=1, tools/device_check.sh leaves OUTDIR.tar.gz with every step's log and the
    results, and only steps.txt in OUTDIR (the cli step runs without a GPU too)."""
    import tarfile

    script = in_checkout("tools/device_check.sh")
    out = tmp_path / "rec"
    env = dict(os.environ, PACK="1", PYTHON=sys.executable)
    done = subprocess.run(["bash", str(script), str(out), "cli"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["steps.txt"]
    assert "cli: exit 0" in (out / "steps.txt").read_text()
    with tarfile.open(tmp_path / "rec.tar.gz") as archive:
        names = archive.getnames()
        log = archive.extractfile("rec/cli.txt").read().decode()
    assert {"rec/steps.txt", "rec/cli.txt"} <= set(names)
    assert "problem: q, k, v of shape" in log   # printed by the GPU run and by the NumPy one
