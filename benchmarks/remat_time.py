"""What activation checkpointing costs in step time: torch's eager step and funcamp's default
compiled step, each with and without ``checkpoint`` per block, timed side by side in one process.

    python benchmarks/remat_time.py                 # gptlong (d=128, 4 layers, batch 8 x 512)
    python benchmarks/remat_time.py --rounds 7 --steps 3

The models and steps are benchmarks/memory.py's (``make_step``): Adam, bf16 compute, dynamic
loss scaling on both sides. Every variant is built and warmed up first (funcamp's compile
included), then the variants run interleaved, ``--steps`` steps each per round, for ``--rounds``
rounds; the table gives each variant's median ms per step and the recompute's cost, the
checkpointed step's time over the same side's plain step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import _machine  # noqa: E402
import memory  # noqa: E402
import torch  # noqa: E402

VARIANTS = ("torch_eager", "torch_eager_ckpt", "funcamp_donated", "funcamp_donated_ckpt")


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gptlong")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench" / "remat_time.json")
    args = p.parse_args(argv)
    _machine.check(require_quiet=False)  # timings need a quiet machine: the report says
    steps = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model, batch, forward_loss = memory.build_model(args.model, "cpu")
        steps[variant] = memory.make_step(variant, model, batch, forward_loss, "cpu")
        for _ in range(2):  # the first call compiles; the second is warm
            steps[variant]()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[variant]()
            times[variant].append((time.perf_counter() - t0) / args.steps * 1e3)
    med = {v: statistics.median(t) for v, t in times.items()}
    spread = {v: (min(t), max(t)) for v, t in times.items()}
    for v in VARIANTS:
        print(f"  {v:24s} {med[v]:8.1f} ms/step  (min {spread[v][0]:.1f}, max {spread[v][1]:.1f})")
    out = {
        **{f"ms_{v}": med[v] for v in VARIANTS},
        "torch_ckpt_over_plain": med["torch_eager_ckpt"] / med["torch_eager"],
        "funcamp_ckpt_over_plain": med["funcamp_donated_ckpt"] / med["funcamp_donated"],
        "funcamp_ckpt_over_torch_ckpt": med["funcamp_donated_ckpt"] / med["torch_eager_ckpt"],
    }
    for key in ("torch_ckpt_over_plain", "funcamp_ckpt_over_plain", "funcamp_ckpt_over_torch_ckpt"):
        print(f"  {key:32s} {out[key]:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
