"""Train a small MLP on scikit-learn's bundled digits dataset with funcamp.

    python examples/train_digits.py                       # mixed_float16 + dynamic loss scaling
    python examples/train_digits.py --policy bf16-mixed   # or float32, bf16-true
    python examples/train_digits.py --epochs 30 --resume  # continue from the last checkpoint
    python examples/train_digits.py --policy bf16-true --update sr  # bfloat16 params
    python examples/train_digits.py --policy bf16-mixed --fp8 delayed  # FP8 linears

``--fp8 current|delayed`` runs both linears as scaled FP8 matmuls (``Policy.with_fp8``): inputs
and weights in float8_e4m3fn, output gradients in float8_e5m2, with current (per-call) or
TransformerEngine-style delayed scaling, whose amax histories live in ``state.fp8`` (threaded by
the step, checkpointed with the rest). On CPU torch emulates the FP8 matmuls (correct, slower).

Everything goes under ``build/train_digits/`` (``--out``), one file name per policy so runs of
different policies do not overwrite each other: ``<policy>.pt`` (the checkpoint, written with
``funcamp.save`` after every epoch: atomically, so a run killed mid-write keeps the previous
epoch's) and ``<policy>.png`` (the loss and the loss scale per step, skipped steps marked).
``--resume`` continues from ``<policy>.pt``; ``funcamp.load`` refuses a checkpoint saved under
another policy (``--checkpoint`` pointing at another policy's file) unless ``--convert`` asks to
continue under the new one on purpose.

With bfloat16/float16 params (``--policy bf16-true``) ``--update`` chooses how Adam's small
updates survive rounding into the params: ``kahan`` (the default: a bfloat16 compensation buffer,
2 more bytes per parameter), ``sr`` (stochastic rounding, no extra memory), ``master`` (float32
master weights, 4 more bytes) or ``plain`` (round to nearest, which loses updates below half an
ulp). It changes nothing for float32 params (and is then not printed).

The whole train step (amp casting, scaled grads, Adam, skip-on-overflow, scale update) is one
compiled graph with no host sync; the first step compiles it (said on screen: tens of seconds on a
2-core CPU, docs/benchmarks.md). The loop reads the metrics back once per epoch, and there a ``funcamp.ScaleCollapseGuard`` stops
the run if the loss scale sits at its floor and every step is skipped (``--patience``). The
float16 scaler tries a larger scale every ``--growth-interval`` steps (100 here, GradScaler's
2000 would never move in this short run), so the plot shows it finding its level. Needs the
``examples`` extra (scikit-learn, tqdm, matplotlib); no download: the dataset ships with
scikit-learn.

float16 matmuls are slow on most CPUs (no kernels), which is why the model is small (64-128-10).
"""

from __future__ import annotations

