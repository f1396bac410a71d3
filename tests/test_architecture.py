"""The shape of the package (docs/internals.md, "Layers"): checked, not hoped for.

`lint-imports` (CI) enforces the import-linter contracts of pyproject.toml; here: the layer diagram
of docs/internals.md is the contract's layers in its order, no function imports anything (optional
third-party packages are imported at module level, under ``try``), the execution context is asked
in one module, and the sizes hold (no module over 600 lines, no function over 80 lines of code).
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "funcamp"
MODULES = sorted(PACKAGE.rglob("*.py"))

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")


def _contract_layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return [[m.strip() for m in layer.split("|")] for layer in layers]


def _diagram_layers() -> list[list[str]]:
    text = (ROOT / "docs" / "internals.md").read_text()
    block = text.split("<!-- layers:", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    rows = []
    for line in block.splitlines():
        names = re.findall(r"\bfuncamp\.[\w.]+", line)
        if names and line.lstrip().startswith("funcamp."):
            rows.append(names)
    return rows


def test_the_layer_diagram_is_the_import_linter_contract():
    assert _diagram_layers() == _contract_layers()


#: The library's packages and top-level modules (funcamp.testing sits beside the library).
LIBRARY = sorted(
    [f"funcamp.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py")]
    + [f"funcamp.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"]
)
LIBRARY.remove("funcamp.testing")


def test_every_library_package_is_in_one_layer_and_in_the_forbidden_contract():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layered = [m for layer in _contract_layers() for m in layer]
    assert sorted(layered) == LIBRARY
    (sources,) = [c["source_modules"] for c in config["contracts"] if c["type"] == "forbidden"]
    assert sorted(sources) == LIBRARY


@pytest.mark.parametrize("package", sorted(p.parent for p in PACKAGE.glob("*/__init__.py")))
def test_each_package_says_what_it_owns(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert doc and "TODO" not in doc


def test_import_funcamp_leaves_the_step_cache_and_dynamo_unloaded():
    """The step cache imports dynamo's internals; it is loaded when a step is built with
    ``cache_dir=``, not by ``import funcamp``."""
    probe = (
        "import sys, funcamp; print(sorted(m for m in sys.modules if m.startswith("
        "('funcamp.stepcache', 'torch._dynamo', 'torch._inductor'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


def _imports_in_functions(tree: ast.AST) -> list[tuple[int, str]]:
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                names = child.module if isinstance(child, ast.ImportFrom) else child.names[0].name
                found.append((child.lineno, names))
            visit(child, inside)

    visit(tree, False)
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_inside_a_function(path):
    assert _imports_in_functions(ast.parse(path.read_text())) == []


def test_the_execution_context_is_asked_in_one_module():
    asking = [p for p in MODULES if "is_compiling()" in p.read_text()]
    assert asking == [PACKAGE / "_core" / "context.py"]
    functorch = [p for p in MODULES if "maybe_current_level" in p.read_text()]
    assert functorch == [PACKAGE / "_core" / "context.py"]


def _code_lines(node: ast.AST, lines: list[str]) -> int:
    body = node.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
        if len(body) == 1:
            return 0
        first = body[1]
    code = [lines[i].strip() for i in range(first.lineno - 1, node.end_lineno)]
    return sum(1 for line in code if line and not line.startswith("#"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_sizes(path):
    text = path.read_text()
    lines = text.splitlines()
    assert len(lines) <= 600, f"{path.name}: {len(lines)} lines"
    long = [
        (node.name, _code_lines(node, lines))
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _code_lines(node, lines) > 80
    ]
    assert long == []
