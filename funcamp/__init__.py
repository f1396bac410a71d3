"""funcamp: JAX-style functional mixed precision for PyTorch.

Pure transforms and immutable state: an ``amp`` transform driven by an inspectable
``Policy``, a ``ScalerState`` threaded explicitly through pure ``scale`` / ``unscale`` /
``update`` functions, functional optimizers and a compiled, host-sync-free train step.
"""

from funcamp._optim import Optimizer, apply_updates, sgd
from funcamp._tree import all_finite, tree_cast, tree_select

__version__ = "0.1.0"

__all__ = [
    "Optimizer",
    "all_finite",
    "apply_updates",
    "sgd",
    "tree_cast",
    "tree_select",
]
