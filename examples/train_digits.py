"""Train a small MLP on scikit-learn's bundled digits dataset with funcamp.

    python examples/train_digits.py                       # mixed_float16 + dynamic loss scaling
    python examples/train_digits.py --policy bf16-mixed   # or float32, bf16-true
    python examples/train_digits.py --epochs 10 --resume  # continue from the last checkpoint
    python examples/train_digits.py --policy bf16-true --update sr  # bfloat16 params
    python examples/train_digits.py --policy bf16-mixed --fp8 delayed  # FP8 linears

``--fp8 current|delayed`` runs both linears as scaled FP8 matmuls (``Policy.with_fp8``): inputs
and weights in float8_e4m3fn, output gradients in float8_e5m2, with current (per-call) or
TransformerEngine-style delayed scaling, whose amax histories live in ``state.fp8`` (threaded by
the step, checkpointed with the rest). On CPU torch emulates the FP8 matmuls (correct, slower).

With bfloat16/float16 params (``--policy bf16-true``) ``--update`` chooses how Adam's small
updates survive rounding into the params: ``kahan`` (the default: a bfloat16 compensation buffer,
2 more bytes per parameter), ``sr`` (stochastic rounding, no extra memory), ``master`` (float32
master weights, 4 more bytes) or ``plain`` (round to nearest, which loses updates below half an
ulp). It changes nothing for float32 params.

The whole train step (amp casting, scaled grads, Adam, skip-on-overflow, scale update) is one
compiled graph with no host sync; the loop reads the metrics back once per epoch. Writes a plot of
the loss and the loss scale per step (``--plot``) and a checkpoint (``--checkpoint``) that
``--resume`` continues from. Needs the ``examples`` extra (scikit-learn, tqdm, matplotlib); no
download: the dataset ships with scikit-learn.

float16 matmuls are slow on most CPUs (no kernels), which is why the model is small (64-128-10).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.func import functional_call

import funcamp

POLICIES = {
    "mixed_float16": "mixed_float16",
    "16-mixed": "mixed_float16",
    "bf16-mixed": "mixed_bfloat16",
    "mixed_bfloat16": "mixed_bfloat16",
    "bf16-true": "bf16-true",
    "float32": "float32",
}


#: ``--update``: the low-precision mode of Adam for half params (no effect on float32 params).
UPDATES = {
    "plain": {},
    "master": {"master_weights": True},
    "kahan": {"kahan": True},
    "sr": {"stochastic_rounding": True},
}


def load_data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Digits as float32 tensors in [0, 1], split into 1400 train / 397 test images."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x / 16.0, y, test_size=397, random_state=seed, stratify=y
    )
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy", default="mixed_float16", choices=sorted(POLICIES))
    p.add_argument("--epochs", type=int, default=20, help="train until this epoch (default 20)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps in all")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--update",
        default="kahan",
        choices=sorted(UPDATES),
        help="how half params take Adam's updates (default kahan; no effect on float32 params)",
    )
    p.add_argument(
        "--fp8",
        default="none",
        choices=("none", "current", "delayed"),
        help="run the linears in FP8 with this scaling recipe (default none)",
    )
    p.add_argument("--fp8-history", type=int, default=16, help="amax history of --fp8 delayed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--out", type=Path, default=Path("build/digits"), help="output directory")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default OUT/digits.png)")
    p.add_argument("--checkpoint", type=Path, default=None, help="default OUT/checkpoint.pt")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    """Train, evaluate, plot and checkpoint; return the test accuracy."""
    from tqdm import tqdm

    args = parse_args(argv)
    policy = funcamp.get_policy(POLICIES[args.policy])
    if args.fp8 == "current":
        policy = policy.with_fp8(funcamp.Fp8Recipe.current())
    elif args.fp8 == "delayed":
        policy = policy.with_fp8(funcamp.Fp8Recipe.delayed(history=args.fp8_history))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    plot_path = args.plot or out / "digits.png"
    ckpt_path = args.checkpoint or out / "checkpoint.pt"

    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    model = make_model(args.seed)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return nn.functional.cross_entropy(functional_call(model, (params, buffers), (x,)), y)

    optimizer = funcamp.adam(args.lr, **UPDATES[args.update], **_seed(args))
    params, buffers = funcamp.params_and_buffers(model)
    # model= builds the delayed-FP8 state (state.fp8) for its linears; ignored otherwise.
    state = funcamp.TrainState.create(params, optimizer, policy, buffers=buffers, model=model)
    history: dict[str, list[float]] = {"loss": [], "scale": []}
    start_epoch = 0
    if args.resume:
        saved = torch.load(ckpt_path, weights_only=True)
        state = funcamp.load_state_dict(state, saved["state"])
        start_epoch = saved["epoch"]
        history = {k: list(v) for k, v in saved["history"].items()}
        print(f"resumed from {ckpt_path} at epoch {start_epoch}")

    compile_kw = {} if args.no_compile else {"backend": args.backend}
    step = funcamp.make_train_step(
        loss_fn, optimizer, policy, compile=not args.no_compile, **compile_kw
    )
    # with_fp8_state: delayed FP8 scaling reads its scales from state.fp8 (a no-op otherwise).
    predict = funcamp.with_fp8_state(
        funcamp.amp(lambda p, b, x: functional_call(model, (p, b), (x,)).argmax(-1), policy)
    )

    n_batches = len(x_tr) // args.batch_size  # drop the last partial batch: fixed shapes
    total = (args.epochs - start_epoch) * n_batches
    if args.steps is not None:
        total = min(total, args.steps)
    t0 = time.perf_counter()
    done, epoch = 0, start_epoch
    with tqdm(total=total, disable=args.quiet, unit="step") as bar:
        while done < total:
            order = torch.randperm(len(x_tr), generator=torch.Generator().manual_seed(epoch))
            losses, scales = [], []
            for i in range(n_batches):
                if done == total:
                    break
                idx = order[i * args.batch_size : (i + 1) * args.batch_size]
                state, metrics = step(state, (x_tr[idx], y_tr[idx]))
                losses.append(metrics["loss"])  # tensors: read back once per epoch
                scales.append(metrics["scale"])
                done += 1
                bar.update()
            epoch += 1 if len(losses) == n_batches else 0
            history["loss"] += torch.stack(losses).tolist()
            history["scale"] += torch.stack(scales).tolist()
            bar.set_postfix(
                epoch=epoch, loss=f"{history['loss'][-1]:.4f}", skipped=int(state.scaler.skipped)
            )
    elapsed = time.perf_counter() - t0

    with torch.no_grad():
        pred = predict(state.fp8, state.params, state.buffers, x_te)
    accuracy = (pred == y_te).float().mean().item()
    fp8 = "" if args.fp8 == "none" else f" | fp8 {args.fp8}"
    print(
        f"policy {policy}{fp8} | update {args.update} | {done} steps in {elapsed:.1f}s"
        f" | skipped {int(state.scaler.skipped)}"
        f" | final scale {float(state.scaler.scale):g} | test accuracy {accuracy:.4f}"
    )

    torch.save({"state": funcamp.state_dict(state), "epoch": epoch, "history": history}, ckpt_path)
    print(f"checkpoint: {ckpt_path}")
    _plot(history, plot_path, str(policy) + fp8)
    print(f"plot: {plot_path}")
    return accuracy


def _seed(args: argparse.Namespace) -> dict[str, int]:
    return {"seed": args.seed} if args.update == "sr" else {}


def _plot(history: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    ax1.plot(history["loss"], lw=0.8)
    ax1.set_ylabel("loss")
    ax1.set_yscale("log")
    ax1.set_title(title)
    ax2.plot(history["scale"], lw=0.8, color="tab:orange")
    ax2.set_ylabel("loss scale")
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
