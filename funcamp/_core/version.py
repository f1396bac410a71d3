"""funcamp's version (read by the façade, checkpoints and the step cache), and torch's release
(read by every version gate: :mod:`funcamp.compiler.gate`, :func:`funcamp._core.context.constant_result`)."""

import torch

__version__ = "0.1.0"


def torch_release() -> str:
    """This torch's release, ``"major.minor"`` (``"2.13"`` for ``2.13.0+cpu``)."""
    major, minor = torch.__version__.split(".")[:2]
    return f"{major}.{minor}"
