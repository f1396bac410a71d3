"""``benchmarks/optimizers.py`` with tiny settings: every optimizer's eager variants run, take
the same steps and pass the script's own check against torch.optim; a funcamp optimizer that
does different work fails it. (Its compiled pair is left to the script: minutes of compiles.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import funcamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import optimizers as bench


def _tiny(tmp_path: Path, *names: str) -> list[str]:
    return ["--d", "16", "--rounds", "2", "--iters", "1", "--warmup", "1", "--no-compiled",
            "--out", str(tmp_path / "optimizers.json"), "--only", *names]  # fmt: skip


def test_every_optimizer_runs_and_matches_torch(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(bench._machine, "check", lambda quiet: {"quiet": True})
    result = bench.main(_tiny(tmp_path, *bench.CASES))
    assert list(result["optimizers"]) == list(bench.CASES)
    for name, res in result["optimizers"].items():
        assert set(res["rows"]) == {"torch", "funcamp", "funcamp_donated"}, name
        for row in res["rows"].values():
            assert len(row["rounds_ms"]) == 2 and row["max_abs_diff_to_torch_eager"] < 1e-5
    muon = result["optimizers"]["muon"]
    assert muon["tensors"] == 10  # the 2-D matrices only, as torch.optim.Muon requires
    assert json.loads((tmp_path / "optimizers.json").read_text())["optimizers"].keys() == set(
        bench.CASES
    )
    assert "| adamw |" in capsys.readouterr().out


def test_different_work_fails_the_check(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(bench._machine, "check", lambda quiet: {"quiet": True})
    cls, kwargs, _ = bench.CASES["adamw"]
    monkeypatch.setitem(bench.CASES, "adamw", (cls, kwargs, lambda: funcamp.adamw(1.1e-3)))
    with pytest.raises(AssertionError, match=r"adamw: funcamp's .* differs from torch.optim's"):
        bench.main(_tiny(tmp_path, "adamw"))


def test_unknown_names_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--only", "adamw", "lamb"])
    assert "unknown ['lamb']" in capsys.readouterr().err
