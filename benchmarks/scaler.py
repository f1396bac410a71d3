"""Benchmark: funcamp's loss-scaled step against torch.amp.GradScaler on the same gradients.

Both sides run the same work on one grad tree (10M float32 elements on CPU, 100M on CUDA):

* torch:   ``GradScaler.unscale_(opt)`` + ``GradScaler.step(opt)`` with ``torch.optim.SGD``
  (in place; ``step`` syncs with the host to decide whether to skip).
* funcamp: ``funcamp.unscale_and_step`` with ``funcamp.sgd`` -- unscale, finite check, SGD,
  select of the old/new params, grad norm; no host sync, inputs never modified.

``--optimizer adam`` runs ``torch.optim.Adam(foreach=True)`` (train_step.py's variant (b))
against ``funcamp.adam`` instead: the optimizer half of the eager train step, whose
``donate_grads`` row is what ``make_train_step(compile=False)`` runs.

Two splits of the same element count (``--split``, default both):

* ``original``: the first benchmark's split, 4 big matrices (16/10/8/4 MB) and 4 vectors.
* ``model``: transformer-like leaves -- an embedding and 3 blocks of d_model 512 (qkv, out
  projection, two MLP matrices, biases, layer norms): 37 leaves of at most 4 MB.

Rows (ratio = funcamp / torch, lower is better):

* ``step, eager``: the public default; the grads are the caller's and stay untouched.
* ``step, eager, donate_grads``: the train-step entry, where the step owns its grads (they come
  from ``torch.func.grad``); each run gets a fresh copy made outside the timed region, as
  ``torch`` gets its ``.grad`` reset outside it.
* ``step, eager, donate_grads + donate_state``: the caller also hands over params and optimizer
  state, as torch.optim does (it updates them in place): the new params are written into the
  old ones -- for plain SGD by torch's fused kernel, which skips on ``found_inf`` by itself.
  Each run starts from a fresh copy of the params made outside the timed region, as torch's
  params are reset outside it.
* ``step, eager, donate grads+state, grad_norm=False``: the same without the global grad norm
  (``StepInfo.grad_norm`` is None), the work ``GradScaler.unscale_`` + ``step`` does: the like
  for like comparison of issue 13's scaler target.
* ``unscale + check only``: ``funcamp.unscale`` vs ``GradScaler.unscale_`` (fused kernel on a
  copy), and the pure-torch path that runs under transforms.
* ``step, compiled``: the public step under ``torch.compile(fullgraph=True)`` (inductor).

``--against REV`` times each funcamp row as of git revision REV (imported beside this tree by
``benchmarks/_revision.py``) in the same rounds as this tree's and torch's (each round takes the
next order of the sides); the ``vs @REV`` column is the median of the per-round ratios this/REV. Run it
against ``HEAD`` for the noise floor (an A/A comparison of identical code).

``faults/call`` is the median number of minor page faults of one call (funcamp/torch): fresh
memory is mapped in page by page on first touch, which on a VM can cost more than the
arithmetic; it says how much of a row's time is the allocator's.

Runs are interleaved in one process (alternating which side goes first) and the median of
``--runs`` runs is reported. Allocation of fresh 4-40 MB tensors (page faults) is a large part of
the cost on CPU; the library never tunes the allocator, and neither does this script.

Usage::

    python benchmarks/scaler.py                 # CPU, 10M elements, both splits, 1 thread
    python benchmarks/scaler.py --device cuda   # 100M elements
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    import resource  # Unix: page faults per call
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

import funcamp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine
from _revision import import_revision

LR = 1e-3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _original_shapes(numel: int) -> list[tuple[int, ...]]:
    """The original split: 4 big matrices (40/25/20/10% of the elements) and 4 vectors."""
    fractions = [0.4, 0.25, 0.2, 0.1]
    shapes: list[tuple[int, ...]] = [(int(numel * f) // 1000, 1000) for f in fractions]
    rest = numel - sum(a * b for a, b in shapes)
    shapes += [(rest // 4,)] * 3 + [(rest - 3 * (rest // 4),)]
    return shapes


def _model_shapes(numel: int) -> list[tuple[int, ...]]:
    """Transformer-like leaves: an embedding plus pre-LN blocks of width d (qkv, out projection,
    MLP 4d, biases, layer norms), d and the block count chosen to come close to ``numel``."""
    d = 512 if numel < 50_000_000 else 1024
    block: list[tuple[int, ...]] = [
        (d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,),
        (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,),
    ]  # fmt: skip
    per_block = sum(math.prod(s) for s in block)
    vocab = 1000
    blocks = max(1, round((numel - vocab * d) / per_block))
    return [(vocab, d)] + block * blocks


def _minor_faults() -> int:
    """This process's minor page faults so far (0 where ``resource`` is missing)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, int]:
    """Seconds and minor page faults of one call."""
    _sync(device)
    faults = _minor_faults()
    start = time.perf_counter()
    out = fn()
    _sync(device)
    took = time.perf_counter() - start
    faults = _minor_faults() - faults
    # Freed after the clock stops: torch's side frees nothing, and returning 40-80 MB to the OS
    # inside the timed region cost funcamp's rows up to 2x on this VM.
    del out
    return took, faults


