"""The train step written by hand with torch.func (the "by hand" loop of docs/index.md).

    python examples/functional_loop.py

``funcamp.make_train_step`` builds this same step (and compiles it); here every piece is in
view: the ``amp`` transform, scaling the loss, ``torch.func.grad``, ``unscale_and_step`` (which
skips a step whose gradients overflowed, leaving params bit-identical) and the scaler update.

One batch holds an inf, so its step is skipped. The run skips more steps than that: the dynamic
scaler starts at GradScaler's 2**16, where the first float16 backward overflows (skipped: the
scale backs off to 2**15), and every ``growth_interval`` (20 here) steps it tries a larger scale
again, which may overflow once more. That is the scaler finding its level, as GradScaler does;
the script prints which steps were skipped and why.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.func import functional_call

import funcamp


def main(steps: int = 60, seed: int = 0) -> float:
    """Fit a noisy linear map with a float16 MLP; return the final loss."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    policy = funcamp.get_policy("params=float32,compute=float16,output=float32")
    opt = funcamp.adamw(1e-2)
    opt_state = opt.init(params)
    scaler = funcamp.ScalerState.dynamic(init_scale=2.0**16, growth_interval=20)

    def loss_fn(p, batch):
        x, y = batch
        return nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    loss_fn = funcamp.amp(loss_fn, policy)  # per-op casting, output cast

    def step(params, opt_state, scaler, batch):
        def scaled(p):
            loss = loss_fn(p, batch)
            return funcamp.scale(scaler, loss), loss

        grads, loss = torch.func.grad(scaled, has_aux=True)(params)
        params, opt_state, info = funcamp.unscale_and_step(scaler, opt, grads, opt_state, params)
        scaler = funcamp.update(scaler, info.found_inf)  # skipped steps: params bit-identical
        return params, opt_state, scaler, loss, info.found_inf

    w = torch.randn(8, 1)
    losses, skipped = [], []
    bad = steps // 2
    for i in range(steps):
        x = torch.randn(64, 8)
        y = x @ w + 0.01 * torch.randn(64, 1)
        if i == bad:
            x[0, 0] = float("inf")  # one bad batch: the step is skipped, the scale backs off
        params, opt_state, scaler, loss, found_inf = step(params, opt_state, scaler, (x, y))
        losses.append(loss)
        skipped.append(found_inf)
    losses = torch.stack(losses)  # one host read for the whole loop
    where = torch.stack(skipped).nonzero().flatten().tolist()
    others = [i for i in where if i != bad]
    print(
        f"loss {losses[0].item():.4f} -> {losses[-1].item():.4f}; final scale "
        f"{float(scaler.scale):g}; skipped {int(scaler.skipped)} step(s) {where}: step {bad} "
        f"is the batch holding an inf"
        + (
            f"; {others} overflowed float16 while the scaler found its level (it starts at "
            f"2**16, backs off on overflow and tries a larger scale every "
            f"{scaler.growth_interval} steps)"
            if others
            else ""
        )
    )
    return losses[-1].item()


if __name__ == "__main__":
    main()
