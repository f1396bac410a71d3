"""Cold compile of a train step in each low-precision optimizer mode, against the plain step.

    python benchmarks/compile_modes.py                      # 4-layer MLP (8 leaves), 2 rounds
    python benchmarks/compile_modes.py --against HEAD~1 --rounds 3
    python benchmarks/compile_modes.py --policy 16-true --modes plain,kahan   # float16 params

Each (mode, revision) compiles in a fresh process (this script with ``--child``) on an empty
``TORCHINDUCTOR_CACHE_DIR`` of its own: the first call of ``funcamp.make_train_step(loss, opt,
"bf16-true", donate_state=False)`` (the pure step, in every revision) with AdamW in bfloat16
params (``--policy 16-true``: float16 params), where ``opt`` is plain, ``master_weights=True``, ``kahan=True`` or ``stochastic_rounding=True``. The
processes are interleaved (every mode of every revision, then the next round); the table gives
the median first call, where it went (torch's compile timers) and its ratio to the plain mode of
the same revision. ``--against REV`` also compiles funcamp as it is at git revision ``REV``
(see ``_revision.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = ("plain", "master_weights", "kahan", "stochastic_rounding")


def child(args: argparse.Namespace) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.dir
    import torch

    sys.path.insert(0, str(HERE))
    import train_step as ts

    if args.rev:
        from _revision import import_revision

        fc = import_revision(args.rev)
    else:
        import funcamp as fc

    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.ReLU())])
    params, buffers = fc.params_and_buffers(model)
    kw = {} if args.mode == "plain" else {args.mode: True}
    opt = fc.adamw(1e-3, **kw)

    def loss_fn(p: Any, b: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        out = torch.func.functional_call(model, (p, b), (x,))
        return torch.nn.functional.mse_loss(out.float(), y)

    # The pure step on both sides: make_train_step donates by default since 2a19e44, and a
    # revision from before would compile another graph.
    step = fc.make_train_step(loss_fn, opt, args.policy, donate_state=False)
    state = fc.TrainState.create(params, opt, args.policy, buffers=buffers)
    batch = (torch.randn(32, args.width), torch.randn(32, args.width))
    before = ts._phase_totals()
    t0 = time.perf_counter()
    state, _ = step(state, batch)
    first = time.perf_counter() - t0
    after = ts._phase_totals()
    t0 = time.perf_counter()
    step(state, batch)
    second = time.perf_counter() - t0
    phases = {k: round(after[k] - before[k], 2) for k in after}
    print(json.dumps({"first_s": first, "second_s": second, "phases": phases}))


def run_child(mode: str, rev: str | None, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="compile_modes_") as d:
        cmd = [sys.executable, __file__, "--child", "--mode", mode, "--dir", d]
        cmd += ["--layers", str(args.layers), "--width", str(args.width), "--policy", args.policy]
        if rev:
            cmd += ["--rev", rev]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="Linear layers (2 leaves each)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--policy", default="bf16-true", help="bf16-true or 16-true (float16 params)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--against", default=None, help="also compile funcamp at this git revision")
    p.add_argument("--require-quiet", action="store_true")
    p.add_argument("--out", default=str(HERE.parent / "build" / "bench" / "compile_modes.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--rev", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return {}
    sys.path.insert(0, str(HERE))
    import _machine

    machine = _machine.check(args.require_quiet)
    modes = [m for m in args.modes.split(",") if m]
    revs: list[str | None] = [None] + ([args.against] if args.against else [])
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for rev in revs:
            for mode in modes:
                key = f"{mode}@{rev or 'working tree'}"
                res = run_child(mode, rev, args)
                runs.setdefault(key, []).append(res)
                print(f"round {r + 1}: {key}: first call {res['first_s']:.1f} s", flush=True)
    print(
        f"\n{args.layers}-layer MLP, width {args.width}, {args.policy} AdamW, cold inductor cache"
    )
    print(f"{'variant':40s} {'first s':>8s} {'/plain':>7s} {'dynamo':>7s} {'codegen':>8s}")
    table = {}
    for key, rs in runs.items():
        mode, rev = key.split("@")
        med = statistics.median(x["first_s"] for x in rs)
        plain = runs.get(f"plain@{rev}")
        ratio = med / statistics.median(x["first_s"] for x in plain) if plain else float("nan")
        dyn = statistics.median(x["phases"]["dynamo"] for x in rs)
        cg = statistics.median(x["phases"]["codegen"] for x in rs)
        table[key] = {"first_s": med, "ratio_to_plain": ratio, "runs": rs}
        print(f"{key:40s} {med:8.1f} {ratio:7.2f} {dyn:7.1f} {cg:8.1f}")
    result = {"machine": machine, "args": vars(args), "table": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
