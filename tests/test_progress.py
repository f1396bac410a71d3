"""The first call of a compiled step says, by default, that it compiles and how long it took: once,
on stderr, as a plain line when nobody configured logging, through the user's handlers when
someone did; FUNCAMP_QUIET=1 or the "funcamp" logger's level silences it."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from funcamp._core import progress as _progress

ROOT = Path(__file__).resolve().parents[1]
COMPILING = "funcamp: compiling the train step (first call: up to minutes on a CPU"


@contextlib.contextmanager
def _unconfigured_logging():
    """Logging as in a plain script: pytest's own handlers taken off the root logger."""
    root = logging.getLogger()
    saved = root.handlers[:]
    for h in saved:
        root.removeHandler(h)
    try:
        yield
    finally:
        for h in saved:
            root.addHandler(h)


def _twice(capsys):
    step = _progress.announce_first_call(lambda x: x + 1)
    with _unconfigured_logging():
        assert step(1) == 2
        first = capsys.readouterr().err
        assert step(2) == 3
        second = capsys.readouterr().err
    return first.splitlines(), second


def test_the_first_call_says_it_compiles_once_on_stderr(capsys):
    first, second = _twice(capsys)
    assert len(first) == 2, first
    assert first[0].startswith(COMPILING) and "docs/benchmarks.md" in first[0]
    assert first[1].startswith("funcamp: compiled the train step in ") and first[1].endswith(" s")
    assert second == ""


def test_funcamp_quiet_silences_it_but_not_warnings(capsys, monkeypatch):
    monkeypatch.setenv("FUNCAMP_QUIET", "1")
    assert _twice(capsys) == ([], "")
    with _unconfigured_logging():
        _progress.logger.warning("funcamp: a warning")
    assert capsys.readouterr().err == "funcamp: a warning\n"
    monkeypatch.setenv("FUNCAMP_QUIET", "0")  # "0" is not quiet
    assert len(_twice(capsys)[0]) == 2


def test_the_logger_level_silences_it(capsys):
    level = _progress.logger.level
    _progress.logger.setLevel(logging.WARNING)
    try:
        assert _twice(capsys) == ([], "")
    finally:
        _progress.logger.setLevel(level)


def test_configured_logging_gets_it_in_its_own_format_and_nothing_else_prints(capsys):
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
    step = _progress.announce_first_call(lambda: None)
    with _unconfigured_logging():
        logging.getLogger().addHandler(handler)  # as logging.basicConfig(format=...) does
        try:
            step()
        finally:
            logging.getLogger().removeHandler(handler)
    assert capsys.readouterr().err == ""  # funcamp's own handler stayed silent: no duplicate
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"[funcamp INFO] {COMPILING}")


@pytest.mark.slow
def test_a_script_that_configures_nothing_sees_the_line_once(tmp_path):
    """The real default, in a fresh process: a compiled step's first call writes the two lines to
    stderr, its later calls nothing; stdout stays clean."""
    script = textwrap.dedent(
        """
        import torch, funcamp
        def loss_fn(params, buffers, batch):
            return ((params["w"] * batch) ** 2).sum()
        opt = funcamp.sgd(0.1)
        step = funcamp.make_train_step(
            loss_fn, opt, "float32", compile=funcamp.Compile(backend="eager"), donate_state=False
        )
        state = funcamp.TrainState.create({"w": torch.ones(2)}, opt, "float32")
        for _ in range(3):
            state, _ = step(state, torch.ones(2))
        print("done")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FUNCAMP_QUIET", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "done\n"
    lines = [line for line in done.stderr.splitlines() if line.startswith("funcamp:")]
    assert len(lines) == 2, done.stderr[-3000:]
    assert lines[0].startswith(COMPILING)
    assert lines[1].startswith("funcamp: compiled the train step in ")
