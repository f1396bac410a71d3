"""Every public name has a runnable docstring example and an API reference entry in docs/."""

from __future__ import annotations

import inspect
import pathlib
import re
import sys

import pytest

import funcamp
import funcamp.compiler
import funcamp.distributed
import funcamp.optim
import funcamp.testing

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_DIR = ROOT / "docs" / "api"

PUBLIC = [
    *(("funcamp", name) for name in funcamp.__all__),
    *(("funcamp.distributed", name) for name in funcamp.distributed.__all__),
    *(("funcamp.optim", name) for name in funcamp.optim.__all__),
    *(("funcamp.testing", name) for name in funcamp.testing.__all__),
    *(("funcamp.compiler", name) for name in funcamp.compiler.__all__),
]
MODULES = {
    "funcamp": funcamp,
    "funcamp.distributed": funcamp.distributed,
    "funcamp.optim": funcamp.optim,
    "funcamp.testing": funcamp.testing,
    "funcamp.compiler": funcamp.compiler,
}


def _api_entries() -> set[str]:
    entries = set()
    for page in API_DIR.glob("*.md"):
        entries |= set(re.findall(r"^::: (funcamp[\w.]*)\s*$", page.read_text(), re.MULTILINE))
    return entries


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_name_has_a_docstring_example(module, name):
    obj = getattr(MODULES[module], name)
    doc = inspect.getdoc(obj) or ""
    assert ">>>" in doc, f"{module}.{name} has no docstring example (>>>)"


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_public_name_has_an_api_reference_entry(module, name):
    assert f"{module}.{name}" in _api_entries(), f"add `::: {module}.{name}` to a page in docs/api/"


def test_api_reference_has_no_stale_entries():
    public = {f"{m}.{n}" for m, n in PUBLIC}
    stale = sorted(_api_entries() - public)
    assert not stale, f"docs/api/ documents names that are not public: {stale}"


def test_public_modules_have_docstrings_and_sorted_all():
    for name, module in MODULES.items():
        assert inspect.getdoc(module), name
        assert list(module.__all__) == sorted(module.__all__), name


def test_readme_test_command_runs_the_doctests():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "funcamp" in config["testpaths"]
    assert "--doctest-modules" in config["addopts"].split()


def test_every_docs_page_is_in_the_nav():
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    pages = [
        p.relative_to(ROOT / "docs").as_posix()
        for p in (ROOT / "docs").rglob("*.md")
        if not p.relative_to(ROOT / "docs").as_posix().startswith("_")
    ]
    missing = [p for p in pages if p not in mkdocs]
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {missing}"
