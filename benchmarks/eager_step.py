"""The eager step against torch's eager recipe, side by side, with the numbers compared.

    python benchmarks/eager_step.py                       # MLP and GPT, bfloat16 and float32
    python benchmarks/eager_step.py --models mlp --compute float32 --rounds 15

torch's recipe is the one its docs teach: ``zero_grad``, the forward under
``torch.autocast("cpu", bfloat16)`` (none for ``--compute float32``), ``backward``, the global
gradient norm (``clip_grad_norm_`` with an infinite bound: the norm a training loop logs) and
``torch.optim.AdamW`` at its defaults. funcamp's is ``make_train_step(loss_fn, funcamp.adamw(),
policy, compile=False)`` with the policy whose casts are autocast's (``ops=autocast_cpu``); its
metrics hold the loss and the same norm. ``--fused`` runs ``AdamW(fused=True)`` on both sides.

Both sides are timed in interleaved rounds (torch, funcamp, torch, ...) in one process, so
background load hits them alike; the median ms/step of each round and the ratio funcamp/torch
are printed with the machine (``_machine.report``). After the timing both runs have taken the
same number of steps from the same start: the script prints the largest difference between
their params (0 when funcamp's numbers are torch's). On a CPU without AVX512-BF16 every bfloat16
matmul is emulated and dominates both sides: read the float32 rows there.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch
import torch.nn as nn
from _machine import report
from torch.func import functional_call
from train_step import build

import funcamp

POLICIES = {
    "bfloat16": "params=float32,compute=bfloat16,output=float32,ops=autocast_cpu",
    "float32": "float32",
}


def torch_side(model: nn.Module, batch: Any, criterion: Any, compute: str, fused: bool) -> Any:
    opt = torch.optim.AdamW(model.parameters(), fused=True if fused else None)
    params = list(model.parameters())
    x, y = batch
    enabled = compute == "bfloat16"

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            loss = criterion(model(x), y)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(params, float("inf"))
        opt.step()
        return norm

    return step


def funcamp_side(model: nn.Module, batch: Any, criterion: Any, compute: str, fused: bool) -> Any:
    policy = funcamp.get_policy(POLICIES[compute])
    opt = funcamp.adamw(1e-3, fused=fused)

    def loss_fn(params: Any, buffers: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return criterion(functional_call(model, (params, buffers), (x,)), y)

    params, buffers = funcamp.params_and_buffers(model)
    params = {k: v.detach().clone() for k, v in params.items()}
    box = [funcamp.TrainState.create(params, opt, policy, buffers=buffers)]
    step_fn = funcamp.make_train_step(loss_fn, opt, policy, compile=False)

    def step() -> torch.Tensor:
        box[0], metrics = step_fn(box[0], batch)
        return metrics["grad_norm"]

    return step, box


def bench(name: str, compute: str, args: argparse.Namespace) -> dict[str, Any]:
    model, batch, criterion = build(name, "cpu")
    ours = copy.deepcopy(model)
    sides = {
        "torch": torch_side(model, batch, criterion, compute, args.fused),
    }
    sides["funcamp"], box = funcamp_side(ours, batch, criterion, compute, args.fused)
    for _ in range(args.warmup):
        for step in sides.values():
            step()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for k, step in sides.items():
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            times[k].append((time.perf_counter() - t0) / args.iters * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    diff = max(
        (box[0].params[k] - p.detach()).abs().max().item() for k, p in model.named_parameters()
    )
    return {
        "model": name,
        "compute": compute,
        "fused": args.fused,
        "torch_ms": med["torch"],
        "funcamp_ms": med["funcamp"],
        "ratio": med["funcamp"] / med["torch"],
        "spread": {k: (min(v), max(v)) for k, v in times.items()},
        "steps": args.warmup + args.rounds * args.iters,
        "max_param_diff": diff,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,gpt")
    p.add_argument("--compute", default="bfloat16,float32")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True) on both sides")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: as is)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(report(), indent=None))
    results = []
    for name in args.models.split(","):
        for compute in args.compute.split(","):
            r = bench(name, compute, args)
            results.append(r)
            print(
                f"{name:4} {compute:9} fused={args.fused!s:5} torch {r['torch_ms']:8.2f} ms  "
                f"funcamp {r['funcamp_ms']:8.2f} ms  ratio {r['ratio']:.3f}  "
                f"params after {r['steps']} steps differ by {r['max_param_diff']:.3g}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
