"""Choose a precision policy for a model that breaks under float16: see it, search, train.

    python examples/choose_policy.py                 # 20 epochs, compiled steps
    python examples/choose_policy.py --epochs 3 --no-compile

The model (64 -> 128 -> 128 -> 10 on scikit-learn's digits) has one large-gain Linear,
``mix``, followed by a LayerNorm: in float32 the norm takes the scale out and the model trains
well, but ``mix``'s activations reach about 5e5, past float16's largest value (65504), so under
``mixed_float16`` its output overflows to inf, the LayerNorm turns that into nan and every step is
skipped. The script shows the three tools on it:

1. ``funcamp.trace(loss_fn, policy, stats=True)``: under ``mixed_float16`` the first op with a
   non-finite output is ``mix``'s linear; under ``float32`` its amax shows by how much.
2. ``funcamp.search_policy``: from ``mixed_float16``, keep ``mix`` (and nothing else) in float32.
3. ``funcamp.headroom`` through ``make_train_step(..., headroom=True)``: the fractions of scaled
   gradients that flush to zero or overflow in float16, and the loss scale, over training
   (written as a PNG).

It then trains float32 and the searched policy, and prints both test accuracies. Needs the
``examples`` extra (scikit-learn, tqdm, matplotlib); no download.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call

import funcamp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples' shared setup
from _common import load_digits

#: ``mix``'s weights are scaled by this: activations ~5e5 on digits, past float16's 65504.
GAIN = 1e6


class Net(nn.Module):
    """embed -> relu -> mix (large gain) -> LayerNorm -> relu -> head."""

    def __init__(self, gain: float = GAIN) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 128)
        self.mix = nn.Linear(128, 128)
        self.norm = nn.LayerNorm(128)
        self.head = nn.Linear(128, 10)
        with torch.no_grad():
            self.mix.weight.mul_(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        h = torch.relu(self.norm(self.mix(h)))
        return self.head(h)


def make_model(seed: int = 0, gain: float = GAIN) -> Net:
    torch.manual_seed(seed)
    return Net(gain)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--gain", type=float, default=GAIN, help="scale of mix's weights")
    p.add_argument("--search-batch", type=int, default=256, help="examples the search uses")
    p.add_argument("--tolerance", type=float, default=1e-2)
    p.add_argument(
        "--growth-interval",
        type=int,
        default=25,
        help="the searched run's dynamic scaler grows every this many steps (torch: 2000), so "
        "the plot shows the scale meeting the overflow edge",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="run the steps eagerly")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--out", type=Path, default=Path("build/choose_policy"))
    p.add_argument("--quiet", action="store_true", help="no tables, no progress bar")
    return p.parse_args(argv)


def train(
    model: nn.Module,
    policy: funcamp.Policy,
    data: tuple[torch.Tensor, ...],
    args: argparse.Namespace,
    *,
    epochs: int,
    headroom: Any = False,
    scaler: funcamp.ScalerState | None = None,
) -> tuple[float, dict[str, list[float]], funcamp.TrainState]:
    """Train a fresh copy of ``model``'s params under ``policy``; return the test accuracy, the
    per-step history (loss, scale, and the headroom summary when asked) and the final state."""
    from tqdm import tqdm

    x_tr, y_tr, x_te, y_te = data

    def loss_fn(params, buffers, batch):
        x, y = batch
        return nn.functional.cross_entropy(functional_call(model, (params, buffers), (x,)), y)

    optimizer = funcamp.adam(args.lr)
    params, buffers = funcamp.params_and_buffers(model)
    params = {k: v.clone() for k, v in params.items()}
    state = funcamp.TrainState.create(params, optimizer, policy, buffers=buffers, scaler=scaler)
    step = funcamp.make_train_step(
        loss_fn,
        optimizer,
        policy,
        compile=False if args.no_compile else funcamp.Compile(backend=args.backend),
        headroom=headroom,
    )
    n_batches = len(x_tr) // args.batch_size
    metrics_per_step = []
    with tqdm(total=epochs * n_batches, disable=args.quiet, unit="step", leave=False) as bar:
        for epoch in range(epochs):
            order = torch.randperm(len(x_tr), generator=torch.Generator().manual_seed(epoch))
            for i in range(n_batches):
                idx = order[i * args.batch_size : (i + 1) * args.batch_size]
                state, metrics = step(state, (x_tr[idx], y_tr[idx]))
                metrics_per_step.append(metrics)  # tensors: read back once, at the end
                bar.update()
    history = {
        "loss": torch.stack([m["loss"] for m in metrics_per_step]).tolist(),
        "scale": torch.stack([m["scale"] for m in metrics_per_step]).tolist(),
    }
    if headroom is not False:
        for key in metrics_per_step[0]["headroom"]:
            history[key] = torch.stack([m["headroom"][key] for m in metrics_per_step]).tolist()
    predict = funcamp.amp(lambda p, b, x: functional_call(model, (p, b), (x,)).argmax(-1), policy)
    with torch.no_grad():
        accuracy = (predict(state.params, state.buffers, x_te) == y_te).float().mean().item()
    return accuracy, history, state


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the whole story; return what it measured (accuracies, trace, search report)."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if args.quiet else print
    data = load_digits(args.seed)
    model = make_model(args.seed, args.gain)
    params, _ = funcamp.params_and_buffers(model)
    x_search, y_search = data[0][: args.search_batch], data[1][: args.search_batch]

    def loss(p, x, y):
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    # 1. See it: the op ranges under float16 and float32.
    broken = funcamp.trace(loss, "mixed_float16", stats=True)(params, x_search, y_search)
    first = broken.nonfinite()[0] if broken.nonfinite() else None
    say(broken)
    say(
        f"\nmixed_float16: loss {float(broken.output)}; first non-finite output: "
        f"{first.op if first else None} in module {first.module if first else None!r}"
    )
    full = funcamp.trace(loss, "float32", stats=True)(params, x_search, y_search)
    amax = {r.module: r.amax for r in full if r.op == "linear"}
    say(f"float32 linear output amax by module: { {k: f'{v:.3g}' for k, v in amax.items()} }")

    # 2. Choose: search from mixed_float16.
    t0 = time.perf_counter()
    policy, report = funcamp.search_policy(
        loss, params, x_search, y_search, base="mixed_float16", tolerance=args.tolerance
    )
    search_s = time.perf_counter() - t0
    say(f"\n{report}\nsearch: {search_s:.1f}s\nchosen: {policy!r}\n")

    # 3. Train: float32, mixed_float16 (breaks: every step skipped), the searched policy.
    results: dict[str, object] = {"trace": broken, "first_nonfinite": first, "report": report}
    results["policy"] = policy
    results["float32_amax"] = amax
    t0 = time.perf_counter()
    acc32, _, _ = train(model, funcamp.get_policy("float32"), data, args, epochs=args.epochs)
    say(f"float32:        test accuracy {acc32:.4f} ({time.perf_counter() - t0:.1f}s)")
    fp16_epochs = min(args.epochs, 2)
    acc16, hist16, state16 = train(
        model, funcamp.get_policy("mixed_float16"), data, args, epochs=fp16_epochs
    )
    skipped16 = int(state16.scaler.skipped)
    say(
        f"mixed_float16:  test accuracy {acc16:.4f} after {fp16_epochs} epochs; loss "
        f"{hist16['loss'][-1]}; {skipped16} of {len(hist16['loss'])} steps skipped"
    )
    t0 = time.perf_counter()
    # Headroom of the gradients float16 computes: leave out the float32 modules' own.
    in_float16 = lambda path: not any(path.startswith(f"{m}.") for m in report.unsafe)  # noqa: E731
    scaler = funcamp.ScalerState.dynamic(growth_interval=args.growth_interval)
    acc, hist, state = train(
        model, policy, data, args, epochs=args.epochs, headroom=in_float16, scaler=scaler
    )
    say(
        f"searched:       test accuracy {acc:.4f} ({time.perf_counter() - t0:.1f}s); "
        f"{int(state.scaler.skipped)} steps skipped; final scale {float(state.scaler.scale):g}"
    )
    plot = args.out / "headroom.png"
    _plot(hist, plot, f"{policy} + {', '.join(report.unsafe)} in float32 (float16 grads)")
    say(f"headroom plot: {plot}")
    results.update(
        float32_accuracy=acc32,
        mixed_float16_accuracy=acc16,
        mixed_float16_skipped=skipped16,
        mixed_float16_steps=len(hist16["loss"]),
        accuracy=acc,
        history=hist,
        plot=plot,
        search_seconds=search_s,
    )
    return results


def _plot(history: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import math

    import matplotlib.pyplot as plt

    steps = range(len(history["scale"]))
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(7, 5.5))
    for key, color in (
        ("underflow", "tab:blue"),
        ("subnormal", "tab:green"),
        ("overflow", "tab:red"),
    ):
        ax1.plot(steps, [max(v, 1e-7) for v in history[key]], lw=0.9, color=color, label=key)
    ax1.set_yscale("log")
    ax1.set_ylim(0.5e-7, 1.5)
    ax1.set_ylabel("fraction of scaled grads\n(float16; 1e-7 = none)")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(title, fontsize=9)
    ax2.plot(
        steps,
        history["log2_scale_max"],
        color="tab:red",
        lw=0.8,
        label="above: some grad overflows",
    )
    ax2.plot(
        steps,
        history["log2_scale_min"],
        color="tab:blue",
        lw=0.8,
        label="at or below: some grad flushes to 0",
    )
    ax2.plot(
        steps,
        [math.log2(s) for s in history["scale"]],
        color="tab:orange",
        lw=1.5,
        label="loss scale",
    )
    ax2.set_ylabel("log2 scale")
    ax2.set_xlabel("step")
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
