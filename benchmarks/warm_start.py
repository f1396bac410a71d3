"""Warm start: the first call of a train step in a new process whose compile caches are warm.

    python benchmarks/warm_start.py                  # GPT 4x256 on the CPU, 2 warm rounds
    python benchmarks/warm_start.py --models mlp,gpt --rounds 3

Each variant runs in fresh processes (this script with ``--child``): first once on an empty
``TORCHINDUCTOR_CACHE_DIR`` of its own (the cold compile, which fills the caches), then
``--rounds`` times on the same directory, the variants interleaved (c, d, d+cache, c, ...):

    (c) torch.compile(model) + autocast(bf16) + GradScaler + Adam(foreach=True)
    (d) funcamp.make_train_step: torch's compile caches only (dynamo traces again)
    (d+cache) the same step with ``cache_dir=``: the compiled step is loaded, not traced

For each process it reports the first call, the second call (the step itself) and their
difference, the *warm-start overhead*, with where the first call's time went (torch's compile
timers: dynamo, AOT autograd, inductor). Importing torch and funcamp is not counted (the same
for every variant). bf16 matmuls are emulated on CPUs without AVX512-BF16/AMX, which makes the
step itself slow there; the overhead is what this benchmark is about.
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
VARIANTS = ("c", "d", "d+cache")


def child(args: argparse.Namespace) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(args.dir) / "inductor")
    import torch

    sys.path.insert(0, str(HERE))
    import train_step as ts

    model, batch, criterion = ts.build(args.model, args.device)
    if args.child == "c":
        step = ts.torch_variant(model, batch, criterion, args.device, amp=True, compiled=True)
    else:
        kw = {"cache_dir": str(Path(args.dir) / "steps")} if args.child == "d+cache" else {}
        step = ts.funcamp_variant(model, batch, criterion, args.device, **kw)
    before = ts._phase_totals()
    t0 = time.perf_counter()
    step()
    ts.sync(args.device)
    first = time.perf_counter() - t0
    after = ts._phase_totals()
    t0 = time.perf_counter()
    step()
    ts.sync(args.device)
    second = time.perf_counter() - t0
    from torch._dynamo.utils import counters

    out = {
        "first_s": first,
        "step_s": second,
        "overhead_s": first - second,
        "phases_s": {k: after[k] - before[k] for k in ts.PHASES},
        "traced_frames": int(sum(counters["stats"].values())),
        "torch": torch.__version__,
    }
    print("RESULT " + json.dumps(out), flush=True)


def run_child(variant: str, model: str, directory: Path, device: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", variant, "--model", model]
    cmd += ["--dir", str(directory), "--device", device]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="funcamp warm-start benchmark")
    p.add_argument("--models", default="gpt", help="comma-separated: mlp, gpt, gpt12")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=2, help="warm processes per variant")
    p.add_argument("--require-quiet", action="store_true")
    p.add_argument("--out", type=Path, default=Path("build/bench/warm_start.json"))
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return {}
    sys.path.insert(0, str(HERE))
    import _machine

    results: dict[str, Any] = {"machine": _machine.check(args.require_quiet), "models": {}}
    for model in args.models.split(","):
        root = Path(tempfile.mkdtemp(prefix="funcamp-warm-"))
        runs: dict[str, dict[str, Any]] = {v: {"cold": None, "warm": []} for v in VARIANTS}
        for v in VARIANTS:
            print(f"{model} {v}: cold compile", flush=True)
            runs[v]["cold"] = run_child(v, model, root / v.replace("+", "_"), args.device)
        for r in range(args.rounds):
            for v in VARIANTS:
                print(f"{model} {v}: warm start {r + 1}/{args.rounds}", flush=True)
                runs[v]["warm"].append(run_child(v, model, root / v.replace("+", "_"), args.device))
        results["models"][model] = runs
        print(f"\n{model}: seconds (warm: median of {args.rounds} processes)")
        print("| variant | cold first call | warm first call | step | warm overhead | dynamo |")
        print("|---|---:|---:|---:|---:|---:|")
        for v in VARIANTS:
            warm = runs[v]["warm"]

            def med(k: str, warm: list[dict[str, Any]] = warm) -> float:
                return statistics.median(w[k] for w in warm)

            dyn = statistics.median(w["phases_s"]["dynamo"] for w in warm)
            each = ", ".join(f"{w['overhead_s']:.1f}" for w in warm)
            print(
                f"| {v} | {runs[v]['cold']['first_s']:.1f} | {med('first_s'):.1f} | "
                f"{med('step_s'):.1f} | {med('overhead_s'):.1f} "
                f"({each}) | {dyn:.1f} |"
            )
        loaded = all(w["traced_frames"] == 0 for w in runs["d+cache"]["warm"])
        print(f"d+cache warm processes traced nothing: {loaded}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()
