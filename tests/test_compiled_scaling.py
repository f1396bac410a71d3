"""The compiled step's loss scaling is eager code's: found-inf, skips, the scale sequence and the
params, bit for bit, against ``torch.autocast`` + ``torch.amp.GradScaler`` + ``torch.optim`` (and,
for ``16-true`` and ``bf16-true``, whose low-precision params torch.optim's fused AdamW updates
in another way and whose float16 gradients ``GradScaler`` refuses, against funcamp's eager step,
itself held to ``GradScaler`` above), on
the default compile options (issue 51, item 2).

The model is elementwise float16 arithmetic (no matmul: float16 matmuls are slow on the CPU, and
no reduction feeds a gradient: eager and inductor sum in other orders). By default inductor keeps
a fused float16 product in float32, so a gradient that overflows float16 in eager code stays
finite in the compiled step; funcamp compiles a low-precision step with
``emulate_precision_casts=True`` (``funcamp.train.compiling.EAGER_CASTS_OPTIONS``).
"""

from __future__ import annotations

import math

import pytest
import torch
from bitwise import same_bits
from exhaustive import exhaustive

import funcamp

N = 16
LR = 1e-2
GROWTH_INTERVAL = 4
QUICK = 40
LONG = 600
BACKENDS = ("eager", "aot_eager", "inductor")  # "eager": compile=False


def _loss(w: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # every op a float16 op of its own: eager rounds each result to float16
    h = w.half() * x.half()
    return (h * h * g.half()).float().sum()


def loss_fn(params, buffers, batch):
    return _loss(params["w"], *batch)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i``'s batch: gradients of every size (the scale grows every GROWTH_INTERVAL clean
    steps until they overflow float16), and an injected inf or nan every 23rd step."""
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(N, generator=gen)
    g = torch.randn(N, generator=gen) * 2.0 ** torch.randint(-4, 9, (N,), generator=gen)
    if i % 23 == 11:
        g[i % N] = [math.inf, -math.inf, math.nan][i % 3]
    return x, g


def init_params() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(N, generator=torch.Generator().manual_seed(123)) * 4}


class Run:
    """A run's trace: found-inf and scale before each step, params after."""

    def __init__(self) -> None:
        self.found: list[bool] = []
        self.scales: list[float] = []
        self.params: list[torch.Tensor] = []

    def check_equal(self, other: Run, what: str) -> None:
        assert self.found == other.found, what
        assert self.scales == other.scales, what
        for i, (a, b) in enumerate(zip(self.params, other.params)):
            assert same_bits(a, b), f"{what}: params differ after step {i}"
        assert len(self.params) == len(other.params)


