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
    ("bench/bench_attention.py", ["--out", "{tmp}"]),
    ("bench/model_shapes.py", ["--out", "{tmp}"]),
    ("bench/decode.py", ["--out", "{tmp}"]),
    ("bench/float32_accuracy.py", []),
    ("bench/host_overhead.py", []),
    ("bench/profile_case.py", []),
    ("bench/tune_tiles.py", []),
    ("tools/warm_cache.py", []),
]


@pytest.mark.parametrize("script, args", SCRIPTS, ids=[s for s, _ in SCRIPTS])
def test_script_without_gpu_says_why_in_one_line(tmp_path, script, args):
    if not (ROOT / script).is_file():
        pytest.skip(f"{script} is not beside the tests (they run outside a source checkout)")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    # the cuflash under test, also for the examples, which import whichever cuflash is installed
    env["PYTHONPATH"] = os.pathsep.join([str(Path(cuflash.__file__).parent.parent), env.get("PYTHONPATH", "")])
    argv = [sys.executable, str(ROOT / script)] + [a.format(tmp=tmp_path) for a in args]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    lines = done.stderr.strip().splitlines()
    name = Path(script).name
    assert done.returncode == 1, f"{script} exited {done.returncode}: {done.stderr[-2000:]}"
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"{name}: cuflash's GPU functions need an NVIDIA GPU: "), lines[0]


def test_summarize_compares_two_runs(tmp_path):
    """bench/summarize.py on two small grids: the table, the cells below FA2, and --against
    (each provider against its own earlier cell; a cell one run lacks is left out)."""
    script = ROOT / "bench/summarize.py"
    if not script.is_file():
        pytest.skip("bench/summarize.py is not beside the tests (they run outside a source checkout)")
    import json

    def rows(cuflash_tflops, fa2=True):
        out = []
        for dtype in ("float16", "bfloat16"):
            for n, tflops in zip((512, 2048, 4096), cuflash_tflops):
                rivals = {"torch-flash": 100.0, "torch-cudnn": 200.0} if fa2 or n != 512 else {"torch-cudnn": 200.0}
                out.append({"dtype": dtype, "D": 64, "causal": True, "direction": "fwd", "N": n, "B": 1, "H": 1,
                            "tflops": {"cuflash": tflops, **rivals}})
        return out

    (tmp_path / "now.json").write_text(json.dumps({"rows": rows((90.0, 120.0, 130.0))}))
    (tmp_path / "before.json").write_text(json.dumps({"rows": rows((90.0, 100.0, 130.0), fa2=False)}))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "now.json"), "--against",
                           str(tmp_path / "before.json")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "| 64 | yes | fwd | 1.20–1.30 | 1.20–1.30 | 0.60–0.65 | 130 / 130 | 100 |" in lines
    assert "target cells (N >= 2048): 4 of 4 met" in lines
    assert any(line.startswith("below FA2 at N = 512: float16") for line in lines)
    # against the earlier run: cuflash 1.0, 1.2, 1.0 per dtype (median 1.00, least 1.00); FA2 1.0 where both have it
    assert "| 64 | yes | fwd | 1.00, 1.00 (float16 N = 512) | 1.00 |" in lines