import argparse
import logging
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
    p.add_argument(
        "--growth-interval",
        type=int,
        default=100,
        help="steps between the float16 scaler's attempts at a larger scale (default 100)",
    )
    p.add_argument(
        "--patience",
        type=int,
        default=100,
        help="stop when this many consecutive steps are skipped at the lowest scale",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--out", type=Path, default=Path("build/train_digits"), help="output directory")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default OUT/<policy>.png)")
    p.add_argument("--checkpoint", type=Path, default=None, help="default OUT/<policy>.pt")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument(
        "--convert",
        action="store_true",
        help="with --resume: continue a checkpoint of another policy under --policy",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


class _TqdmHandler(logging.Handler):
    """Prints funcamp's log lines ("compiling the train step ...") above the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record))


def main(argv: list[str] | None = None) -> float:
    """Train, evaluate, plot and checkpoint; return the test accuracy. funcamp's notices
    ("compiling the train step ...") print above the progress bar while it runs."""
    log, handler = logging.getLogger("funcamp"), _TqdmHandler()
    log.addHandler(handler)
    try:
        return _main(argv)
    finally:
        log.removeHandler(handler)


def _main(argv: list[str] | None) -> float:
    from tqdm import tqdm

    args = parse_args(argv)
    name = POLICIES[args.policy]
    policy = funcamp.get_policy(name)
    if args.fp8 == "current":
        policy = policy.with_fp8(funcamp.Fp8Recipe.current())
    elif args.fp8 == "delayed":
        policy = policy.with_fp8(funcamp.Fp8Recipe.delayed(history=args.fp8_history))
    if args.fp8 != "none":
        name = f"{name}-fp8-{args.fp8}"  # its own checkpoint and plot
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    plot_path = args.plot or out / f"{name}.png"
    ckpt_path = args.checkpoint or out / f"{name}.pt"

    x_tr, y_tr, x_te, y_te = load_digits(args.seed)
    model = make_model(args.seed)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return nn.functional.cross_entropy(functional_call(model, (params, buffers), (x,)), y)

    optimizer = funcamp.adam(args.lr, **UPDATES[args.update], **_seed(args))
    params, buffers = funcamp.params_and_buffers(model)
    scaler = None  # a float16 policy gets a dynamic scaler, the others a noop one
    if policy.compute_dtype == torch.float16:
        scaler = funcamp.ScalerState.dynamic(growth_interval=args.growth_interval)
    # model= builds the delayed-FP8 state (state.fp8) for its linears; ignored otherwise.
    state = funcamp.TrainState.create(
        params, optimizer, policy, buffers=buffers, scaler=scaler, model=model
    )
    history: dict[str, list[float]] = {"loss": [], "scale": [], "skipped": []}
    start_epoch = 0
    if args.resume:
        try:  # refuses a checkpoint of another policy unless --convert
            state = funcamp.load(ckpt_path, state, policy=policy, convert=args.convert)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"{e}\n(train_digits: --policy {args.policy}; see --convert)") from e
        saved = funcamp.checkpoint_info(ckpt_path).metadata
        start_epoch = saved["epoch"]
        history = {k: list(v) for k, v in saved["history"].items()}
        print(f"resumed from {ckpt_path} at epoch {start_epoch}")
        if start_epoch >= args.epochs:
            print(
                f"nothing to train: {ckpt_path} is at epoch {start_epoch} and --epochs is "
                f"{args.epochs} (the epoch to train until); pass --epochs {start_epoch + 10} to "
                "train 10 more. Evaluating the checkpoint as it is."
            )

    step = funcamp.make_train_step(
        loss_fn,
        optimizer,
        policy,
        compile=False if args.no_compile else funcamp.Compile(backend=args.backend),
    )
    # with_fp8_state: delayed FP8 scaling reads its scales from state.fp8 (a no-op otherwise).
    predict = funcamp.with_fp8_state(
        funcamp.amp(lambda p, b, x: functional_call(model, (p, b), (x,)).argmax(-1), policy)
    )
    guard = funcamp.ScaleCollapseGuard(patience=args.patience)

    n_batches = len(x_tr) // args.batch_size  # drop the last partial batch: fixed shapes
    total = (args.epochs - start_epoch) * n_batches
    if args.steps is not None:
        total = min(total, args.steps)
    t0 = time.perf_counter()
    done, epoch = 0, start_epoch
    with tqdm(total=total, disable=args.quiet, unit="step") as bar:
        while done < total:
            order = torch.randperm(len(x_tr), generator=torch.Generator().manual_seed(epoch))
            epoch_metrics = []
            for i in range(n_batches):
                if done == total:
                    break
                idx = order[i * args.batch_size : (i + 1) * args.batch_size]
                if done == 0 and not args.no_compile:
                    bar.set_description_str("compiling the train step (first step)")
                state, metrics = step(state, (x_tr[idx], y_tr[idx]))
                if done == 0:
                    bar.set_description_str("")
                    bar.reset(total)  # the ETA from here on, without the compile time
                epoch_metrics.append(metrics)  # tensors: read back once per epoch
                done += 1
                bar.update()
            epoch += 1 if len(epoch_metrics) == n_batches else 0
            for key, name_ in (("loss", "loss"), ("scale", "scale"), ("skipped", "found_inf")):
                history[key] += torch.stack([m[name_] for m in epoch_metrics]).tolist()
            bar.set_postfix(
                epoch=epoch, loss=f"{history['loss'][-1]:.4f}", skipped=int(state.scaler.skipped)
            )
            guard.check(state, epoch_metrics)  # raises ScaleCollapseError if the scale collapsed
            if len(epoch_metrics) == n_batches:  # a whole epoch: checkpoint it
                _save(ckpt_path, state, policy, epoch, history, args)
    elapsed = time.perf_counter() - t0

    with torch.no_grad():
        pred = predict(state.fp8, state.params, state.buffers, x_te)
    accuracy = (pred == y_te).float().mean().item()
    update = f" | update {args.update}" if policy.param_dtype != torch.float32 else ""
    fp8 = "" if args.fp8 == "none" else f" | fp8 {args.fp8}"
    print(
        f"policy {policy}{fp8}{update} | {done} steps in {elapsed:.1f}s"
        f" | skipped {int(state.scaler.skipped)}"
        f" | final scale {float(state.scaler.scale):g} | test accuracy {accuracy:.4f}"
    )

    _save(ckpt_path, state, policy, epoch, history, args)
    print(f"checkpoint: {ckpt_path}")
    _plot(history, plot_path, _title(policy, args.fp8, state.scaler.kind))
    print(f"plot: {plot_path}")
    return accuracy


def _save(path: Path, state, policy, epoch: int, history: dict, args) -> None:
    funcamp.save(path, state, policy=policy, epoch=epoch, history=history, update=args.update)


def _seed(args: argparse.Namespace) -> dict[str, int]:
    return {"seed": args.seed} if args.update == "sr" else {}


def _title(policy: funcamp.Policy, fp8: str, scaler_kind: str) -> str:
    """The plot's title: the policy on one line, FP8 and the scaler on the next."""
    second = f"{scaler_kind} loss scaler" + ("" if fp8 == "none" else f", FP8 linears ({fp8})")
    return f"{policy}\n{second}"


def _plot(history: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = _figure(history, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _figure(history: dict[str, list[float]], title: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    ax1.plot(history["loss"], lw=0.8)
    ax1.set_ylabel("loss")
    ax1.set_yscale("log")
    ax1.set_title(title, fontsize=10)
    ax2.plot(history["scale"], lw=0.8, color="tab:orange", label="loss scale")
    skipped = [i for i, s in enumerate(history["skipped"]) if s]
    if skipped:
        ax2.plot(
            skipped,
            [history["scale"][i] for i in skipped],
            "x",
            color="tab:red",
            label=f"skipped ({len(skipped)})",
        )
        ax2.legend(loc="lower right")
    ax2.set_ylabel("loss scale")
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("step")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
