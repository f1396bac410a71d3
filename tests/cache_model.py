"""A small model and loss for tests/test_step_cache.py, importable by its child processes
(an entry is valid only where the same source files define the step)."""

import torch
from torch.func import functional_call

#: read by ``loss_fn`` at trace time: a constant the compiled step is specialised on.
SCALE = 1.0


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def make_batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def make_loss(model: torch.nn.Module):
    def loss_fn(params, buffers, batch):
        x, y = batch
        out = functional_call(model, (params, buffers), (x,))
        return SCALE * torch.nn.functional.mse_loss(out, y)

    return loss_fn


class Doubled(torch.overrides.TorchFunctionMode):
    """Doubles every mse_loss: a torch function mode a compiled step must not ignore."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.nn.functional.mse_loss else out
