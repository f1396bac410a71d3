"""Write the old-format checkpoints that tests/test_checkpoint_compat.py loads.

Each file is written by funcamp as it was at a past git revision (imported beside the working
tree by benchmarks/_revision.py), from the same deterministic run that the test repeats with the
current code: two AdamW steps of a tiny model under mixed_bfloat16 with dynamic loss scaling.
Run from the repository root: ``python tests/data/old_checkpoints/make.py``. Files are never
rewritten by the tests: a checkpoint a user saved yesterday must load tomorrow.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "benchmarks"))
sys.path.insert(0, str(HERE.parents[1]))

from _revision import import_revision  # noqa: E402
from test_checkpoint_compat import REVISIONS, run  # noqa: E402


def main() -> None:
    for rev, kind in REVISIONS.items():
        fc = import_revision(rev)
        state, _ = run(fc)
        if kind == "state_dict":
            torch.save(fc.state_dict(state), HERE / f"{rev}.state_dict.pt")
        else:
            fc.save(HERE / f"{rev}.save.pt", state, policy="mixed_bfloat16", step=2)
        print("wrote", rev, kind)


if __name__ == "__main__":
    main()
