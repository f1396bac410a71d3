"""Benchmark: every funcamp optimizer with a torch.optim counterpart, against that class.

Every optimizer of torch's ``optim_db`` that funcamp has (LBFGS aside: its step is a loop of
loss evaluations; Lion has no torch.optim class), on a small transformer-shaped set of float32
params (2 blocks of d=256 with biases and layer norms, a 512-token embedding and head: 26
tensors, 1.84 M elements; ``--quick``: d=128, 0.53 M; Muon gets only the 2-D matrices, as
``torch.optim.Muon`` requires, a quarter as wide: see ``WIDTH_DIVISOR``) and fixed random
gradients. Variants of each optimizer:

    torch            torch.optim.<Class>(params, foreach=True).step()  (Muon: its only path)
    funcamp          opt.update + funcamp.apply_updates: pure, new params and state
    funcamp_donated  funcamp.unscale_and_step(ScalerState.noop(), ..., donate_state=True,
                     grad_norm=False): written into the old params and state, as torch.optim
                     does, plus the inf/nan check torch.optim does not do (one read of the grads)
    torch_compiled   torch.compile(optimizer.step)  (torch's "compile the optimizer" recipe)
    funcamp_compiled torch.compile(fullgraph=True) of funcamp_donated's step: a hand-written
                     loop's compiled step (torch's compiler as is: funcamp's compiler patches
                     act only inside make_train_step)

The variants of one optimizer run in one process, in interleaved rounds (their order reversed
every other round), each round ``--iters`` steps of each; a ratio is funcamp's time over
torch's in the same round and mode (eager or compiled), reported as the median over the rounds
with the rounds' min-max spread. The compiled pair's first calls are timed on an empty inductor
cache (a fresh ``TORCHINDUCTOR_CACHE_DIR`` for the run; one throwaway compile first pays
inductor's one-time costs, its C++ header included). After the timed steps every variant has
taken the same steps from the same gradients, and its params are checked against torch's eager
ones (``allclose``): a row never compares different work.

    python benchmarks/optimizers.py                    # all 14, eager and compiled
    python benchmarks/optimizers.py --quick            # d=128, fewer rounds, compiled: adamw
    python benchmarks/optimizers.py --only adamw muon --no-compiled
    python benchmarks/optimizers.py --require-quiet    # stop (exit 3) on a busy machine

On a 2-core AMD EPYC shared with other jobs (load average 5-10) a full run took 35 minutes,
12.5 of them in the 28 first calls (cold compiles), and ``--quick`` 3 (docs/benchmarks.md).
Writes JSON to ``--out`` (default ``build/bench/optimizers.json``). bfloat16 is not used
except inside Muon's Newton-Schulz iteration (``torch.optim.Muon`` runs it in bfloat16, and so
does ``funcamp.muon``): on a CPU without AVX512-BF16 that part is emulated on both sides.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._logging
from torch._dynamo.utils import counters

import funcamp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine

#: name -> (torch class, its kwargs, the funcamp optimizer with the same hyper-parameters).
CASES: dict[str, tuple[type, dict[str, Any], Callable[[], funcamp.Optimizer]]] = {
    "sgd": (torch.optim.SGD, {"lr": 1e-2}, lambda: funcamp.sgd(1e-2)),
    "sgd (momentum 0.9)": (
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
NO_FOREACH = {"muon"}  # torch.optim.Muon has one path (no foreach)
MATRICES_ONLY = {"muon"}
# Muon's Newton-Schulz matmuls cost ~d^3 a step (emulated bfloat16 on a CPU without
# AVX512-BF16: ~1.6 s a step at d=128 on a 2-core AMD EPYC): its params are d // 4 wide.
WIDTH_DIVISOR = {"muon": 4}
# How far funcamp's params may be from torch.optim's eager ones after the timed steps (the
# differential tests hold them much closer; this only guards against timing different work).
# Muon: bfloat16 Newton-Schulz, whose rounding inductor may change.
TOLERANCE = {"muon": (1e-3, 1e-3)}
DEFAULT_TOLERANCE = (1e-4, 1e-5)  # rtol, atol


def param_shapes(d: int) -> dict[str, tuple[int, ...]]:
    """Two transformer blocks of width ``d`` (biases, layer norms), a 512-token embedding and
    an untied head, in ``model.named_parameters()`` order."""
    shapes: dict[str, tuple[int, ...]] = {"tok.weight": (512, d)}
    for b in range(2):
        p = f"blocks.{b}."
        shapes |= {
            p + "ln1.weight": (d,), p + "ln1.bias": (d,),
            p + "qkv.weight": (3 * d, d), p + "qkv.bias": (3 * d,),
            p + "proj.weight": (d, d), p + "proj.bias": (d,),
            p + "ln2.weight": (d,), p + "ln2.bias": (d,),
            p + "fc.weight": (4 * d, d), p + "fc.bias": (4 * d,),
            p + "out.weight": (d, 4 * d), p + "out.bias": (d,),
        }  # fmt: skip
    shapes["head.weight"] = (512, d)
    return shapes


def make_inputs(name: str, d: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Seeded params and gradients (the same for every variant; each gets its own copies)."""
    shapes = param_shapes(d // WIDTH_DIVISOR.get(name, 1))
    if name in MATRICES_ONLY:
        shapes = {k: s for k, s in shapes.items() if len(s) == 2}
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen) * 1e-2 for k, s in shapes.items()}
    return params, grads