def torch_run(policy: str, steps: int) -> Run:
    """autocast + GradScaler + fused AdamW (mixed float16); autocast + fused AdamW skipping a
    non-finite step (bfloat16, whose funcamp scaler is ``noop``)."""
    dtype = torch.float16 if "16" in policy and "bf" not in policy else torch.bfloat16
    w = init_params()["w"].requires_grad_()
    opt = torch.optim.AdamW([w], lr=LR, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    run = Run()
    for i in range(steps):
        x, g = batch(i)
        with torch.autocast("cpu", dtype=dtype):
            loss = _loss(w, x, g) if dtype == torch.float16 else _loss_bf16(w, x, g)
        if dtype == torch.float16:
            run.scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            found = not bool(w.grad.isfinite().all())
            scaler.step(opt)
            scaler.update()
        else:
            run.scales.append(1.0)
            loss.backward()
            found = not bool(w.grad.isfinite().all())
            if not found:
                opt.step()
        run.found.append(found)
        opt.zero_grad()
        run.params.append(w.detach().clone())
    return run


def _loss_bf16(w: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    h = w.bfloat16() * x.bfloat16()
    return (h * h * g.bfloat16()).float().sum()


def bf16_loss_fn(params, buffers, batch):
    return _loss_bf16(params["w"], *batch)


POLICIES = {
    "mixed_float16": (loss_fn, funcamp.ScalerState.dynamic),
    "16-true": (loss_fn, funcamp.ScalerState.dynamic),
    "bf16-mixed": (bf16_loss_fn, None),
    "bf16-true": (bf16_loss_fn, None),
}


def optimizer(policy: str) -> funcamp.Optimizer:
    """torch's fused AdamW kernel on float32 params; funcamp's own on low-precision ones."""
    return funcamp.adamw(LR, fused=not policy.endswith("-true"))


def make_state(policy: str) -> funcamp.TrainState:
    _, scaler = POLICIES[policy]
    opt = optimizer(policy)
    kw = {}
    if scaler is not None:
        kw["scaler"] = scaler(init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    return funcamp.TrainState.create(init_params(), opt, policy, **kw)


@pytest.fixture(scope="module")
def steps():
    """One step per (policy, backend), built once: the compiled steps are shared."""
    made: dict[tuple[str, str], object] = {}

    def get(policy: str, backend: str):
        if (policy, backend) not in made:
            fn, _ = POLICIES[policy]
            opt = optimizer(policy)
            if backend == "eager":
                made[policy, backend] = funcamp.make_train_step(fn, opt, policy, compile=False)
            else:
                made[policy, backend] = funcamp.make_train_step(
                    fn, opt, policy, compile=funcamp.Compile(backend=backend)
                )
        return made[policy, backend]

    return get


def funcamp_run(step, policy: str, steps: int) -> Run:
    state = make_state(policy)
    run = Run()
    for i in range(steps):
        run.scales.append(float(state.scaler.scale))
        state, metrics = step(state, batch(i))
        run.found.append(bool(metrics["found_inf"]))
        assert float(metrics["scale"]) == run.scales[-1]
        run.params.append(state.params["w"].detach().clone())
    assert int(state.scaler.skipped) == sum(run.found)
    return run


def _check(steps, policy: str, backends: tuple[str, ...], n: int) -> None:
    if policy.endswith("-true"):  # low-precision params (GradScaler refuses float16 grads)
        reference = funcamp_run(steps(policy, "eager"), policy, n)
        backends = tuple(b for b in backends if b != "eager")
    else:
        reference = torch_run(policy, n)
    skips = sum(reference.found)
    assert skips >= n // 23, "the run must skip steps: injected and overflowed"
    if "bf16" not in policy:  # the scale grew and backed off, again and again
        pairs = list(zip(reference.scales, reference.scales[1:]))
        assert sum(b > a for a, b in pairs) >= 3 and sum(b < a for a, b in pairs) >= 3
    for backend in backends:
        funcamp_run(steps(policy, backend), policy, n).check_equal(reference, f"{policy} {backend}")


@pytest.mark.parametrize("policy", ["mixed_float16"])
def test_compiled_float16_scaling_is_gradscalers(steps, policy):
    """A short run on each backend: the inductor step skips the steps whose float16 gradients
    overflow in eager code (without funcamp's default of ``emulate_precision_casts=True`` it
    applies some of them and keeps a scale GradScaler halves)."""
    _check(steps, policy, BACKENDS, QUICK)


@exhaustive
@pytest.mark.slow
@pytest.mark.parametrize("policy", list(POLICIES))
def test_long_run_of_every_low_precision_policy(steps, policy):
    _check(steps, policy, BACKENDS, LONG)


def test_the_callers_setting_wins():
    """``options={"emulate_precision_casts": False}`` is inductor's default numerics again: the
    step misses the overflow that eager code and GradScaler catch (issue 51's example)."""
    w = {"w": torch.full((4,), 3000.0)}
    g = torch.full((4,), 20.0)

    def overflow(p, b, g):  # 3000 * 20 fits float16; the gradient 20 * 4096 does not
        return (p["w"].half() * g.half()).float().sum()

    found = {}
    for name, options in [("default", {}), ("off", {"emulate_precision_casts": False})]:
        state = funcamp.TrainState.create(
            w, funcamp.sgd(0.1), "mixed_float16", scaler=funcamp.ScalerState.dynamic(4096.0)
        )
        step = funcamp.make_train_step(
            overflow, funcamp.sgd(0.1), "mixed_float16", compile=funcamp.Compile(options=options)
        )
        state, metrics = step(state, g)
        found[name] = (bool(metrics["found_inf"]), float(state.scaler.scale))
    assert found == {"default": (True, 2048.0), "off": (False, 4096.0)}
