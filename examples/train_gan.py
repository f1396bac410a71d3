"""Two models, two losses, two optimizers, one loss scaler: a DCGAN-shaped GAN in float16.

    python examples/train_gan.py            # funcamp's recipe
    python examples/train_gan.py --check    # and torch's, compared bit for bit

torch's amp docs ("Working with Multiple Models, Losses, and Optimizers") run such a loop with
one ``GradScaler``: every loss is scaled by it, ``scaler.step(opt)`` skips each optimizer on
its own gradients' overflow, and ``scaler.update()`` runs once an iteration, backing off if any
optimizer overflowed. Here is PyTorch's ``dcgan`` example under that recipe, written with
funcamp's pieces (``gan_step``), and torch's own loop beside it (``run_torch``):

* Each optimizer steps with ``funcamp.unscale_and_step`` under the iteration's one scaler. It
  skips on its own ``found_inf``. The scaler moves once, on both flags:
  ``funcamp.update(scaler, d_info.found_inf | g_info.found_inf)``.
* The generator's loss sees the discriminator as it is after its step, as in torch.
* BatchNorm's running statistics move as torch's do, on skipped steps too. The
  discriminator's see its three forwards (real, fake, and fake again for the generator's
  loss). The generator's see one. The generator's loss runs the generator again, on a copy of
  its buffers that is then dropped. In training mode BatchNorm normalises with the batch's
  statistics, so that second forward gives the first one's images bit for bit.
* ``errD_real + errD_fake`` is differentiated in one call. The two forwards share no
  intermediate, so each discriminator parameter gets one gradient from each. Their sum is the
  one addition torch's two ``backward()`` calls make in ``.grad``.

The data is fake (squares on a dark background) and the models are small (8x8 images): float16
convolutions have no fast CPU kernels. An inf in one real batch (``--inf-at``) skips the
discriminator's step alone and backs the scale off once. As in torch, BatchNorm's running
statistics see every forward, skipped or not, so that batch leaves the discriminator's NaN on
both sides. The other skips are the scaler finding its level, as GradScaler does: it grows
every ``growth_interval`` clean iterations, and at 2**16 the float16 gradients soon overflow.
"""

from __future__ import annotations

import argparse
import copy
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

import funcamp

NZ, NF, SIZE = 8, 8, 8  # noise channels, feature maps, image side
#: ``torch.autocast("cpu", dtype=torch.float16)``'s casts, as a policy.
POLICY = "params=float32,compute=float16,output=float32,ops=autocast_cpu"
#: One scaler for both models (GradScaler's arguments).
SCALER = {"init_scale": 2.0**16, "growth_interval": 4}
ADAM = {"lr": 2e-4, "betas": (0.5, 0.999)}  # dcgan's


def _init(m: nn.Module) -> None:  # dcgan's weights_init
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


def make_models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """``(generator, discriminator)``: dcgan's layers, shrunk to 8x8 one-channel images."""
    torch.manual_seed(seed)
    generator = nn.Sequential(
        nn.ConvTranspose2d(NZ, 2 * NF, 4, 1, 0, bias=False),  # 1x1 -> 4x4
        nn.BatchNorm2d(2 * NF),
        nn.ReLU(True),
        nn.ConvTranspose2d(2 * NF, 1, 4, 2, 1, bias=False),  # -> 8x8
        nn.Tanh(),
    )
    discriminator = nn.Sequential(
        nn.Conv2d(1, NF, 4, 2, 1, bias=False),  # 8x8 -> 4x4
        nn.LeakyReLU(0.2, True),
        nn.Conv2d(NF, 2 * NF, 4, 2, 1, bias=False),  # -> 2x2
        nn.BatchNorm2d(2 * NF),
        nn.LeakyReLU(0.2, True),
        nn.Conv2d(2 * NF, 1, 2, 1, 0, bias=False),  # -> 1x1: a logit
        nn.Flatten(0),
    )
    generator.apply(_init)
    discriminator.apply(_init)
    return generator, discriminator