def _funcamp_rows(
    args: argparse.Namespace,
    device: torch.device,
    fc: Any,
    tag: str,
    scale: float,
    params: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    torch_step: Callable[[], object],
    torch_unscale: Callable[[], object],
) -> list[Any]:
    """funcamp's rows, for the module ``fc`` (this tree's funcamp, or another revision's)."""
    state = fc.ScalerState.dynamic(scale, device=device)
    sgd = fc.adam(LR) if args.optimizer == "adam" else fc.sgd(LR)  # `sgd`: the optimizer
    opt_state = sgd.init(params)

    def ours_step_fn(state, grads, opt_state, params):
        return fc.unscale_and_step(state, sgd, grads, opt_state, params)

    def ours_step() -> object:
        return ours_step_fn(state, grads, opt_state, params)

    # Donated inputs are made by each round's setup (which frees the last round's, untimed) and
    # read, not popped, by the timed call: freeing them there would be timed too.
    donated: list[dict[str, torch.Tensor]] = []

    def make_donated() -> None:
        donated[:] = [{k: v.clone() for k, v in grads.items()}]

    def ours_donated() -> object:
        return fc.unscale_and_step(state, sgd, donated[0], opt_state, params, donate_grads=True)

    donated_all: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def make_donated_all() -> None:
        donated_all[:] = [
            ({k: v.clone() for k, v in grads.items()}, {k: v.clone() for k, v in params.items()})
        ]

    def ours_donated_all() -> object:
        g, p = donated_all[0]
        return fc.unscale_and_step(
            state, sgd, g, opt_state, p, donate_grads=True, donate_state=True
        )

    def ours_unscale() -> object:
        return fc.unscale(state, grads)

    grad_leaves = list(grads.values())

    def ours_unscale_pure() -> object:
        return fc._scaler._unscale_leaves(grad_leaves, state.scale, fused=False)

    Row = tuple[str, Callable[[], object], Callable[[], object], Callable[[], None] | None]
    rows: list[Row] = [(f"step, eager{tag}", ours_step, torch_step, None)]
    if "grad_norm" in inspect.signature(fc.unscale_and_step).parameters:

        def ours_no_norm() -> object:
            return fc.unscale_and_step(state, sgd, grads, opt_state, params, grad_norm=False)

        rows.append((f"step, eager, grad_norm=False{tag}", ours_no_norm, torch_step, None))
    if "donate_grads" in inspect.signature(fc.unscale_and_step).parameters:
        rows.append((f"step, eager, donate_grads{tag}", ours_donated, torch_step, make_donated))
    if "donate_state" in inspect.signature(fc.unscale_and_step).parameters:
        rows.append(
            (
                f"step, eager, donate grads+state{tag}",
                ours_donated_all,
                torch_step,
                make_donated_all,
            )
        )
    if {"donate_state", "grad_norm"} <= set(inspect.signature(fc.unscale_and_step).parameters):

        def ours_donated_all_no_norm() -> object:
            g, p = donated_all[0]
            return fc.unscale_and_step(
                state, sgd, g, opt_state, p, donate_grads=True, donate_state=True, grad_norm=False
            )

        rows.append(
            (
                f"step, eager, donate grads+state, grad_norm=False{tag}",
                ours_donated_all_no_norm,
                torch_step,
                make_donated_all,
            )
        )
    rows += [
        (f"unscale + check only, eager{tag}", ours_unscale, torch_unscale, None),
        (f"  same, pure-torch path{tag}", ours_unscale_pure, torch_unscale, None),
    ]
    if not args.no_compile:
        compiled = torch.compile(ours_step_fn, fullgraph=True)
        for _ in range(3):
            compiled(state, grads, opt_state, params)

        def ours_compiled() -> object:
            return compiled(state, grads, opt_state, params)

        rows.append((f"step, compiled (inductor){tag}", ours_compiled, torch_step, None))
    return rows


