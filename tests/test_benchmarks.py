"""The benchmark tooling: benchmarks/memory.py's accounting and benchmarks/device_check.sh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory  # noqa: E402


def _events(*steps: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """Allocator events ``(time, size, live after, address)`` from ``(size, address)`` pairs."""
    out, live = [], 0
    for t, (size, ptr) in enumerate(steps):
        live += size
        out.append((t, size, live, ptr))
    return out


MARK = memory._MARK_BYTES


def test_tensor_numbers_splits_at_the_marker() -> None:
    events = _events(
        (100, 1),  # warm-up: a peak of 300 that the steady window must not see
        (200, 2),
        (-200, 2),
        (MARK, 9),
        (-MARK, 9),
        (50, 3),  # steady: 100 + 50 + 70 = 220 at most
        (70, 4),
        (-70, 4),
    )
    got = memory.tensor_numbers(events, live={1, 3})
    assert got == {"tensor_steady": 220, "tensor_end": 150, "untracked_frees": 0}


def test_tensor_numbers_takes_out_frees_the_profiler_missed() -> None:
    # address 1 (100 bytes) is never freed in the record and no live tensor holds it; address 2
    # (30 bytes) is given out again after the warm-up: both were freed unseen
    events = _events((100, 1), (30, 2), (5, 6), (MARK, 9), (-MARK, 9), (40, 2), (-40, 2))
    got = memory.tensor_numbers(events, live={6})
    assert got["untracked_frees"] == 130
    assert got["tensor_steady"] == 5 + 40  # the live 5, and the new 40 at address 2
    assert got["tensor_end"] == 5


def test_summary_and_linear_growth() -> None:
    mib = memory.MiB
    cells = {
        "gpt256": {
            "torch_eager": {"param_bytes": 4 * mib, "tensor_steady": 20 * mib},
            "funcamp": {"param_bytes": 4 * mib, "tensor_steady": 28 * mib},
        },
        "gpt512": {
            "torch_eager": {"param_bytes": 12 * mib, "tensor_steady": 60 * mib},
            "funcamp": {"param_bytes": 12 * mib, "tensor_steady": 84 * mib},
        },
    }
    summary = memory.summarize(cells)
    assert summary["gpt256"]["funcamp"]["tensor_steady"] == {"ratio": 1.4, "excess_P": 2.0}
    slopes = memory.linear_check(cells)
    # (60 - 20) MiB over (12 - 4) MiB / 4 bytes of params: 20 bytes per param; funcamp 28
    assert slopes["torch_eager"]["tensor_steady"] == 20.0
    assert slopes["funcamp"]["tensor_steady"] == 28.0


@pytest.mark.slow
def test_memory_benchmark_counts_torch_amp_state_exactly(tmp_path: Path) -> None:
    """End to end, two cells of the MLP: at the step boundary torch.amp's eager step holds its
    params, grads and two Adam moments (4 P) and the batch; funcamp's donated eager step holds
    params and moments (3 P) and the batch: the accounting is exact to the byte."""
    out = tmp_path / "memory.json"
    variants = "torch_eager,funcamp_eager_donated"
    cmd = [sys.executable, "benchmarks/memory.py", "--models", "mlp", "--steps", "3"]
    done = subprocess.run(
        [*cmd, "--variants", variants, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cells = json.loads(out.read_text())["cells"]["mlp"]
    torch_row, funcamp_row = cells["torch_eager"], cells["funcamp_eager_donated"]
    p = torch_row["param_bytes"]
    assert p == 4 * (3 * 512 * 512 + 3 * 512)
    batch = 2 * 256 * 512 * 4
    # + the scaler's and the optimizer's scalars: a few hundred bytes at most
    assert 0 <= torch_row["tensor_end"] - (4 * p + batch) < 1024
    assert 0 <= funcamp_row["tensor_end"] - (3 * p + batch) < 1024
    assert torch_row["tensor_steady"] > torch_row["tensor_end"]
    assert torch_row["rss_peak"] >= torch_row["rss_steady"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs everything")
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_check_without_a_gpu_fails_fast_and_says_why(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", "benchmarks/device_check.sh", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        # the script probes $PYTHON (default: `python` on PATH, which need not be this
        # interpreter, e.g. pytest run as venv/bin/python without activating the venv)
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert done.returncode == 2, done.stderr
    assert "device_check.sh: no CUDA device: torch.cuda.is_available() is False" in done.stderr
    report = (tmp_path / "out" / "device_report.md").read_text()
    assert "**Not run.**" in report and f"torch {torch.__version__}" in report
    assert not (tmp_path / "out" / "cuda_tests.log").exists()  # nothing else ran
