"""Where a compile failure happened: ``user_frame`` names the user's innermost frame, never one of
funcamp's own (anywhere in the package: casting, policy, _core, not only funcamp/train)."""

from __future__ import annotations

import os
import traceback

import pytest
import torch

import funcamp
from funcamp.train.errors import user_frame

PACKAGE = os.path.dirname(os.path.abspath(funcamp.__file__))
USER = os.path.abspath(__file__)


def _frames(*files: str) -> list[traceback.FrameSummary]:
    return [traceback.FrameSummary(f, 10 + i, f"f{i}", line=f"x{i}") for i, f in enumerate(files)]


@pytest.mark.parametrize(
    "inner",
    [
        os.path.join(PACKAGE, "casting", "amp.py"),
        os.path.join(PACKAGE, "_core", "tree.py"),
        os.path.join(PACKAGE, "train", "loss.py"),
        os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py"),
    ],
)
def test_funcamps_own_frames_are_not_the_users(inner):
    error = RuntimeError("boom")
    error.real_stack = _frames(USER, inner)  # type: ignore[attr-defined]
    assert user_frame(error) == f'File "{USER}", line 10, in f0: `x0`'
    text = (
        "boom\n\nfrom user code:\n"
        f'   File "{USER}", line 10, in f0\n    x0\n'
        f'   File "{inner}", line 11, in f1\n    x1\n'
    )
    assert user_frame(RuntimeError(text)) == f'File "{USER}", line 10, in f0: `x0`'


def test_an_installed_librarys_model_counts_as_the_users_code():
    installed = os.path.join(os.path.dirname(os.__file__), "site-packages", "transformers", "m.py")
    error = RuntimeError("boom")
    error.real_stack = _frames(USER, installed)  # type: ignore[attr-defined]
    assert user_frame(error).startswith(f'File "{installed}", line 11')
    stdlib = os.path.join(os.path.dirname(os.__file__), "functools.py")
    error.real_stack = _frames(USER, stdlib)  # type: ignore[attr-defined]
    assert user_frame(error).startswith(f'File "{USER}"')


def test_a_sibling_directory_named_like_the_package_is_the_users():
    sibling = PACKAGE + "_examples" + os.sep + "model.py"
    error = RuntimeError("boom")
    error.real_stack = _frames(USER, sibling)  # type: ignore[attr-defined]
    assert user_frame(error).startswith(f'File "{sibling}", line 11')
