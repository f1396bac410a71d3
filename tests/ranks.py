"""Spawned gloo ranks for the distributed tests (test_distributed, test_distributed_scaler,
test_shard, test_save_distributed): start-up, rendezvous, results, and a graph-counting backend.

A run is one fork server that imports torch, funcamp and the test module once, single-threaded,
and forks a worker per rank from there: clean processes (unlike a fork of pytest) at a fraction
of the start-up cost of "spawn" (each of which imports everything again). Each worker joins a
gloo group that rendezvouses through a FileStore in the run's own temporary directory (no TCP
port to pick: a free port chosen here could be taken by a concurrent run -- another
pytest-xdist worker -- before the workers bind it), saves its results to ``<tag><rank>.pt``
there and leaves without the interpreter's teardown (slow after torch.distributed).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist


def init_rank(rank: int, world: int, out_dir: str, timeout_s: float, tag: str = "") -> None:
    """Join the run's gloo group (one thread per rank: the ranks share the machine's cores)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=Path(out_dir, f"{tag}store").resolve().as_uri(),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def save_results(res: dict, out_dir: str, rank: int, tag: str = "rank") -> None:
    torch.save(res, os.path.join(out_dir, f"{tag}{rank}.pt"))


def leave(*, barrier: bool = True) -> NoReturn:
    """End the worker: wait for the others (unless a collective may have timed out, after which
    the group cannot be torn down cleanly) and exit without the interpreter's teardown."""
    if barrier:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


class Run:
    """The worker processes of one run, started by :func:`start`."""

    def __init__(self, procs: list[Any], out_dir: Path, tag: str, timeout_s: float) -> None:
        self.procs, self.out_dir, self.tag, self.timeout_s = procs, out_dir, tag, timeout_s
        self.deadline = time.monotonic() + timeout_s

    def results(self) -> list[dict]:
        """Wait for every rank (killing those still alive at the deadline), check they all
        exited cleanly, and load what each saved."""
        for p in self.procs:
            p.join(timeout=max(0.1, self.deadline - time.monotonic()))
        alive = [p for p in self.procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, f"workers did not finish in {self.timeout_s} s"
        codes = [p.exitcode for p in self.procs]
        assert codes == [0] * len(self.procs), codes
        return [
            torch.load(self.out_dir / f"{self.tag}{r}.pt", weights_only=True)
            for r in range(len(self.procs))
        ]


def start(
    worker: Callable[..., None],
    args: Sequence[tuple[Any, ...]],
    out_dir: Path,
    *,
    preload: Sequence[str],
    timeout_s: float,
    tag: str = "rank",
) -> Run:
    """Start ``worker(*args[rank])`` for each rank from a fork server that has imported
    ``preload`` (the test module's name among them); results are ``<out_dir>/<tag><rank>.pt``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    procs = [ctx.Process(target=worker, args=a, daemon=True) for a in args]
    for p in procs:
        p.start()
    return Run(procs, out_dir, tag, timeout_s)


def counting_backend(count: Callable[[Any], Any], into: list) -> Callable[..., Any]:
    """An aot_eager backend that appends ``count(graph_module)`` to ``into`` for each graph it
    compiles (how many graphs, and which collectives each holds)."""
    from torch._dynamo.backends.registry import lookup_backend

    aot_eager = lookup_backend("aot_eager")

    def backend(gm: Any, example_inputs: Any) -> Any:
        into.append(count(gm))
        return aot_eager(gm, example_inputs)

    return backend


def node_targets(gm: Any) -> list[str]:
    """The targets of every node in ``gm`` and its submodules, as strings."""
    return [str(n.target) for m in gm.modules() if hasattr(m, "graph") for n in m.graph.nodes]
