"""Eager overhead of ``funcamp.amp`` against ``torch.autocast`` (bf16, CPU).

Forward + backward of a 50-layer Linear+ReLU MLP, at width 64 / batch 32 and width 512 /
batch 256. amp and autocast runs are interleaved in one process; the median of the runs is
compared. Targets: ratio <= 1.15 at width 64 and <= 1.05 at width 512.

Run: ``python benchmarks/amp_overhead.py [--runs 30] [--threads 1]`` (one thread by default:
on a shared machine, intra-op threads spin against other processes and drown the overhead).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import funcamp


def make_step(width: int, batch: int, layers: int = 50):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    x = torch.randn(batch, width)

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        return model(x).float().square().mean()

    amp_loss = funcamp.amp(loss_fn, "mixed_bfloat16")

    def with_amp() -> None:
        model.zero_grad(set_to_none=True)
        amp_loss(x).backward()

    def with_autocast() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            loss = loss_fn(x)
        loss.backward()

    return with_amp, with_autocast


def measure(width: int, batch: int, runs: int, inner: int) -> tuple[float, float]:
    with_amp, with_autocast = make_step(width, batch)
    for _ in range(3):
        with_amp()
        with_autocast()
    times: dict[str, list[float]] = {"amp": [], "autocast": []}
    for i in range(runs):
        order = [("amp", with_amp), ("autocast", with_autocast)]
        if i % 2:
            order.reverse()
        for name, step in order:
            start = time.perf_counter()
            for _ in range(inner):
                step()
            times[name].append((time.perf_counter() - start) / inner)
    return statistics.median(times["amp"]), statistics.median(times["autocast"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.runs}")
    for width, batch, inner, target in ((64, 32, 10, 1.15), (512, 256, 2, 1.05)):
        amp_s, autocast_s = measure(width, batch, args.runs, inner)
        ratio = amp_s / autocast_s
        verdict = "ok" if ratio <= target else "MISSES"
        print(
            f"width {width:4d} batch {batch:4d}: amp {amp_s * 1e3:7.3f} ms  "
            f"autocast {autocast_s * 1e3:7.3f} ms  ratio {ratio:.3f} (target <= {target}) {verdict}"
        )


if __name__ == "__main__":
    main()
