"""What machine a benchmark ran on, and whether it was quiet enough to time anything.

Timings on a machine that is busy with something else (a test run, a compile, another
benchmark) are noise: :func:`report` names the CPU (model, the vector ISA torch uses, cores), and
samples for one second how busy the machine is apart from this process, listing the other
processes that used CPU meanwhile. Benchmarks print it before timing and store it with their
results; ``--require-quiet`` makes them stop instead of timing on a busy machine.

Linux only for the load sample (``/proc``); elsewhere the report says it could not tell.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

# Other processes may use this much of one core, together, for the machine to count as quiet.
QUIET_BUSY_CORES = 0.15


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _proc_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (command name, user+system clock ticks) for every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry.name)] = (name, int(fields[11]) + int(fields[12]))
    return out


def _busy(seconds: float) -> tuple[float, list[tuple[str, int, float]]] | None:
    """CPU used by other processes over ``seconds``, in cores, and the busiest of them."""
    if not Path("/proc/stat").exists():
        return None
    hz = os.sysconf("SC_CLK_TCK")
    before = _proc_ticks()
    time.sleep(seconds)
    after = _proc_ticks()
    me = os.getpid()
    used = []
    for pid, (name, ticks) in after.items():
        if pid == me or pid not in before:
            continue
        cores = (ticks - before[pid][1]) / hz / seconds
        if cores > 0.01:
            used.append((name, pid, cores))
    used.sort(key=lambda t: -t[2])
    return sum(c for _, _, c in used), used[:5]


def report(seconds: float = 1.0) -> dict[str, Any]:
    """The machine, and how busy it was for ``seconds`` apart from this process."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if hasattr(os, "getloadavg"):
        info["load_average_1m"] = os.getloadavg()[0]
    sample = _busy(seconds)
    if sample is None:
        info["quiet"] = None
        return info
    cores, top = sample
    info["other_processes_cores"] = round(cores, 3)
    info["other_processes"] = [f"{name}[{pid}] {c:.2f} cores" for name, pid, c in top]
    info["quiet"] = cores <= QUIET_BUSY_CORES
    return info


def describe(info: dict[str, Any]) -> str:
    """One paragraph for a benchmark's output."""
    text = (
        f"machine: {info['cpu']} ({info['cpu_capability']}, {info['cores']} cores, torch "
        f"{info['torch']} on {info['torch_threads']} threads)"
    )
    if info.get("quiet") is None:
        return text + "; could not sample the load"
    state = "quiet" if info["quiet"] else "NOT QUIET: timings below are unreliable"
    text += (
        f"; {state}: other processes used {info['other_processes_cores']:.2f} cores over the "
        f"sample (limit {QUIET_BUSY_CORES}), load average {info.get('load_average_1m', 0):.2f}"
    )
    if not info["quiet"]:
        text += "; busiest: " + ", ".join(info["other_processes"])
    return text


def check(require_quiet: bool) -> dict[str, Any]:
    """Print the report; with ``require_quiet``, exit (status 3) when the machine is busy."""
    info = report()
    print(describe(info), flush=True)
    if require_quiet and info.get("quiet") is False:
        raise SystemExit(3)
    return info
