"""Probe 10 (dq_bulk_fragments.patch), run from the patched tree with CUFLASH_PROBE=10 in the
environment: the kernels compile with -DCUFLASH_PROBE=10, and the host reads the sums in the
accumulators' order. Modes: "check" and "speed" are v29's p54.py (agreement with the
deterministic gradients and repeatability; the backward's rate against the deterministic
default, cuDNN and FA2) after a check that the dq pass is gone; "san" a small case for
compute-sanitizer."""
import os
import runpy
import sys

assert os.environ.get("CUFLASH_PROBE") == "10"
from cuflash import _compile, _dispatch

base = _compile._common_options
_compile._common_options = lambda: base() + ("-DCUFLASH_PROBE=10",)
assert _dispatch.PROBE_FRAGMENTS
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import bench_attention as ba  # noqa: E402
import cuflash  # noqa: E402
from cuflash import _plans  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "speed"
shapes = [((1, 2, 2064, 64), True), ((2, 4, 2048, 64), False)] if mode == "san" else [((1, 8, 3008, 64), True)]
for shape, causal in shapes:
    q, k, v, do = ba.make_inputs(*shape, "float16", sets=1)[0]
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    grads = cuflash.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=False)
    plan, _ = _plans.backward(do, q, k, v, out, lse, causal, None, None, None, False)
    assert [r.threads for r in plan.launches.runs] == [128, 384], "the dq pass still runs"
if mode != "san":
    sys.argv = [sys.argv[0]] + sys.argv[1:]
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "../h200-2026-12-04-dq-probes/p54.py"),
                   run_name="__main__")
print("p59", mode, "done")
