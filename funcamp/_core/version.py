"""funcamp's version, and torch's release.

The façade, checkpoints and the step cache read funcamp's version. Every version gate reads
torch's release (:mod:`funcamp.compiler.gate`, :func:`funcamp._core.context.constant_result`).
"""

import torch

__version__ = "0.1.0"


def torch_release() -> str:
    """This torch's release, ``"major.minor"`` (``"2.13"`` for ``2.13.0+cpu``)."""
    major, minor = torch.__version__.split(".")[:2]
    return f"{major}.{minor}"