def _bench(args: argparse.Namespace, device: torch.device, split: str) -> None:
    numel = args.numel or (100_000_000 if device.type == "cuda" else 10_000_000)
    shapes = (_original_shapes if split == "original" else _model_shapes)(numel)
    gen = torch.Generator().manual_seed(0)
    scale = 2.0**16
    params = {f"p{i}": torch.randn(s, generator=gen).to(device) for i, s in enumerate(shapes)}
    grads = {k: (torch.randn(v.shape, generator=gen) * scale).to(device) for k, v in params.items()}

    # torch side
    module_params = [torch.nn.Parameter(p.clone()) for p in params.values()]
    for p, g in zip(module_params, grads.values()):
        p.grad = g.clone()
    if args.optimizer == "adam":  # as variant (b) of train_step.py
        opt: torch.optim.Optimizer = torch.optim.Adam(module_params, lr=LR, foreach=True)
    else:
        opt = torch.optim.SGD(module_params, lr=LR)
    gs = torch.amp.GradScaler(device.type, init_scale=scale)
    gs.scale(torch.ones((), device=device))  # initialise its scale tensor

    def reset_torch() -> None:
        with torch.no_grad():
            for p, src, g in zip(module_params, params.values(), grads.values()):
                p.copy_(src)
                p.grad.copy_(g)

    def torch_step() -> None:
        gs.unscale_(opt)
        gs.step(opt)

    def torch_unscale() -> None:
        gs.unscale_(opt)

    rows = _funcamp_rows(args, device, funcamp, "", scale, params, grads, torch_step, torch_unscale)
    tag = f" @{args.against}" if args.against else ""
    by_name: dict[str, Any] = {}
    if args.against:  # each row of this tree timed in the same rounds as the other revision's
        old = import_revision(args.against)
        theirs = _funcamp_rows(
            args, device, old, tag, scale, params, grads, torch_step, torch_unscale
        )
        by_name = {row[0][: -len(tag)]: row for row in theirs}

    biggest = max(math.prod(s) for s in shapes) * 4 / 2**20
    print(
        f"optimizer={args.optimizer} split={split} device={device} numel={sum(math.prod(s) for s in shapes):,} "
        f"leaves={len(shapes)} biggest={biggest:.1f} MB runs={args.runs} "
        f"threads={torch.get_num_threads()} torch={torch.__version__}"
    )
    head = f"{'':50s} {'funcamp ms':>11s} {'torch ms':>9s} {'ratio':>6s} {'faults/call':>13s}"
    print(head + (f" {'vs' + tag:>12s}" if args.against else ""))
    for name, ours, torch_fn, setup in rows:
        sides = [(ours, setup), (torch_fn, None)]
        other = by_name.pop(name, None)
        if other is not None:
            sides.append((other[1], other[3]))
        times: list[list[float]] = [[] for _ in sides]
        faults: list[list[int]] = [[] for _ in sides]
        for i in range(args.runs + 2):  # two warm-up runs
            reset_torch()
            for _, side_setup in sides:
                if side_setup is not None:
                    side_setup()
            _sync(device)
            # every order of the sides in turn: no side always runs first or after the same one
            orders = list(itertools.permutations(range(len(sides))))
            order = orders[i % len(orders)]
            took = [(0.0, 0)] * len(sides)
            for k in order:
                took[k] = _timed(sides[k][0], device)
            gs.update()
            if i >= 2:
                for k, (t, f) in enumerate(took):
                    times[k].append(t)
                    faults[k].append(f)
        med = [statistics.median(t) * 1e3 for t in times]
        flt = [round(statistics.median(f)) for f in faults]
        line = f"{name:50s} {med[0]:11.2f} {med[1]:9.2f} {med[0] / med[1]:6.2f}"
        line += f" {f'{flt[0]}/{flt[1]}':>13s}"
        if other is not None:
            # per-round ratio this/other: both sides timed within one round
            paired = statistics.median(a / b for a, b in zip(times[0], times[2]))
            line += f" {paired:12.3f}"
        print(line)
        if other is not None:
            print(
                f"{other[0]:50s} {med[2]:11.2f} {med[1]:9.2f} {med[2] / med[1]:6.2f} "
                f"{f'{flt[2]}/{flt[1]}':>13s}"
            )
    for row in by_name.values():  # rows only the other revision has
        print(f"{row[0]:50s} (only at {args.against}; not timed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--numel", type=int, default=None, help="grad elements (10M/100M)")
    parser.add_argument("--split", choices=["original", "model", "both"], default="both")
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument(
        "--against", default="", help="also time funcamp at this git revision, same process"
    )
    parser.add_argument("--require-quiet", action="store_true", help="stop on a busy machine")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled row")
    parser.add_argument(
        "--optimizer", choices=["sgd", "adam"], default="sgd",
        help="sgd (default) or adam: torch.optim.Adam(foreach=True) against funcamp.adam",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: less noise)"
    )
    args = parser.parse_args()
    if args.runs < 20:
        parser.error("--runs must be >= 20")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    splits = ["original", "model"] if args.split == "both" else [args.split]
    _machine.check(args.require_quiet)
    for split in splits:
        _bench(args, device, split)


if __name__ == "__main__":
    main()