class Variant:
    """One way to run an optimizer: ``step()`` takes one step; ``params()`` the current ones."""

    def __init__(self, step: Callable[[], Any], params: Callable[[], dict[str, torch.Tensor]]):
        self.step, self.params = step, params


def torch_variant(name: str, d: int, compiled: bool) -> Variant:
    cls, kwargs, _ = CASES[name]
    params, grads = make_inputs(name, d)
    named = {k: torch.nn.Parameter(v) for k, v in params.items()}
    for k, p in named.items():
        p.grad = grads[k]
    extra = {} if name in NO_FOREACH else {"foreach": True}
    opt = cls(list(named.values()), **kwargs, **extra)
    step = torch.compile(opt.step) if compiled else opt.step
    return Variant(step, lambda: {k: p.detach() for k, p in named.items()})


def funcamp_variant(name: str, d: int, *, donated: bool, compiled: bool) -> Variant:
    opt = CASES[name][2]()
    params, grads = make_inputs(name, d)
    box = [params, opt.init(params)]
    if donated:
        scaler = funcamp.ScalerState.noop()

        def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
            params, state, _ = funcamp.unscale_and_step(
                scaler, opt, grads, state, params, donate_state=True, grad_norm=False
            )
            return params, state

    else:

        def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
            updates, state = opt.update(grads, state, params)
            return funcamp.apply_updates(params, updates), state

    fn = torch.compile(step, fullgraph=True) if compiled else step

    def run() -> None:
        box[0], box[1] = fn(box[0], box[1], grads)

    return Variant(run, lambda: box[0])


#: variant name -> (the torch variant it is compared with, whether compiled)
VARIANTS = {
    "torch": ("torch", False),
    "funcamp": ("torch", False),
    "funcamp_donated": ("torch", False),
    "torch_compiled": ("torch_compiled", True),
    "funcamp_compiled": ("torch_compiled", True),
}


def build(name: str, variant: str, d: int) -> Variant:
    compiled = VARIANTS[variant][1]
    if variant.startswith("torch"):
        return torch_variant(name, d, compiled)
    return funcamp_variant(name, d, donated=variant != "funcamp", compiled=compiled)


