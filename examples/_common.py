"""Setup the examples share: the digits data, joining a torchrun group, a policy's file name.

Imported by the examples next to it (``python examples/<name>.py`` puts this folder on the path).
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist

import funcamp

#: The presets under their canonical names (one spelling per policy in file names).
CANONICAL = ("mixed_float16", "mixed_bfloat16", "bf16-true", "float32")


def load_digits(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """scikit-learn's digits as float32 tensors in [0, 1], split into 1400 train / 397 test
    images: ``(x_train, y_train, x_test, y_test)``."""
    from sklearn.datasets import load_digits as digits  # the `examples` extra
    from sklearn.model_selection import train_test_split

    x, y = digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x / 16.0, y, test_size=397, random_state=seed, stratify=y
    )
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun group (nccl on GPUs, gloo on CPU); a lone process makes its own.
    Returns ``(rank, world size, device)``."""
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def policy_name(policy: funcamp.Policy) -> str:
    """Its preset's canonical name, else its string made file-safe."""
    for name in CANONICAL:
        if funcamp.get_policy(name) == policy:
            return name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(policy))
