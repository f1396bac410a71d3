"""Gradient accumulation under a loss scaler is torch.amp's documented recipe (issue 51, item 8):

    for i, (x, g) in enumerate(micro_batches):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model, x, g) / K
        scaler.scale(loss).backward()
        if (i + 1) % K == 0:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            scaler.step(opt)      # skipped when any micro-batch overflowed
            scaler.update()       # once per optimizer step
            opt.zero_grad()

funcamp's step with ``accumulate(opt, every=K)`` averages the micro-batches' gradients instead
of dividing each loss by K: with a loss scale K times smaller (K a power of two) its scaled
gradients are torch's, bit for bit, and so are found-inf, the skips, the scale sequence (divided
by K), the accumulated gradient's norm and the params.
"""

from __future__ import annotations

import math

import pytest
import torch
from bitwise import same_bits
from exhaustive import exhaustive

import funcamp

N = 16
K = 4
LR = 1e-2
MAX_NORM = 50.0
INIT_SCALE = 2.0**16  # torch's; funcamp's is INIT_SCALE / K
GROWTH_INTERVAL = 3
QUICK = 14  # optimizer steps
LONG = 150


def _loss(w: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    h = w.half() * x.half()
    return (h * h * g.half()).float().sum()


def loss_fn(params, buffers, batch):
    return _loss(params["w"], *batch)


def micro_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``i``: gradients of every size (the scale grows until they overflow
    float16), and an injected inf or nan in one micro-batch of every 7th optimizer step."""
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(N, generator=gen)
    g = torch.randn(N, generator=gen) * 2.0 ** torch.randint(-4, 4, (N,), generator=gen)
    if (i // K) % 7 == 3 and i % K == (i // K) % K:
        g[i % N] = [math.inf, -math.inf, math.nan][i % 3]
    return x, g


def init_params() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(N, generator=torch.Generator().manual_seed(7))}


class Trace:
    """Per optimizer step: found-inf, the scale it was scaled with (torch's), the gradient
    norm clip_grad_norm_ returns, and the params after it."""

    def __init__(self) -> None:
        self.found: list[bool] = []
        self.scales: list[float] = []
        self.norms: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []


def torch_run(steps: int) -> Trace:
    w = init_params()["w"].requires_grad_()
    opt = torch.optim.AdamW([w], lr=LR, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    out = Trace()
    for i in range(steps * K):
        x, g = micro_batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(w, x, g) / K
        scaler.scale(loss).backward()
        if (i + 1) % K:
            continue
        out.scales.append(scaler.get_scale())
        scaler.unscale_(opt)
        out.norms.append(torch.nn.utils.clip_grad_norm_([w], MAX_NORM, foreach=True))
        out.found.append(not bool(w.grad.isfinite().all()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.params.append(w.detach().clone())
    return out


def optimizer() -> funcamp.Optimizer:
    clipped = funcamp.chain(funcamp.clip_by_global_norm(MAX_NORM), funcamp.adamw(LR, fused=True))
    return funcamp.accumulate(clipped, every=K)


def funcamp_run(step, steps: int) -> Trace:
    scaler = funcamp.ScalerState.dynamic(INIT_SCALE / K, growth_interval=GROWTH_INTERVAL)
    state = funcamp.TrainState.create(init_params(), optimizer(), "mixed_float16", scaler=scaler)
    out = Trace()
    for i in range(steps * K):
        before = float(state.scaler.scale)
        state, metrics = step(state, micro_batch(i))
        if (i + 1) % K:
            assert float(state.scaler.scale) == before  # no update within a window
            continue
        out.scales.append(before * K)
        out.found.append(bool(metrics["found_inf"]))
        out.norms.append(metrics["grad_norm"])
        out.params.append(state.params["w"].detach().clone())
    assert int(state.scaler.skipped) == sum(out.found)
    return out


@pytest.fixture(scope="module")
def steps():
    made = {}

    def get(backend: str):
        if backend not in made:
            if backend == "eager":
                made[backend] = funcamp.make_train_step(loss_fn, optimizer(), "mixed_float16",
                                                        compile=False)  # fmt: skip
            else:
                made[backend] = funcamp.make_train_step(loss_fn, optimizer(), "mixed_float16",
                                                        compile=funcamp.Compile(backend=backend),
                                                        )  # fmt: skip
        return made[backend]

    return get


def check(steps, backend: str, n: int) -> None:
    want = torch_run(n)
    got = funcamp_run(steps(backend), n)
    assert sum(want.found) >= 2 and not all(want.found)  # overflows and clean steps
    pairs = list(zip(want.scales, want.scales[1:]))
    assert any(b > a for a, b in pairs) and any(b < a for a, b in pairs)
    assert got.found == want.found
    assert got.scales == want.scales
    for i, (a, b) in enumerate(zip(got.params, want.params)):
        assert same_bits(a, b), f"{backend}: params differ after optimizer step {i}"
    for a, b, bad in zip(got.norms, want.norms, want.found):
        if bad:
            assert not bool(a.isfinite())
        elif backend == "eager":  # torch's _foreach_norm, as clip_grad_norm_'s
            assert same_bits(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_accumulation_is_gradscalers_recipe(steps, backend):
    check(steps, backend, QUICK)


@exhaustive
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_long_accumulation_run(steps, backend):
    check(steps, backend, LONG)


def test_a_clip_in_front_of_accumulate_is_refused():
    clip = funcamp.clip_by_global_norm(1.0)
    with pytest.raises(ValueError, match=r"accumulate\(chain\(clip_by_global_norm"):
        funcamp.chain(clip, funcamp.accumulate(funcamp.sgd(0.1), every=2))
    with pytest.raises(ValueError, match=r"transforms\[0\]"):  # a chain holding the clip
        funcamp.chain(funcamp.chain(clip), funcamp.accumulate(funcamp.sgd(0.1), 2))
    funcamp.accumulate(funcamp.chain(clip, funcamp.sgd(0.1)), every=2)  # the composition to use


@pytest.mark.parametrize("donate", [False, True])
def test_a_window_with_an_overflow_is_skipped_whole(donate):
    """unscale_and_step under accumulate: an inf in the window's second micro-batch reports
    found-inf from then on, skips the window's update on its last micro-step (the count a
    schedule sees stays 0) and starts a new window, which applies."""
    opt = funcamp.accumulate(funcamp.adamw(funcamp.linear_schedule(0.1, 0.0, 10)), every=3)
    params = {"w": torch.ones(2)}
    opt_state = opt.init(params)
    scaler = funcamp.ScalerState.dynamic(4.0)
    g = [[4.0, 8.0], [math.inf, 0.0], [4.0, 4.0], [4.0, 8.0], [8.0, 0.0], [4.0, 4.0]]
    found = []
    for i, grads in enumerate(g):
        new, opt_state, info = funcamp.unscale_and_step(
            scaler, opt, {"w": torch.tensor(grads)}, opt_state, params, donate_state=donate
        )
        found.append(bool(info.found_inf))
        if i < 5:
            assert torch.equal(new["w"], torch.ones(2)), i  # nothing applied yet
        if i == 2:  # the skipped window's end: a fresh window, the inner state untouched
            assert int(opt_state.micro_step) == 0 and not bool(opt_state.applies)
            assert not bool(opt_state.overflowed) and not opt_state.grad_sum["w"].any()
            assert int(opt_state.inner.count) == 0
            assert float(funcamp.optim.learning_rate(opt, opt_state)) == pytest.approx(0.1)
        params = new
    assert found == [False, True, True, False, False, False]
    assert int(opt_state.inner.count) == 1 and not torch.equal(params["w"], torch.ones(2))


def test_the_window_is_found_through_funcamps_combinators():
    """Whether an optimizer holds an accumulate is known when it is built: chain, masked and
    multi_transform pass it on; an optimizer without one is never searched."""
    from funcamp.optim._accumulate import accumulation_window

    params = {"w": torch.ones(2), "b": torch.ones(1)}
    acc = funcamp.accumulate(funcamp.sgd(0.1), every=2)
    for opt in (
        acc,
        funcamp.chain(funcamp.sgd(0.1), acc),
        funcamp.masked(acc, {"w": True, "b": False}),
        funcamp.multi_transform({"a": acc, "s": funcamp.sgd(0.1)}, {"w": "a", "b": "s"}),
    ):
        window = accumulation_window(opt, opt.init(params))
        assert window is not None and not bool(window.applies) and not bool(window.overflowed)
    plain = funcamp.chain(funcamp.clip_by_global_norm(1.0), funcamp.adam(0.1))
    assert accumulation_window(plain, plain.init(params)) is None
