"""The ```python blocks of the README's quick start and of the docs run, and stay true.

Each page's blocks run in order in one fresh namespace (later blocks use earlier names), as a
reader would paste them.
"""

from __future__ import annotations

import pathlib
import re
import sys
import types

import pytest
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _readme_quick_start() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## Quick start\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no '## Quick start' section"
    return match.group(1)


def _blocks(text: str) -> list[str]:
    return _BLOCK.findall(text)


def _index_quick_start() -> str:
    text = (ROOT / "docs" / "index.md").read_text()
    match = re.search(r"^## Quick start\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, "docs/index.md has no '## Quick start' section"
    return match.group(1)


# The quick start compiles its step, as users run it; here dynamo traces it whole (fullgraph,
# so a graph break still fails) with the "eager" backend, skipping inductor's code generation
# (most of a compile's time) to keep the suite fast.
_FAST_COMPILE = {
    "make_train_step(loss_fn, opt, policy, donate_state=False)": (
        'make_train_step(loss_fn, opt, policy, compile=funcamp.Compile(backend="eager"), '
        "donate_state=False)"
    )
}


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    """Snippets that write files (checkpoints, TensorBoard runs) write them in a fresh dir."""
    monkeypatch.chdir(tmp_path)


def _run(name: str, text: str, replace: dict[str, str] | None = None) -> dict[str, object]:
    blocks = _blocks(text)
    assert blocks, f"{name} has no ```python blocks"
    # A real module, as for a pasted script: dynamo looks up a compiled function's globals
    # through the module named by its __name__.
    module = types.ModuleType("snippet_" + re.sub(r"\W", "_", name))
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    for i, block in enumerate(blocks):
        for old, new in (replace or {}).items():
            block = block.replace(old, new)
        exec(compile(block, f"{name} [block {i + 1}]", "exec"), namespace)
    return namespace


@pytest.mark.slow
def test_readme_quick_start():
    blocks = _blocks(_readme_quick_start())
    assert len(blocks) == 1, "the README's quick start must be one standalone block"
    _run("README.md#quick-start", _readme_quick_start(), _FAST_COMPILE)
    assert pathlib.Path("checkpoint.pt").exists()


def test_readme_and_docs_share_one_quick_start():
    readme, index = _blocks(_readme_quick_start()), _blocks(_index_quick_start())
    assert readme[0] == index[0], "README.md and docs/index.md quick starts differ"


@pytest.mark.slow
@pytest.mark.parametrize(
    "page",
    [
        "index.md",
        "concepts.md",
        "train-step.md",
        "guides/checkpoints.md",
        "guides/fp8.md",
        "guides/choosing-a-policy.md",
        "guides/transformers.md",
        "guides/writing-an-optimizer.md",
    ],
)
def test_docs_page(page):
    _run(f"docs/{page}", (ROOT / "docs" / page).read_text(), _FAST_COMPILE)


_TB_IMPORT = "from torch.utils.tensorboard import SummaryWriter"
_TB_STANDIN = """
class SummaryWriter:  # stand-in: the tensorboard package is not installed here
    def __init__(self, log_dir):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        pass
"""


def test_migration_guide():
    """Run as written, with TensorBoard when the package is installed (the `test` extra has it),
    else with a stand-in writer that records what the loop logs."""
    try:
        import tensorboard  # noqa: F401

        real = True
    except ImportError:
        real = False
    text = (ROOT / "docs" / "guides" / "migrating.md").read_text()
    assert _TB_IMPORT in text
    replace = dict(_FAST_COMPILE) if real else {**_FAST_COMPILE, _TB_IMPORT: _TB_STANDIN}
    namespace = _run("docs/guides/migrating.md", text, replace)
    if real:
        assert list(pathlib.Path("runs/funcamp").glob("events.out.tfevents.*"))
    else:
        logged = namespace["writer"].scalars
        assert len(logged) == 4 * 12  # 4 metrics for each of the 12 steps
        assert [s for _, _, s in logged[::4]] == list(range(12))


def test_torch_func_recipes_guide():
    """Per-sample gradients, ensembling, Jacobians, the NTK and float16 DP-SGD, each with
    funcamp.amp; the page asserts what it shows."""
    _run(
        "docs/guides/torch-func-recipes.md",
        (ROOT / "docs" / "guides" / "torch-func-recipes.md").read_text(),
    )


def test_property_testing_guide():
    # Fewer examples than the guide's 50, to keep the suite fast; the properties are the same.
    text = (ROOT / "docs" / "guides" / "property-testing.md").read_text()
    _run("docs/guides/property-testing.md", text, {"max_examples=50": "max_examples=8"})


def test_sharded_guide(tmp_path, monkeypatch):
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    monkeypatch.chdir(tmp_path)  # the page writes its checkpoint into the working directory
    text = (ROOT / "docs" / "guides" / "sharded.md").read_text()
    try:
        _run("docs/guides/sharded.md", text)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_data_parallel_guide():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    text = (ROOT / "docs" / "guides" / "data-parallel.md").read_text()
    try:
        _run("docs/guides/data-parallel.md", text)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_composing_a_step_guide():
    """The four hand-written steps (one process, data parallel, sharded, delayed FP8) equal
    make_train_step's bit for bit: the page asserts it."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    text = (ROOT / "docs" / "guides" / "composing-a-step.md").read_text()
    try:
        _run("docs/guides/composing-a-step.md", text)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
