"""How fast funcamp.testing.tensors() generates, against hypothesis.extra.numpy.arrays (issue 60).

    python benchmarks/strategies.py                 # 7 interleaved rounds of 100 examples each

For each shape the guide's users test ((16, 8), (64, 64), (4096,), (8, 128)), each floating dtype
and bounded ([-4, 4], finite) or not, it times ``@given`` runs whose test body does nothing:

* funcamp: ``tensors(dtype=dtype, shape=shape, min_value=..., max_value=...)``;
* stock: ``arrays(np_dtype, shape, elements=st.floats(width=..., min_value=..., ...))`` mapped
  through ``torch.from_numpy`` (float32 arrays rounded by ``.to(torch.bfloat16)`` for bfloat16,
  which numpy lacks), the strategy a user writes with Hypothesis alone.

The two run in interleaved rounds (the order alternating), each round ``--examples`` examples of
the generate phase from one seed, health checks on; it prints the median ms per example of each
and their ratio (funcamp / stock, lower is better; the target is <= 1.5), then the geometric mean
of the ratios. A health check that fails is printed in the row instead of a time.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from hypothesis import Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import FailedHealthCheck
from hypothesis.extra.numpy import arrays

from funcamp.testing import tensors

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine

SHAPES = [(16, 8), (64, 64), (4096,), (8, 128)]
DTYPES = {
    torch.float16: (np.float16, 16),
    torch.bfloat16: (np.float32, 32),
    torch.float32: (np.float32, 32),
    torch.float64: (np.float64, 64),
}
BOUNDED = {"min_value": -4.0, "max_value": 4.0}


def strategies(dtype: torch.dtype, shape: tuple[int, ...], bounded: bool) -> dict:
    bounds = BOUNDED if bounded else {}
    np_dtype, width = DTYPES[dtype]
    stock = arrays(np_dtype, shape, elements=st.floats(width=width, **bounds))
    return {
        "funcamp": tensors(dtype=dtype, shape=shape, **bounds),
        "stock": stock.map(lambda a: torch.from_numpy(a).to(dtype)),
    }


def seconds_per_example(strategy: st.SearchStrategy, examples: int, seed: int) -> float:
    count = [0]

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate])
    @hypothesis_seed(seed)
    @given(strategy)
    def run(x: torch.Tensor) -> None:
        count[0] += 1

    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) / max(count[0], 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--examples", type=int, default=100, help="examples per timed round")
    p.add_argument("--dtypes", default="float16,bfloat16,float32,float64")
    p.add_argument("--require-quiet", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    _machine.check(args.require_quiet)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    print(f"{args.rounds} rounds of {args.examples} examples; ms per example, median\n")
    print("| shape | dtype | bounds | funcamp ms | stock ms | funcamp / stock |")
    print("|---|---|---|---:|---:|---:|")
    ratios = []
    for shape in SHAPES:
        for dtype in dtypes:
            for bounded in (True, False):
                pair = strategies(dtype, shape, bounded)
                times: dict[str, list[float]] = {name: [] for name in pair}
                failed = ""
                for r in range(args.rounds):
                    order = list(pair) if r % 2 == 0 else list(pair)[::-1]
                    for name in order:
                        try:
                            times[name].append(seconds_per_example(pair[name], args.examples, r))
                        except FailedHealthCheck as e:
                            failed = f"{name}: {str(e).splitlines()[0][:60]}"
                    if failed:
                        break
                label = f"| {shape} | {str(dtype)[6:]} | {'[-4, 4]' if bounded else 'none'} |"
                if failed:
                    print(f"{label} health check failed ({failed}) | | |", flush=True)
                    continue
                ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
                ratio = ms["funcamp"] / ms["stock"]
                ratios.append(ratio)
                print(
                    f"{label} {ms['funcamp']:.2f} | {ms['stock']:.2f} | {ratio:.2f} |", flush=True
                )
    geo = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(f"\ngeometric mean funcamp / stock: {geo:.2f}; worst {max(ratios):.2f}")


if __name__ == "__main__":
    main()
