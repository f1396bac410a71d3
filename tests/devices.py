"""The device the parity suites run on, from the environment variable ``FUNCAMP_TEST_DEVICE``.

Unset or empty: ``"cpu"``. ``"cuda"``: the first GPU (the tests that ask for it skip, naming the
variable, when torch sees none). Anything else is an error naming the variable and its values.
``tests/conftest.py`` turns it into the ``test_device`` fixture; a module that picks its
parameters by device (torch's CPU or CUDA autocast lists) reads :func:`requested` when it is
collected.
"""

from __future__ import annotations

import os

import torch

ENV = "FUNCAMP_TEST_DEVICE"
CHOICES = ("cpu", "cuda")


def requested(environ: dict[str, str] | None = None) -> str:
    """The device type ``FUNCAMP_TEST_DEVICE`` asks for: ``"cpu"`` (also when it is unset or
    empty) or ``"cuda"``; a ``ValueError`` for any other value."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not value:
        return "cpu"
    if value not in CHOICES:
        raise ValueError(
            f"{ENV}={value!r} is not a test device: use 'cpu' or 'cuda' "
            f"(unset means 'cpu'), e.g. `{ENV}=cuda python -m pytest -m device_parity tests`"
        )
    return value


def unavailable(device_type: str) -> str | None:
    """Why the tests cannot run on ``device_type`` here (a skip reason), or None."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return (
            f"{ENV}=cuda, but torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}): the device parity tests need a GPU"
        )
    return None
