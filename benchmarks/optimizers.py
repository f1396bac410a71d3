"""Benchmark: each funcamp optimizer's eager step against its torch.optim class.

Both sides update the same params from the same gradients (``--elements`` float32 elements in
transformer-like matrices, default 4M; Muon's are all matrices anyway): torch.optim's
``step()`` (``foreach=True`` where the class has it: the multi-tensor path; Muon's single-tensor
path; LBFGS is left out, its step is a loop of loss evaluations) against funcamp's
``update`` + ``apply_updates`` (pure: new params and state, inputs untouched). Each timing is
the median of ``--repeats`` steps after ``--warmup`` ones; ratio = funcamp / torch.

``--compiled`` adds ``torch.compile`` (inductor) of both steps -- torch.optim's ``step`` and
funcamp's pure step -- and their steady step times (the first calls are C++ builds on a CPU).

Run: ``python benchmarks/optimizers.py [--elements N] [--compiled]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import funcamp

#: (torch class, its kwargs, funcamp optimizer) for every optimizer both have.
CASES: dict[str, tuple[type, dict, Callable[[], funcamp.Optimizer]]] = {
    "sgd (momentum)": (
        torch.optim.SGD,
        {"lr": 1e-2, "momentum": 0.9},
        lambda: funcamp.sgd(1e-2, 0.9),
    ),
    "adam": (torch.optim.Adam, {"lr": 1e-3}, lambda: funcamp.adam(1e-3)),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}, lambda: funcamp.adamw(1e-3)),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-2}, lambda: funcamp.rmsprop(1e-2)),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}, lambda: funcamp.adagrad(1e-2)),
    "adadelta": (torch.optim.Adadelta, {}, lambda: funcamp.adadelta()),
    "adamax": (torch.optim.Adamax, {"lr": 2e-3}, lambda: funcamp.adamax(2e-3)),
    "nadam": (torch.optim.NAdam, {"lr": 2e-3}, lambda: funcamp.nadam(2e-3)),
    "radam": (torch.optim.RAdam, {"lr": 1e-3}, lambda: funcamp.radam(1e-3)),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2}, lambda: funcamp.asgd(1e-2)),
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}, lambda: funcamp.rprop(1e-2)),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}, lambda: funcamp.adafactor(1e-2)),
    "muon": (torch.optim.Muon, {"lr": 1e-3}, lambda: funcamp.muon(1e-3)),
}
NO_FOREACH = {"muon"}


def _shapes(elements: int) -> dict[str, tuple[int, int]]:
    """Eight square-ish matrices of about ``elements`` in all."""
    side = max(2, int((elements / 8) ** 0.5))
    return {f"m{i}": (side, side + (i % 3)) for i in range(8)}


def _median_time(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _torch_step(name: str, shapes: dict, compiled: bool) -> Callable[[], object]:
    cls, kwargs, _ = CASES[name]
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes.values()]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    extra = {} if name in NO_FOREACH else {"foreach": True}
    opt = cls(ps, **kwargs, **extra)
    step = torch.compile(opt.step) if compiled else opt.step
    return lambda: step()


def _funcamp_step(name: str, shapes: dict, compiled: bool) -> Callable[[], object]:
    opt = CASES[name][2]()
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen) * 1e-2 for k, s in shapes.items()}
    box = [params, opt.init(params)]

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return funcamp.apply_updates(params, updates), state

    fn = torch.compile(step, fullgraph=True) if compiled else step

    def run() -> None:
        box[0], box[1] = fn(box[0], box[1], grads)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=4_000_000)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--only", nargs="*", default=None, help="optimizer names to run")
    args = parser.parse_args()
    shapes = _shapes(args.elements)
    n = sum(a * b for a, b in shapes.values())
    print(f"{n:,} float32 elements in {len(shapes)} matrices, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    modes = [False, True] if args.compiled else [False]
    print("| optimizer | step | torch.optim (ms) | funcamp (ms) | ratio |")
    print("|---|---|---|---|---|")
    for name in args.only or CASES:
        for compiled in modes:
            t = _median_time(_torch_step(name, shapes, compiled), args.warmup, args.repeats)
            f = _median_time(_funcamp_step(name, shapes, compiled), args.warmup, args.repeats)
            kind = "compiled" if compiled else "eager"
            print(f"| {name} | {kind} | {t * 1e3:.2f} | {f * 1e3:.2f} | {f / t:.2f} |", flush=True)


if __name__ == "__main__":
    main()
