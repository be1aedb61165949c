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
