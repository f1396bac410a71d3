"""The examples run, learn, checkpoint and resume (shortened runs, eager steps)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import funcamp

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytest.importorskip("sklearn")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_train_digits_short_run_and_resume(tmp_path: Path):
    """5 epochs of mixed_float16 (eager, ~5 s) reach >= 0.90 test accuracy (the full 20-epoch
    compiled run reaches ~0.97); resuming continues the same run."""
    digits = _load("train_digits")
    common = ["--quiet", "--no-compile", "--out", str(tmp_path)]
    acc = digits.main([*common, "--epochs", "5"])
    assert acc >= 0.90
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 5 and len(ckpt["history"]["loss"]) == 5 * 21
    assert ckpt["state"]["scaler"]["kind"] == "dynamic"
    assert (tmp_path / "digits.png").stat().st_size > 1000

    acc2 = digits.main([*common, "--epochs", "6", "--resume"])
    ckpt2 = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt2["epoch"] == 6 and len(ckpt2["history"]["loss"]) == 6 * 21
    assert int(ckpt2["state"]["opt_state"]["count"]) == 6 * 21 - int(
        ckpt2["state"]["scaler"]["skipped"]
    )
    assert acc2 >= 0.90


def test_train_digits_other_policies(tmp_path: Path):
    digits = _load("train_digits")
    for policy in ("bf16-true", "float32"):
        args = ["--quiet", "--no-compile", "--out", str(tmp_path), "--policy", policy]
        assert digits.main([*args, "--steps", "40"]) >= 0.80


def test_train_digits_bf16_params_match_float32(tmp_path: Path):
    """bfloat16 params with Kahan-compensated or stochastically rounded Adam updates reach the
    float32-params accuracy within 0.5 percentage points (5 epochs, eager: all three 0.9194; the
    full 20 epochs: 0.9723 for float32, master, kahan and sr, 0.9698 for plain rounding, seed 0;
    0.9748 and 0.9647 with seed 1)."""
    digits = _load("train_digits")
    common = ["--quiet", "--no-compile", "--out", str(tmp_path), "--epochs", "5"]
    reference = digits.main([*common, "--policy", "float32"])
    assert reference >= 0.90
    for update in ("kahan", "sr"):
        acc = digits.main([*common, "--policy", "bf16-true", "--update", update])
        assert acc >= reference - 0.005, (update, acc, reference)
    assert digits.parse_args([]).update == "kahan"  # the documented default


def test_train_digits_fp8_tracks_bf16(tmp_path: Path):
    """FP8 linears with delayed scaling, compiled (dynamo + AOT autograd, the aot_eager backend
    to keep the suite fast): >= 0.94 test accuracy in 10 epochs, and the per-epoch mean loss
    within 10 % of bf16's. (Full 20-epoch runs compiled with inductor, seed 0: bf16 0.9723,
    FP8 current 0.9698, FP8 delayed 0.9698; per-epoch mean loss within 3.6 % / 4.1 % of bf16.)"""
    digits = _load("train_digits")
    common = ["--quiet", "--policy", "bf16-mixed", "--backend", "aot_eager", "--epochs", "10"]
    reference = digits.main([*common, "--out", str(tmp_path / "bf16")])
    acc = digits.main([*common, "--fp8", "delayed", "--out", str(tmp_path / "fp8")])
    assert acc >= 0.94, (acc, reference)
    ckpt = torch.load(tmp_path / "fp8" / "checkpoint.pt", weights_only=True)
    assert sorted(ckpt["state"]["fp8"]["scale"]) == ["0", "2"]  # both linears, state saved
    fp8 = torch.tensor(ckpt["history"]["loss"]).view(10, -1).mean(1)
    bf16 = torch.load(tmp_path / "bf16" / "checkpoint.pt", weights_only=True)["history"]["loss"]
    bf16 = torch.tensor(bf16).view(10, -1).mean(1)
    assert not torch.equal(fp8, bf16)  # it did run in FP8
    assert ((fp8 - bf16).abs() / bf16).max() <= 0.10, (fp8, bf16)


def test_functional_loop():
    loop = _load("functional_loop")
    assert loop.main(steps=60) < 0.1


def test_public_names_exported():
    for name in ("TrainState", "make_train_step", "params_and_buffers"):
        assert name in funcamp.__all__ and hasattr(funcamp, name)