def bench_one(name: str, compiled: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Build, first-call and time every variant of optimizer ``name``, then check the params."""
    torch._dynamo.reset()  # torch.optim's step wrapper is one code object for every class
    names = [v for v in VARIANTS if compiled or not VARIANTS[v][1]]
    variants: dict[str, Variant] = {}
    first: dict[str, dict[str, Any]] = {}
    order = names if args.seed % 2 == 0 else names[::-1]
    for v in order:
        variants[v] = build(name, v, args.d)
        counters.clear()
        t0 = time.perf_counter()
        variants[v].step()
        first[v] = {"first_call_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            variants[v].step()
        first[v]["warmup_step_ms"] = (time.perf_counter() - t0) / max(args.warmup, 1) * 1e3
        first[v]["graphs"] = int(counters["stats"]["unique_graphs"])
        first[v]["graph_breaks"] = int(sum(counters["graph_break"].values()))
    times: dict[str, list[float]] = {v: [] for v in names}
    counters.clear()
    for r in range(args.rounds):
        for v in names if r % 2 == 0 else names[::-1]:
            step = variants[v].step
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            times[v].append((time.perf_counter() - t0) / args.iters * 1e3)
    recompiled = int(counters["stats"]["unique_graphs"])
    # The same work: every variant took 1 + warmup + rounds * iters steps from the same grads.
    reference = variants["torch"].params()
    rtol, atol = TOLERANCE.get(name, DEFAULT_TOLERANCE)
    max_diff = {}
    for v in names:
        got = variants[v].params()
        diffs = [(got[k] - reference[k]).abs().max().item() for k in reference]
        max_diff[v] = max(diffs)
        for k in reference:
            if not torch.allclose(got[k], reference[k], rtol=rtol, atol=atol):
                raise AssertionError(
                    f"{name}: {v}'s {k} differs from torch.optim's eager result by up to "
                    f"{(got[k] - reference[k]).abs().max().item():.3g} (rtol {rtol}, atol {atol})"
                )
    rows: dict[str, Any] = {}
    for v in names:
        base = VARIANTS[v][0]
        ratios = [a / b for a, b in zip(times[v], times[base])]
        rows[v] = {
            "median_ms": statistics.median(times[v]),
            "min_ms": min(times[v]),
            "max_ms": max(times[v]),
            "rounds_ms": times[v],
            **first[v],
            "ratio_to": base,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "max_abs_diff_to_torch_eager": max_diff[v],
        }
    n = sum(p.numel() for p in reference.values())
    return {"elements": n, "tensors": len(reference), "rows": rows, "recompiled": recompiled}


def _warm_compiler() -> float:
    """One throwaway compile: inductor's one-time costs (imports, the C++ header) out of the
    first timed first call."""
    t0 = time.perf_counter()
    torch.compile(lambda x: (x * 2).sin() + 1)(torch.randn(8))
    torch._dynamo.reset()
    return time.perf_counter() - t0


def print_row(name: str, result: dict[str, Any], compiled_columns: bool) -> None:
    rows = result["rows"]

    def cell(v: str) -> str:
        r = rows[v]
        spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        return f"| {r['median_ms']:.2f} | {r['ratio_median']:.2f} ({spread}) "

    tc, fc = rows.get("torch_compiled"), rows.get("funcamp_compiled")
    if tc and fc and tc["graph_breaks"] + fc["graph_breaks"]:
        name += f" (graph breaks: torch {tc['graph_breaks']}, funcamp {fc['graph_breaks']})"
    line = f"| {name} | {rows['torch']['median_ms']:.2f} " + cell("funcamp")
    line += cell("funcamp_donated")
    if tc and fc:
        line += f"| {tc['median_ms']:.2f} " + cell("funcamp_compiled")
        line += f"| {tc['first_call_s']:.1f} | {fc['first_call_s']:.1f} "
    elif compiled_columns:
        line += "| - | - | - | - | - "
    print(line + "|", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="d=128, 5 rounds of 3 steps, compiled: adamw only"
    )
    p.add_argument("--d", type=int, default=None, help="block width (default 256; quick 128)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 9)")
    p.add_argument("--iters", type=int, default=None, help="steps per round (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first call")
    p.add_argument(
        "--compiled",
        nargs="*",
        default=None,
        help="the optimizers that also get the compiled pair (default: all; --quick: adamw)",
    )
    p.add_argument("--no-compiled", dest="compiled", action="store_const", const=[])
    p.add_argument("--only", nargs="*", default=None, help=f"some of: {', '.join(CASES)}")
    p.add_argument("--seed", type=int, default=0, help="odd: build the variants in reverse")
    p.add_argument("--require-quiet", action="store_true")
    p.add_argument("--out", type=Path, default=Path("build/bench/optimizers.json"))
    args = p.parse_args(argv)
    args.d = args.d or (128 if args.quick else 256)
    args.rounds = args.rounds or (5 if args.quick else 9)
    args.iters = args.iters or (3 if args.quick else 5)
    args.only = args.only or list(CASES)
    if args.compiled is None:
        args.compiled = ["adamw"] if args.quick else list(args.only)
    unknown = sorted({n for n in args.only + args.compiled if n not in CASES})
    if unknown:
        p.error(f"--only/--compiled: unknown {unknown}; choose from {list(CASES)}")
    machine = _machine.check(args.require_quiet)
    # Dynamo's graph-break warnings (torch.optim.Adafactor's .item()): counted in the table.
    torch._logging.set_logs(dynamo=logging.ERROR)
    compiling = any(n in args.compiled for n in args.only)
    # The first calls compile on an empty cache of their own (unless one is given).
    own_cache = None
    if compiling and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        own_cache = tempfile.mkdtemp(prefix="funcamp-optimizers-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = own_cache
    try:
        return _run(args, machine, compiling)
    finally:
        if own_cache is not None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
            shutil.rmtree(own_cache, ignore_errors=True)


def _run(args: argparse.Namespace, machine: dict[str, Any], compiling: bool) -> dict[str, Any]:
    header = _warm_compiler() if compiling else 0.0
    n = sum(int(torch.Size(s).numel()) for s in param_shapes(args.d).values())
    print(
        f"{n:,} float32 elements in {len(param_shapes(args.d))} tensors (Muon: the 2-D ones), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds x "
        f"{args.iters} steps; median ms/step and funcamp/torch (rounds' min-max)"
        + (f"; compiler warmed in {header:.1f} s" if compiling else ""),
        flush=True,
    )
    head = "| optimizer | torch.optim foreach | funcamp pure | ratio | funcamp donated | ratio "
    rule = "|---|---:|---:|---:|---:|---:"
    if compiling:
        head += (
            "| torch compiled | funcamp compiled | ratio | 1st call torch s | 1st call funcamp s "
        )
        rule += "|---:|---:|---:|---:|---:"
    print(head + "|\n" + rule + "|", flush=True)
    results: dict[str, Any] = {"machine": machine, "args": vars(args) | {"out": str(args.out)}}
    results["optimizers"] = {}
    for name in args.only:
        results["optimizers"][name] = res = bench_one(name, name in args.compiled, args)
        print_row(name, res, compiling)
        if res["recompiled"]:
            print(f"  ({name}: {res['recompiled']} graphs compiled while timing)")
    print("every variant's params agree with torch.optim's eager ones (allclose)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