def make_batches(
    steps: int, batch: int = 8, seed: int = 0, inf_at: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` pairs ``(real images, noise)``; a real image is a bright 4x4 square on a dark
    background. With ``inf_at``, one pixel of that iteration's real batch is inf."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(steps):
        real = torch.full((batch, 1, SIZE, SIZE), -1.0)
        corners = torch.randint(0, SIZE - 3, (batch, 2), generator=g).tolist()
        for b, (r, c) in enumerate(corners):
            real[b, 0, r : r + 4, c : c + 4] = 1.0
        if i == inf_at:
            real[0, 0, 0, 0] = float("inf")
        batches.append((real, torch.randn(batch, NZ, 1, 1, generator=g)))
    return batches


class Net(NamedTuple):
    """One model's part of the state."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt_state: Any


class GanState(NamedTuple):
    """Both models and the one scaler they share."""

    g: Net
    d: Net
    scaler: funcamp.ScalerState


def _copy(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in buffers.items()}


def init_state(
    generator: nn.Module,
    discriminator: nn.Module,
    opt_g: funcamp.Optimizer,
    opt_d: funcamp.Optimizer,
) -> GanState:
    """Copies of both models' params and buffers, their optimizer states, and one scaler."""

    def net(module: nn.Module, opt: funcamp.Optimizer) -> Net:
        params, buffers = funcamp.params_and_buffers(module)
        params = _copy(params)
        return Net(params, _copy(buffers), opt.init(params))

    scaler = funcamp.ScalerState.dynamic(**SCALER)
    return GanState(net(generator, opt_g), net(discriminator, opt_d), scaler)


def gan_step(
    generator: nn.Module,
    discriminator: nn.Module,
    opt_g: funcamp.Optimizer,
    opt_d: funcamp.Optimizer,
):
    """``step(state, real, noise) -> (state, metrics)``: one dcgan iteration under ``POLICY``."""
    bce = F.binary_cross_entropy_with_logits  # autocast-safe, unlike Sigmoid + BCELoss

    def generate(g_params, g_buffers, noise):
        return functional_call(generator, (g_params, g_buffers), (noise,))

    def d_loss(d_params, d_buffers, real, fake):  # dcgan's errD = errD_real + errD_fake
        real_logits = functional_call(discriminator, (d_params, d_buffers), (real,))
        fake_logits = functional_call(discriminator, (d_params, d_buffers), (fake,))
        return bce(real_logits, torch.ones_like(real_logits)) + bce(
            fake_logits, torch.zeros_like(fake_logits)
        )

    def g_loss(g_params, g_buffers, d_params, d_buffers, noise):  # dcgan's errG
        fake = generate(g_params, g_buffers, noise)
        logits = functional_call(discriminator, (d_params, d_buffers), (fake,))
        return bce(logits, torch.ones_like(logits))

    amp_generate = funcamp.amp(generate, POLICY)
    d_loss, g_loss = funcamp.amp(d_loss, POLICY), funcamp.amp(g_loss, POLICY)

    def step(state: GanState, real: torch.Tensor, noise: torch.Tensor):
        g, d, scaler = state
        g_buffers, d_buffers = _copy(g.buffers), _copy(d.buffers)  # BatchNorm writes these
        fake = amp_generate(g.params, g_buffers, noise)
        # (1) the discriminator: real and fake, one scaled loss; it skips on its own flag
        grads, loss_d = funcamp.scaled_grad_and_value(d_loss, scaler)(
            d.params, d_buffers, real, fake
        )
        d_params, d_opt, d_info = funcamp.unscale_and_step(
            scaler, opt_d, grads, d.opt_state, d.params
        )
        # (2) the generator, against the discriminator just stepped; the same scaler. Its
        # second forward runs on a copy of its old buffers, and that copy is dropped.
        grads, loss_g = funcamp.scaled_grad_and_value(g_loss, scaler)(
            g.params, _copy(g.buffers), d_params, d_buffers, noise
        )
        g_params, g_opt, g_info = funcamp.unscale_and_step(
            scaler, opt_g, grads, g.opt_state, g.params
        )
        # (3) one update: backs off if either model overflowed (GradScaler.update's rule)
        scaler = funcamp.update(scaler, d_info.found_inf | g_info.found_inf)
        new = GanState(Net(g_params, g_buffers, g_opt), Net(d_params, d_buffers, d_opt), scaler)
        metrics = {
            "loss_d": loss_d,
            "loss_g": loss_g,
            "d_skipped": d_info.found_inf,
            "g_skipped": g_info.found_inf,
            "scale": scaler.scale,
        }
        return new, metrics

    return step


def run(generator: nn.Module, discriminator: nn.Module, batches) -> Iterator[tuple[GanState, dict]]:
    """funcamp's run: ``(state, metrics)`` after each iteration. The modules are not changed."""
    opt_g = funcamp.adam(ADAM["lr"], *ADAM["betas"])
    opt_d = funcamp.adam(ADAM["lr"], *ADAM["betas"])
    state = init_state(generator, discriminator, opt_g, opt_d)
    step = gan_step(generator, discriminator, opt_g, opt_d)
    for real, noise in batches:
        state, metrics = step(state, real, noise)
        yield state, metrics


class TorchGan(NamedTuple):
    """torch's side: the modules, their optimizers and the one GradScaler."""

    generator: nn.Module
    discriminator: nn.Module
    opt_g: torch.optim.Optimizer
    opt_d: torch.optim.Optimizer
    scaler: torch.amp.GradScaler


def run_torch(
    generator: nn.Module, discriminator: nn.Module, batches
) -> Iterator[tuple[TorchGan, dict]]:
    """torch's recipe on copies of the modules: ``(objects, metrics)`` after each iteration."""
    net_g, net_d = copy.deepcopy(generator), copy.deepcopy(discriminator)
    opt_g = torch.optim.Adam(net_g.parameters(), **ADAM)
    opt_d = torch.optim.Adam(net_d.parameters(), **ADAM)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    criterion = nn.BCEWithLogitsLoss()
    stepped = set()  # which optimizers stepped (GradScaler skips a step silently)
    opt_g.register_step_post_hook(lambda *_: stepped.add("g"))
    opt_d.register_step_post_hook(lambda *_: stepped.add("d"))
    for real, noise in batches:
        stepped.clear()
        net_d.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            output = net_d(real)
            err_d_real = criterion(output, torch.ones_like(output))
        scaler.scale(err_d_real).backward()
        with torch.autocast("cpu", dtype=torch.float16):
            fake = net_g(noise)
            output = net_d(fake.detach())
            err_d_fake = criterion(output, torch.zeros_like(output))
        scaler.scale(err_d_fake).backward()
        scaler.step(opt_d)

        net_g.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            output = net_d(fake)
            err_g = criterion(output, torch.ones_like(output))
        scaler.scale(err_g).backward()
        scaler.step(opt_g)
        scaler.update()
        metrics = {
            "loss_d": (err_d_real + err_d_fake).detach(),
            "loss_g": err_g.detach(),
            "d_skipped": torch.tensor("d" not in stepped),
            "g_skipped": torch.tensor("g" not in stepped),
            "scale": scaler.get_scale(),
        }
        yield TorchGan(net_g, net_d, opt_g, opt_d, scaler), metrics


def _skips(history: list[dict], key: str) -> list[int]:
    return [i for i, m in enumerate(history) if bool(m[key])]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; with ``--check`` run torch's recipe too and compare. Returns a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inf-at", type=int, default=9, help="-1: no inf in the data")
    parser.add_argument("--check", action="store_true", help="compare with torch's recipe")
    args = parser.parse_args(argv)

    generator, discriminator = make_models(args.seed)
    batches = make_batches(args.steps, seed=args.seed, inf_at=args.inf_at)
    states, history = zip(*run(generator, discriminator, batches))
    state = states[-1]
    summary = {
        "loss_d": [float(m["loss_d"]) for m in history],
        "loss_g": [float(m["loss_g"]) for m in history],
        "d_skipped": _skips(history, "d_skipped"),
        "g_skipped": _skips(history, "g_skipped"),
        "scales": [float(m["scale"]) for m in history],
    }
    print(
        f"{args.steps} iterations: loss_d {summary['loss_d'][0]:.4f} -> "
        f"{summary['loss_d'][-1]:.4f}, loss_g {summary['loss_g'][0]:.4f} -> "
        f"{summary['loss_g'][-1]:.4f}\n"
        f"skipped: discriminator {summary['d_skipped']}, generator {summary['g_skipped']}"
        + (
            f" (iteration {args.inf_at}'s real batch holds an inf)"
            if 0 <= args.inf_at < args.steps
            else ""
        )
        + f"; scaler.skipped {int(state.scaler.skipped)}, final scale {summary['scales'][-1]:g}"
    )
    if args.check:  # exact: rtol=atol=0 (a NaN equals a NaN)
        same = functools.partial(torch.testing.assert_close, rtol=0, atol=0, equal_nan=True)
        theirs = list(run_torch(generator, discriminator, batches))
        for i, ((_, expected), got) in enumerate(zip(theirs, history)):
            same(got, {k: torch.as_tensor(v) for k, v in expected.items()}, msg=f"iteration {i}")
        torch_gan = theirs[-1][0]
        for mine, module in ((state.g, torch_gan.generator), (state.d, torch_gan.discriminator)):
            same((mine.params, mine.buffers), funcamp.params_and_buffers(module))
        print("torch's recipe (autocast, one GradScaler, two Adams): the same bits")
        summary["checked"] = True
    return summary


if __name__ == "__main__":
    main()
