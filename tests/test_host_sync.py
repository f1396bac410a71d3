"""No host sync on the step path: nothing reads a tensor's value back to Python, but the skip flag
of a CPU eager step.

Every way torch has of turning a tensor into a Python value (``item``, ``bool``, ``int``,
``float``, ``tolist``, ``numpy``, ``__index__``) is patched to raise while steps run, eager and
compiled (after the compile: dynamo itself may read constants while tracing). On CUDA such a read
waits for the device and breaks CUDA graphs, so a CUDA step reads nothing. A CPU eager step reads
one value, once: whether it is skipped (``funcamp.scaling.skip.Skip.decided``), which the CPU
holds already, as ``GradScaler.step`` reads it. ``funcamp.scaling.skip.device_path()`` runs the
CUDA step's path on the CPU, where it must read nothing at all.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch

import funcamp
from funcamp.scaling.skip import device_path

_READS = ("item", "__bool__", "__int__", "__float__", "tolist", "numpy", "__index__")


_SKIP_FLAG = "skip flag"


@contextlib.contextmanager
def no_host_reads() -> Iterator[list[str]]:
    """Record every read; refuse all but the skip flag's, which is let through and recorded
    as ``"skip flag"`` (a 0-d bool read by ``Skip.decided``)."""
    seen: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def refuse(name: str):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if (
                name == "__bool__"
                and caller.f_code.co_name == "decided"
                and caller.f_code.co_filename.endswith(os.path.join("scaling", "skip.py"))
                and self.dtype == torch.bool
                and self.dim() == 0
            ):
                seen.append(_SKIP_FLAG)
                return saved["__bool__"](self)
            seen.append(name)
            raise AssertionError(f"host read: Tensor.{name} on the step path")

        return read

    for name in _READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def test_the_guard_catches_a_read() -> None:
    x = torch.ones(())
    with no_host_reads() as seen, pytest.raises(AssertionError, match="host read"):
        bool(x > 0)
    assert seen == ["__bool__"]
    assert bool(x > 0)  # restored


def _problem(opt_name: str):
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 8, generator=g), "b": torch.zeros(8)}
    batch = (torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))

    def loss_fn(p, buffers, b):
        x, y = b
        return torch.nn.functional.mse_loss(x @ p["w"] + p["b"], y)

    opt = {"sgd": funcamp.sgd(0.1, momentum=0.9), "adamw": funcamp.adamw(1e-3)}[opt_name]
    return params, batch, loss_fn, opt


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("donate", [False, True])
def test_eager_step_reads_only_its_skip_flag(
    opt_name: str, policy: str, donate: bool, path: str
) -> None:
    params, batch, loss_fn, opt = _problem(opt_name)
    scaler = funcamp.ScalerState.dynamic()  # the full skip/grow machinery, every policy
    state = funcamp.TrainState.create(params, opt, policy, scaler=scaler)
    step = funcamp.make_train_step(loss_fn, opt, policy, compile=False, donate_state=donate)
    inf_batch = (batch[0].clone().fill_(float("inf")), batch[1])
    flags = []
    where = device_path() if path == "device" else contextlib.nullcontext()
    with where, no_host_reads() as seen:
        for b in (batch, inf_batch, batch):  # a skipped step in the middle
            state, metrics = step(state, b)
            flags.append(metrics["found_inf"])
    assert seen == ([] if path == "device" else [_SKIP_FLAG] * 3)
    assert flags[1].item()  # really skipped (float16 may overflow at the first scale too)


@pytest.mark.parametrize("path", ["cpu", "device"])
def test_unscale_and_step_reads_only_its_skip_flag(path: str) -> None:
    params, _, _, _ = _problem("sgd")
    opt = funcamp.adam(1e-3)
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    opt_state = opt.init(params)
    scaler = funcamp.ScalerState.dynamic()
    where = device_path() if path == "device" else contextlib.nullcontext()
    with where, no_host_reads() as seen:
        for donate in (False, True):
            g = {k: v.clone() for k, v in grads.items()} if donate else grads
            funcamp.unscale_and_step(scaler, opt, g, opt_state, params, donate_grads=donate)
    assert seen == ([] if path == "device" else [_SKIP_FLAG] * 2)


def test_compiled_step_reads_nothing_back() -> None:
    params, batch, loss_fn, opt = _problem("adamw")
    policy = "mixed_bfloat16"
    state = funcamp.TrainState.create(params, opt, policy, scaler=funcamp.ScalerState.dynamic())
    step = funcamp.make_train_step(
        loss_fn, opt, policy, compile=funcamp.Compile(backend="aot_eager"), donate_state=False
    )
    state, _ = step(state, batch)  # compiles (dynamo may read constants while tracing)
    with no_host_reads() as seen:
        for _ in range(2):
            state, _ = step(state, batch)
    assert seen == []
