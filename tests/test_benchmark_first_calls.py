"""The first-call rows of ``benchmarks/train_step.py`` (real models), with tiny settings: the
parent's rounds, interleaving, table and JSON on canned child results, and one child in this
process with ``backend="eager"`` (the real children compile for minutes)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import train_step

FIRST = {"funcamp": 60.0, "funcamp_cache": 70.0, "torch_model_opt": 40.0, "torch_model": 20.0}
WARM = {"funcamp": 15.0, "funcamp_cache": 3.0, "torch_model_opt": 6.0, "torch_model": 4.0}


def _canned(calls: list[tuple[str, str, Path]]) -> Any:
    def run(variant: str, model: str, directory: Path, args: Any) -> dict[str, Any]:
        warm = any(d == directory for *_, d in calls)  # the second process on a directory
        calls.append((variant, model, directory))
        first = (WARM if warm else FIRST)[variant]
        return {
            "first_s": first,
            "step_s": 1.0,
            "compile_s": first - 1.0,
            "phases_s": dict.fromkeys(train_step.PHASES, 0.5),
            "graphs": 0 if warm and variant == "funcamp_cache" else 1,
            "graph_breaks": 0,
            "loss": 4.6,
            "first_step_skipped": False,
        }

    return run


def test_first_call_rows_interleave_and_summarise(monkeypatch, tmp_path, capsys) -> None:
    calls: list[tuple[str, str, Path]] = []
    monkeypatch.setattr(train_step, "run_first_call", _canned(calls))
    monkeypatch.setattr(train_step._machine, "check", lambda quiet: {"quiet": True})
    # the header warm-up: one child before any first call (recorded, not run: ~15 s of compile)
    headers: list[tuple[list[str], int]] = []

    def child(cmd: list[str], **kw: Any) -> None:
        assert kw["env"]["TORCHINDUCTOR_CACHE_DIR"] != os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        headers.append((cmd, len(calls)))

    monkeypatch.setattr(train_step, "_HEADER_WARMED", [])
    monkeypatch.setattr(train_step.subprocess, "run", child)
    out = tmp_path / "bench.json"
    train_step.main(["--models", "gpt2,mixtral", "--cold-rounds", "2", "--out", str(out)])
    assert headers == [([sys.executable, "-c", train_step._WARM_HEADER], 0)]

    variants = list(FIRST)
    order = [v for v, m, _ in calls if m == "gpt2"]
    # cold then warm in one directory, variants in order, reversed in the second round
    assert order == [v for v in variants + variants[::-1] for _ in range(2)]
    assert len({d for *_, d in calls}) == 16  # a fresh directory per variant and round
    assert all(not d.exists() for *_, d in calls)  # removed afterwards
    result = json.loads(out.read_text())["models"]["gpt2"]
    assert result["kind"] == "first_call"
    assert len(result["runs"]["funcamp"]["cold"]) == len(result["runs"]["funcamp"]["warm"]) == 2
    summary = result["summary"]
    assert summary["cold funcamp / torch_model_opt"] == 60.0 / 40.0
    assert summary["cold funcamp / torch_model"] == 60.0 / 20.0
    assert summary["warm funcamp_cache / torch_model_opt"] == 3.0 / 6.0
    text = capsys.readouterr().out
    assert "| funcamp | 60.0 (60.0, 60.0) | 59.0 | 1.00 | 0.5 | 1 | 0 | 15.0 |" in text
    assert "funcamp_cache warm starts traced nothing: True" in text

    calls.clear()
    train_step.main(["--models", "bert", "--cold-rounds", "1", "--variants", "funcamp,torch_model",
                     "--no-warm", "--out", str(out)])  # fmt: skip
    assert [v for v, *_ in calls] == ["funcamp", "torch_model"]
    summary = json.loads(out.read_text())["models"]["bert"]["summary"]
    assert summary["cold funcamp / torch_model"] == 3.0
    assert math.isnan(summary["cold funcamp / torch_model_opt"])


def test_against_adds_the_revision_as_a_first_call_variant(monkeypatch, tmp_path) -> None:
    calls: list[tuple[str, str, Path]] = []
    canned = _canned(calls)

    def run(variant: str, model: str, directory: Path, args: Any) -> dict[str, Any]:
        result = canned(variant.partition("@")[0], model, directory, args)
        calls[-1] = (variant, model, directory)
        if variant == "funcamp@HEAD":  # the old revision: 1.5x this tree's first calls
            result["first_s"] *= 1.5
        return result

    monkeypatch.setattr(train_step, "run_first_call", run)
    monkeypatch.setattr(train_step, "warm_shared_header", lambda args: None)
    monkeypatch.setattr(train_step._machine, "check", lambda quiet: {"quiet": True})
    out = tmp_path / "bench.json"
    train_step.main(["--models", "gpt2", "--cold-rounds", "2", "--variants", "funcamp",
                     "--against", "HEAD", "--out", str(out)])  # fmt: skip
    order = [v for v, *_ in calls]
    # cold then warm in fresh directories, interleaved with this tree's, reversed every round
    assert order == ["funcamp"] * 2 + ["funcamp@HEAD"] * 4 + ["funcamp"] * 2
    summary = json.loads(out.read_text())["models"]["gpt2"]["summary"]
    assert summary["cold funcamp / funcamp@HEAD"] == pytest.approx(1 / 1.5)
    assert summary["warm funcamp / funcamp@HEAD"] == pytest.approx(1 / 1.5)


def test_bad_options_name_the_choices(capsys) -> None:
    for argv, said in (
        (["--models", "gpt3"], "real models are"),
        (["--models", "gpt2", "--variants", "funcamp,jax"], "choose from"),
        (["--models", "gpt2", "--against", "no-such-revision"], "not a git revision"),
    ):
        with pytest.raises(SystemExit):
            train_step.main(argv)
        assert said in capsys.readouterr().err


@pytest.mark.slow
def test_a_first_call_child_in_this_process(tmp_path, capsys) -> None:
    result = train_step.main([
        "--first-call-child", "torch_model_opt", "--model", "cnn", "--dir", str(tmp_path),
        "--backend", "eager",
    ])  # fmt: skip
    assert result["first_s"] > 0 and result["step_s"] > 0
    assert math.isfinite(result["loss"]) and result["first_step_skipped"] is False
    # the model's graph and the optimizer's, broken where torch.optim breaks on purpose
    assert result["graphs"] >= 2 and result["graph_breaks"] >= 1
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    assert json.loads(line[-1][len("RESULT ") :]) == result
