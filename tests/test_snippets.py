"""The ```python blocks of the README's quick start and of the docs run, and stay true.

Each page's blocks run in order in one fresh namespace (later blocks use earlier names), as a
reader would paste them.
"""

from __future__ import annotations

import pathlib
import re

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


def _run(name: str, text: str, replace: dict[str, str] | None = None) -> None:
    blocks = _blocks(text)
    assert blocks, f"{name} has no ```python blocks"
    namespace: dict[str, object] = {"__name__": f"snippet:{name}"}
    for i, block in enumerate(blocks):
        for old, new in (replace or {}).items():
            block = block.replace(old, new)
        exec(compile(block, f"{name} [block {i + 1}]", "exec"), namespace)


def test_readme_quick_start():
    _run("README.md#quick-start", _readme_quick_start())


@pytest.mark.parametrize(
    "page",
    [
        "index.md",
        "concepts.md",
        "guides/migrating.md",
        "guides/checkpoints.md",
        "guides/fp8.md",
    ],
)
def test_docs_page(page):
    _run(f"docs/{page}", (ROOT / "docs" / page).read_text())


def test_property_testing_guide():
    # Fewer examples than the guide's 50, to keep the suite fast; the properties are the same.
    text = (ROOT / "docs" / "guides" / "property-testing.md").read_text()
    _run("docs/guides/property-testing.md", text, {"max_examples=50": "max_examples=8"})


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
