"""What rounding every float16 cast costs a compiled step (issue 51).

    python benchmarks/eager_casts.py                  # 2**20 elements, 15 interleaved rounds

funcamp compiles a low-precision step with inductor's ``emulate_precision_casts=True``
(``funcamp.train.compiling.EAGER_CASTS_OPTIONS``): each float16 result is rounded as eager code
rounds it, where inductor's default keeps a fused product in float32. The cost shows where the
step is elementwise float16 work that inductor fuses, so this times such a step (no matmul: on a
CPU without native half matmuls those dominate any step and hide the difference; the train-step
benchmark's MLP shows that): ``(w.half() * x.half())**2 * g.half()`` summed, mixed_float16,
AdamW (funcamp's generated update), donated state, with the option on (funcamp's default) and off
(``options={"emulate_precision_casts": False}``), the two steps timed in interleaved rounds in
one process. Prints the median ms/step of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import funcamp


def _loss(params, buffers, batch):
    x, g = batch
    h = params["w"].half() * x.half()
    return (h * h * g.half()).float().sum()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=2**20, help="elements of the one param")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=20, help="steps per timed round")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(args.n, generator=gen), torch.randn(args.n, generator=gen) * 1e-3)
    variants = {"emulate (default)": {}, "inductor default": {"emulate_precision_casts": False}}
    runs = {}
    for name, options in variants.items():
        opt = funcamp.adamw(1e-3)
        state = funcamp.TrainState.create(
            {"w": torch.randn(args.n, generator=gen)}, opt, "mixed_float16"
        )
        step = funcamp.make_train_step(
            _loss, opt, "mixed_float16", compile=funcamp.Compile(options=options)
        )
        start = time.perf_counter()
        state, _ = step(state, batch)
        print(f"{name}: first call {time.perf_counter() - start:.1f} s")
        for _ in range(5):
            state, _ = step(state, batch)
        runs[name] = [step, state]
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in runs.items():
            step, state = run
            start = time.perf_counter()
            for _ in range(args.iters):
                state, _ = step(state, batch)
            times[name].append((time.perf_counter() - start) / args.iters * 1e3)
            run[1] = state
    for name, ts in times.items():
        print(
            f"{name:20s} median {statistics.median(ts):8.3f} ms  min {min(ts):8.3f}  max {max(ts):8.3f}"
        )
    on, off = (statistics.median(times[n]) for n in variants)
    print(f"emulate / default: {on / off:.3f} (time ratio, > 1 is slower)")


if __name__ == "__main__":
    main()
