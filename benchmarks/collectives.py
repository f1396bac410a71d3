"""Benchmark: what the collectives of a data-parallel step cost (2 gloo ranks on CPU).

Rows (median over ``--runs``, milliseconds per step, measured on rank 0):

* ``all-reduce, packed``: the gradients of the model below averaged with
  ``funcamp.distributed.all_reduce_grads`` -- one flat buffer, one all-reduce.
* ``all-reduce, per leaf``: the same gradients, one functional all-reduce per leaf (what a
  naive ``tree_map(all_reduce, grads)`` issues).
* ``step, N ranks``: ``make_train_step(..., parallel=DataParallel(pg))``, each rank on ``batch / N`` rows.
* ``step, 1 process, batch / N``: the same local work without the collective (the difference
  to the row above is the cost of data parallelism per step).
* ``step, 1 process, batch``: the whole batch in one process (the other rank idles).

The model is an MLP of ``--layers`` square ``--width`` layers (2 leaves each) under
``mixed_bfloat16``; steps are eager and, unless ``--no-compile``, compiled with inductor.

Usage::

    python benchmarks/collectives.py                  # spawns 2 ranks (gloo, 1 thread each)
    python benchmarks/collectives.py --ranks 3 --no-compile
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

import funcamp
import funcamp.distributed as fd

POLICY = "mixed_bfloat16"


def _time(fn: Callable[[], object], runs: int, warmup: int = 3, lockstep: bool = True) -> float:
    """Median milliseconds of ``fn()``; with ``lockstep`` every rank calls this together and a
    barrier lines them up before each run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if lockstep:
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pg = dist.group.WORLD
    model = _model(args.width, args.layers)
    params, buffers = funcamp.params_and_buffers(model)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    numel = sum(v.numel() for v in params.values())
    rows: list[tuple[str, float]] = []

    def packed() -> None:
        fd.all_reduce_grads(grads, pg)

    def per_leaf() -> None:
        out = [funcol.all_reduce(g, "sum", pg) / world for g in grads.values()]
        funcol.wait_tensor(out[-1])
        for o in out:
            o.add_(0)  # touch every result: each waits on its own collective

    rows.append((f"all-reduce, packed ({len(grads)} leaves in 1)", _time(packed, args.runs)))
    rows.append((f"all-reduce, per leaf ({len(grads)} calls)", _time(per_leaf, args.runs)))

    def loss_fn(p, b, batch):
        x, y = batch
        logits = torch.func.functional_call(model, (p, b), (x,))
        return torch.nn.functional.cross_entropy(logits, y)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    n = args.batch // world
    shard = (x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
    opt = funcamp.adamw(1e-3)
    modes = [("eager", {"compile": False})]
    if not args.no_compile:
        modes.append(("compiled", {}))
    for mode, kw in modes:
        dp = funcamp.make_train_step(loss_fn, opt, POLICY, parallel=fd.DataParallel(pg), **kw)
        local = funcamp.make_train_step(loss_fn, opt, POLICY, **kw)
        state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers)

        def run_dp(step=dp, state=state) -> None:
            step(state, shard)

        rows.append((f"step, {world} ranks, batch {n} each, {mode}", _time(run_dp, args.runs)))
        for rows_per, label in ((n, f"batch {n}"), (args.batch, f"batch {args.batch}")):
            batch = (x[:rows_per], y[:rows_per])
            if rank == 0:
                ms = _time(lambda f=local, s=state, b=batch: f(s, b), args.runs, lockstep=False)
                rows.append((f"step, 1 process, {label}, {mode}", ms))
            dist.barrier()  # the other ranks idle meanwhile
    if rank == 0:
        print(
            f"{world} gloo ranks, {args.threads} thread(s) each; {numel / 1e6:.2f}M float32 "
            f"params ({len(grads)} leaves); policy {POLICY}; median of {args.runs}\n"
        )
        print("| row | ms |\n|---|---:|")
        for name, ms in rows:
            print(f"| {name} | {ms:.3f} |")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    mp.spawn(_worker, args=(args.ranks, _free_port(), args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
