"""python -m cuflash: every option documented, shaping the run it prints, on a GPU and without."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import requires_gpu

from cuflash import __main__ as cli
from cuflash import _gpu

NO_DRIVER = "no NVIDIA driver is installed (libcuda.so.1 could not be loaded)"


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(_gpu, "_problem", [NO_DRIVER])


def test_help_describes_every_option_with_its_default():
    done = subprocess.run([sys.executable, "-m", "cuflash", "--help"], capture_output=True, text=True, check=True)
    chunks = re.split(r"\n  (?=-)", done.stdout.split("options:", 1)[1])[1:]   # one per option
    helps = {chunk.split()[0].rstrip(","): " ".join(chunk.split()) for chunk in chunks}
    assert set(helps) == {"-h", "--batch", "--heads", "--seqlen", "--head-dim", "--dtype", "--causal", "--cpu"}
    for option, text in helps.items():
        assert option == "-h" or "(default: " in text, f"--help gives no default for {option}: {text}"
    assert "{float16,bfloat16,float32}" in helps["--dtype"]


def test_without_gpu_the_options_shape_the_numpy_run(no_gpu, capsys):
    assert cli.main(["--batch", "2", "--heads", "3", "--seqlen", "100", "--head-dim", "59",
                     "--dtype", "float32", "--causal"]) == 0
    out = capsys.readouterr().out
    assert f"no GPU run: {NO_DRIVER}" in out
    assert "q, k, v of shape (2, 3, 100, 59) (B, H, N, D), float32, causal" in out
    error = float(out.split("max |tiled - reference| = ")[1].split()[0])
    assert error < 1e-12


def test_without_gpu_the_defaults_are_small(no_gpu, capsys):
    cli.main([])
    assert "shape (1, 4, 512, 64) (B, H, N, D), float16, no mask" in capsys.readouterr().out


def test_bfloat16_without_gpu(no_gpu, capsys):
    pytest.importorskip("ml_dtypes")
    cli.main(["--dtype", "bfloat16", "--seqlen", "64"])
    assert "bfloat16" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seqlen", "8192"], "B*H*N^2 = 268,435,456 is over its limit"),
        (["--head-dim", "300"], "--head-dim must be between 1 and 256, got 300"),
        (["--batch", "0"], "--batch must be at least 1, got 0"),
        (["--dtype", "float64"], "invalid choice: 'float64'"),
    ],
)
def test_refused_options_say_why(no_gpu, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@requires_gpu
def test_gpu_run_prints_its_problem_check_and_times(capsys):
    cli.main(["--batch", "2", "--heads", "2", "--seqlen", "300", "--head-dim", "59", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert "problem: q, k, v of shape (2, 2, 300, 59) (B, H, N, D), bfloat16, no mask" in out
    error = float(out.split("query rows 0..299: ")[1].split()[0])
    assert error < 2e-2
    assert "faster than naive CuPy attention" in out


def test_default_naive_baseline_fits_a_16_gb_gpu():
    """The default problem's naive baseline (B=4, H=16, N=4096: 4 GiB per float32 score copy of
    the whole batch, several copies) runs one batch entry a call on a 16 GB GPU."""
    b, h, n = (cli.DEFAULTS[name][0] for name in ("batch", "heads", "seqlen"))
    free_16gb = 15 * 2**30   # what a 16 GB card has free beside the CUDA context
    assert cli._naive_chunk(b, h, n, free_16gb) == 1
    assert cli._naive_chunk(b, h, n, 140 * 2**30) == 4
    assert cli._naive_chunk(b, h, n, 6 * 2**30) == 0   # then it is skipped, saying why
