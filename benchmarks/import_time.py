"""``import funcamp`` after ``import torch``: seconds, and which compiler modules it loads.

    python benchmarks/import_time.py                   # this tree, 5 fresh processes
    python benchmarks/import_time.py --against f09c224 --rounds 7

Each measurement is a fresh interpreter that imports torch, then times ``import funcamp`` and
lists the ``torch._dynamo`` / ``torch._inductor`` modules loaded by it. With ``--against REV``
the package as it is at git revision REV (extracted by ``_revision.import_revision`` under its
own name) is timed too, the two sides alternating process by process, so that the machine's
drift hits both alike. Prints the median and spread of each side and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _revision import import_revision  # noqa: E402

_PROBE = """
import json, sys, time
import torch
before = set(sys.modules)
start = time.perf_counter()
import {name}
seconds = time.perf_counter() - start
new = [m for m in sys.modules if m not in before]
print(json.dumps({{
    "seconds": seconds,
    "modules": len(new),
    "compiler_modules": sorted(m for m in new if m.startswith(("torch._dynamo", "torch._inductor"))),
}}))
"""


def probe(name: str, path: str) -> dict:
    """One fresh process importing the package ``name`` found on ``path``."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(name=name)],
        capture_output=True,
        text=True,
        check=True,
        cwd=path,
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "FUNCAMP_QUIET": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--against", default="", help="also time funcamp at this git revision")
    args = p.parse_args(argv)
    sides = {"this tree": ("funcamp", str(_ROOT))}
    if args.against:
        old = import_revision(args.against)
        sides[args.against] = (old.__name__, str(Path(old.__file__).parent.parent))
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, (name, path) in sides.items():
            runs[side].append(probe(name, path))
    summary = {}
    for side, results in runs.items():
        seconds = [r["seconds"] for r in results]
        summary[side] = {
            "median_s": statistics.median(seconds),
            "min_s": min(seconds),
            "max_s": max(seconds),
            "modules": results[-1]["modules"],
            "compiler_modules": len(results[-1]["compiler_modules"]),
        }
        print(
            f"{side:>12}: import {summary[side]['median_s']:.3f} s median "
            f"({summary[side]['min_s']:.3f}-{summary[side]['max_s']:.3f}, {args.rounds} "
            f"processes), {summary[side]['modules']} modules loaded, "
            f"{summary[side]['compiler_modules']} of them torch._dynamo/torch._inductor"
        )
    if args.against:
        ratio = summary["this tree"]["median_s"] / summary[args.against]["median_s"]
        print(f"this tree / {args.against}: {ratio:.2f}")
    return summary


if __name__ == "__main__":
    main()
