"""Benchmark: funcamp's loss-scaled step against torch.amp.GradScaler on the same gradients.

Both sides run the same work on one grad tree (10M float32 elements on CPU, 100M on CUDA):

* torch:   ``GradScaler.unscale_(opt)`` + ``GradScaler.step(opt)`` with ``torch.optim.SGD``
  (in place; ``step`` syncs with the host to decide whether to skip).
* funcamp: ``funcamp.unscale_and_step`` with ``funcamp.sgd`` -- unscale into new tensors, finite
  check, SGD, ``tree_select`` of the old/new params, grad norm; no host sync.

Runs are interleaved in one process (alternating which side goes first) and the median of
``--runs`` runs is reported, with the ratio funcamp / torch (lower is better). The compiled row
runs the funcamp step under ``torch.compile(fullgraph=True)`` (inductor). Component rows time the
unscale + finite check alone (``funcamp.unscale`` vs ``GradScaler.unscale_``), with the fused
kernel funcamp uses in eager and with its pure-torch fallback.

Usage::

    python benchmarks/scaler.py                 # CPU, 10M elements
    python benchmarks/scaler.py --device cuda   # 100M elements
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import funcamp
from funcamp._scaler import _unscale_leaves

LR = 1e-3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _shapes(numel: int) -> list[tuple[int, ...]]:
    """A model-like split: a few big matrices and some small vectors."""
    fractions = [0.4, 0.25, 0.2, 0.1]
    shapes: list[tuple[int, ...]] = [(int(numel * f) // 1000, 1000) for f in fractions]
    rest = numel - sum(a * b for a, b in shapes)
    shapes += [(rest // 4,)] * 3 + [(rest - 3 * (rest // 4),)]
    return shapes


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--numel", type=int, default=None, help="grad elements (10M/100M)")
    parser.add_argument("--runs", type=int, default=25)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled row")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    numel = args.numel or (100_000_000 if device.type == "cuda" else 10_000_000)
    if args.runs < 20:
        parser.error("--runs must be >= 20")

    gen = torch.Generator().manual_seed(0)
    shapes = _shapes(numel)
    scale = 2.0**16
    params = {f"p{i}": torch.randn(s, generator=gen).to(device) for i, s in enumerate(shapes)}
    grads = {k: (torch.randn(v.shape, generator=gen) * scale).to(device) for k, v in params.items()}

    # torch side
    module_params = [torch.nn.Parameter(p.clone()) for p in params.values()]
    for p, g in zip(module_params, grads.values()):
        p.grad = g.clone()
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

    # funcamp side
    state = funcamp.ScalerState.dynamic(scale, device=device)
    sgd = funcamp.sgd(LR)
    opt_state = sgd.init(params)

    def ours_step_fn(state, grads, opt_state, params):
        return funcamp.unscale_and_step(state, sgd, grads, opt_state, params)

    def ours_step() -> object:
        return ours_step_fn(state, grads, opt_state, params)

    def ours_unscale() -> object:
        return funcamp.unscale(state, grads)

    grad_leaves = list(grads.values())

    def ours_unscale_pure() -> object:
        return _unscale_leaves(grad_leaves, state.scale, fused=False)

    rows: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("step, eager", ours_step, torch_step),
        ("unscale + check only, eager", ours_unscale, torch_unscale),
        ("  same, pure-torch path (no fused)", ours_unscale_pure, torch_unscale),
    ]
    if not args.no_compile:
        compiled = torch.compile(ours_step_fn, fullgraph=True)
        for _ in range(3):
            compiled(state, grads, opt_state, params)

        def ours_compiled() -> object:
            return compiled(state, grads, opt_state, params)

        rows.append(("step, funcamp compiled (inductor)", ours_compiled, torch_step))

    print(
        f"device={device} numel={numel:,} leaves={len(shapes)} runs={args.runs} "
        f"threads={torch.get_num_threads()} torch={torch.__version__}"
    )
    print(f"{'':36s} {'funcamp ms':>11s} {'torch ms':>9s} {'ratio':>6s}")
    for name, ours, theirs in rows:
        ours_t, theirs_t = [], []
        for i in range(args.runs + 2):  # two warm-up runs
            reset_torch()
            _sync(device)
            if i % 2:
                a = _timed(ours, device)
                b = _timed(theirs, device)
            else:
                b = _timed(theirs, device)
                a = _timed(ours, device)
            gs.update()
            if i >= 2:
                ours_t.append(a)
                theirs_t.append(b)
        o, t = statistics.median(ours_t) * 1e3, statistics.median(theirs_t) * 1e3
        print(f"{name:36s} {o:11.2f} {t:9.2f} {o / t:6.2f}")


if __name__ == "__main__":
    main()
