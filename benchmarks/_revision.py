"""Import another git revision of funcamp beside the working one, for same-process A/B timing.

``import_revision("main")`` extracts ``funcamp/`` as it is at that revision into
``build/bench/revisions/``, renames the package to ``funcamp_at_<sha>`` (its own imports and its
``torch.library`` namespace), imports it and returns the module. Both versions then run in one
process, on one machine state, in interleaved rounds -- the only fair way to call a change "no
regression" on a machine whose speed drifts by several percent from one minute to the next.
"""

from __future__ import annotations

import importlib
import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
_COMPILE_FIELDS = (
    "backend", "mode", "fullgraph", "dynamic", "options", "guard_filter_fn", "cache_dir",
    "specialize", "compiler_patches",
)  # fmt: skip
_IMPORT = re.compile(r"\b(from|import)(\s+)funcamp\b")


def step_options(fc: ModuleType, options: dict[str, Any]) -> dict[str, Any]:
    """``make_train_step``'s keywords for the funcamp module ``fc``: the compile options
    (``backend=``, ``cache_dir=``, ...) as ``compile=fc.Compile(...)``; kept as keywords for a
    revision from before ``funcamp.Compile``."""
    fields = {k: v for k, v in options.items() if k in _COMPILE_FIELDS}
    rest = {k: v for k, v in options.items() if k not in _COMPILE_FIELDS}
    if not fields or not hasattr(fc, "Compile"):
        return {**rest, **fields}
    return {**rest, "compile": fc.Compile(**fields)}


def import_revision(rev: str) -> ModuleType:
    """funcamp as it is at git revision ``rev`` (a branch, tag or commit), as its own package."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short=10", rev], cwd=_ROOT, check=True, capture_output=True,
        text=True,
    ).stdout.strip()  # fmt: skip
    name = f"funcamp_at_{sha}"
    if name in sys.modules:
        return sys.modules[name]
    base = _ROOT / "build" / "bench" / "revisions"
    pkg = base / name
    if not pkg.exists():
        blob = subprocess.run(
            ["git", "archive", "--format=tar", sha, "funcamp"], cwd=_ROOT, check=True,
            capture_output=True,
        ).stdout  # fmt: skip
        tmp = base / f".{name}.tmp"
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            tar.extractall(tmp, filter="data")
        for f in (tmp / "funcamp").rglob("*.py"):
            text = _IMPORT.sub(lambda m: f"{m[1]}{m[2]}{name}", f.read_text())
            text = text.replace("funcamp::", f"{name}::")
            f.write_text(text.replace("torch.ops.funcamp", f"torch.ops.{name}"))
        (tmp / "funcamp").rename(pkg)
        tmp.rmdir()
    if str(base) not in sys.path:
        sys.path.insert(0, str(base))
    return importlib.import_module(name)
