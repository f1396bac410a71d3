"""The mutation suite of funcamp.testing: which seeded mixed-precision bugs its strategies catch,
against stock Hypothesis's, and at what cost (issue 60).

    python benchmarks/mutations.py                  # 3 seeds x 200 examples, every mutant
    python benchmarks/mutations.py --seeds 10 --only sum_f16,f16_overflow_check

Each mutant of tests/mutants.py (a small mixed-precision function in a correct and a buggy
version, and one property) runs its property, generation only, for each seed:

* on the buggy version, with funcamp.testing's strategies and with stock Hypothesis's
  (``hypothesis.extra.numpy.arrays`` of ``st.floats`` with the same bounds); a failure within
  ``--examples`` examples is a catch, and the row shows at which example each seed caught it;
* on the correct version, with both: a failure is a false alarm. These runs go the whole
  ``--examples``, and their time is the row's time per property: the median over the seeds (and
  ``--rounds``) of each family's time, and of the ratio of the two, timed one after the other,
  the order alternating.

The summary gives the bugs caught on every seed, the runs that caught, the false alarms, and the
geometric mean and worst of the time ratios (funcamp / stock; the target is <= 1.5).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import _machine
from mutants import MUTANTS
from mutation_suite import FAMILIES, Mutant, run


def measure(m: Mutant, seeds: int, examples: int, rounds: int) -> dict:
    out: dict = {f: {"caught": [], "false": 0, "seconds": []} for f in FAMILIES}
    ratios = []
    for seed in range(seeds):
        for family in FAMILIES:
            bug = run(m, m.buggy, family, seed, examples)
            out[family]["caught"].append(bug.examples if bug.failed else None)
        for r in range(rounds):
            seconds = {}
            for family in FAMILIES if (seed + r) % 2 == 0 else FAMILIES[::-1]:
                ok = run(m, m.correct, family, seed, examples)
                out[family]["false"] += ok.failed
                out[family]["seconds"].append(ok.seconds)
                seconds[family] = ok.seconds
            ratios.append(seconds["funcamp"] / seconds["stock"])
    out["ratio"] = statistics.median(ratios)
    return out


def _caught(caught: list) -> str:
    hits = sum(c is not None for c in caught)
    return f"{hits}/{len(caught)} ({', '.join('-' if c is None else str(c) for c in caught)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--examples", type=int, default=200)
    p.add_argument("--rounds", type=int, default=1, help="timed runs of the correct code per seed")
    p.add_argument("--only", default="", help="comma-separated mutant names")
    p.add_argument("--require-quiet", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    _machine.check(args.require_quiet)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    print(f"{len(mutants)} mutants, {args.seeds} seeds x {args.examples} examples\n")
    print(
        "| bug | funcamp: caught (at example) | stock: caught (at example) | false alarms "
        "| s per property, funcamp / stock | ratio |"
    )
    print("|---|---|---|---:|---:|---:|")
    totals = {f: {"every": 0, "runs": 0, "false": 0} for f in FAMILIES}
    ratios, worse = [], []
    for m in mutants:
        res = measure(m, args.seeds, args.examples, args.rounds)
        t = {f: statistics.median(res[f]["seconds"]) for f in FAMILIES}
        ratio = res["ratio"]
        ratios.append(ratio)
        for f in FAMILIES:
            hits = sum(c is not None for c in res[f]["caught"])
            totals[f]["every"] += hits == args.seeds
            totals[f]["runs"] += hits
            totals[f]["false"] += res[f]["false"]
        hits = {f: sum(c is not None for c in res[f]["caught"]) for f in FAMILIES}
        if hits["funcamp"] < hits["stock"]:
            worse.append(m.name)
        print(
            f"| {m.bug} | {_caught(res['funcamp']['caught'])} | {_caught(res['stock']['caught'])} "
            f"| {res['funcamp']['false']} / {res['stock']['false']} "
            f"| {t['funcamp']:.2f} / {t['stock']:.2f} | {ratio:.2f} |",
            flush=True,
        )
    n, runs = len(mutants), len(mutants) * args.seeds
    print()
    for f in FAMILIES:
        c = totals[f]
        print(
            f"{f}: {c['every']} of {n} bugs caught on every seed, {c['runs']} of {runs} runs "
            f"caught, {c['false']} false alarms on the correct code"
        )
    geo = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(f"time per property, funcamp / stock: geometric mean {geo:.2f}, worst {max(ratios):.2f}")
    print(f"bugs funcamp catches less often than stock: {', '.join(worse) or 'none'}")


if __name__ == "__main__":
    main()
