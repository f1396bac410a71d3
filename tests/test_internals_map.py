"""docs/internals.md's maps, checked against the code: a map a test keeps true.

* "Where to change what": every file a row names exists, and every name in the parentheses
  right after a Python file (`` `scaling/skip.py` (`Skip`: ...) ``) is defined in it.
* "Workarounds": each row's line count is the length of the modules it names (a directory: its
  ``.py`` files). On failure the test prints the table with the right counts;
  ``python tests/test_internals_map.py`` writes them into the page.
* Every module of ``funcamp`` that reaches into torch's private namespace (names ``torch._x``,
  imported or as an attribute; torch's documented ``torch._foreach_*`` ops excepted) carries
  the workaround header (root cause, upstream, why it is safe, tested versions, when to delete
  it), and so appears in the workaround table; so does every module with the header.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "funcamp"
PAGE = ROOT / "docs" / "internals.md"
HEADER = "Workaround of torch internals"
BULLETS = ("- Root cause:", "- Upstream:", "- Why it is safe:", "- Tested on:", "- Delete when:")
#: torch names that look private but are torch's documented API (the multi-tensor ops
#: torch.optim is written in), or are not names at all (dunders).
PUBLIC = re.compile(r"^(_foreach_\w+|__\w+__)$")


def _section(title: str) -> str:
    text = PAGE.read_text()
    match = re.search(rf"^## {re.escape(title)}.*?\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/internals.md has no '## {title}' section"
    return match.group(1)


def _rows(section: str) -> list[list[str]]:
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return [c for c in cells[2:]]  # past the header and its rule


def _path(token: str) -> pathlib.Path:
    """A path as the tables write it: from the repository root when it starts with a top
    folder, else inside ``funcamp/``."""
    top = token.split("/", 1)[0]
    return ROOT / token if top in {"funcamp", "docs", "tests", "examples"} else PACKAGE / token


def _is_path(token: str) -> bool:
    return token.endswith((".py", ".md", "/")) and "<" not in token and " " not in token


def _defined(path: pathlib.Path) -> set[str]:
    """Module-level names of ``path``, and ``Class.attr`` for each class's own names."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(f"{node.name}.{item.target.id}")
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _parenthesised(text: str, start: int) -> str:
    """The text inside the parentheses that open at ``start`` (nesting counted)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i]
    return text[start + 1 :]


def _named(cell: str) -> list[tuple[str, list[str]]]:
    """``(path, names)`` for each path a cell names: the names are the identifiers in
    backticks inside the parentheses right after a Python file."""
    out = []
    for match in re.finditer(r"`([^`]+)`", cell):
        token = match.group(1)
        if not _is_path(token):
            continue
        names: list[str] = []
        rest = cell[match.end() :]
        if token.endswith(".py") and rest.startswith(" ("):
            inner = _parenthesised(rest, 1)
            names = [
                n
                for n in re.findall(r"`([^`]+)`", inner)
                if re.fullmatch(r"[A-Za-z_][\w.]*", n) and not _is_path(n)
            ]
        out.append((token, names))
    return out


def test_where_to_change_what_names_real_files_and_functions():
    rows = _rows(_section("Where to change what"))
    assert len(rows) >= 10
    missing = []
    for change, files in rows:
        named = _named(files)
        assert named, f"row {change!r} names no file"
        for token, names in named:
            path = _path(token)
            if not path.exists():
                missing.append(f"{change}: {token}")
                continue
            defined = _defined(path) if path.suffix == ".py" else set()
            missing += [f"{change}: {token} has no `{n}`" for n in names if n not in defined]
    assert not missing, "docs/internals.md, 'Where to change what':\n" + "\n".join(missing)


def _modules(token: str) -> list[pathlib.Path]:
    path = _path(token)
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def _lines(tokens: list[str]) -> int:
    return sum(p.read_text().count("\n") for t in tokens for p in _modules(t))


def _workaround_rows() -> list[tuple[str, list[str], str]]:
    """``(the row as written, its paths, its lines cell)``."""
    out = []
    for line in _section("Workarounds").splitlines():
        if not line.startswith("|") or line.startswith(("| workaround", "|---", "| ---")):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        out.append((line, [t for t in re.findall(r"`([^`]+)`", cells[1]) if _is_path(t)], cells[2]))
    return out


def _fixed_table() -> tuple[str, list[str]]:
    """The page with each row's count made right, and the rows that were wrong."""
    text, wrong = PAGE.read_text(), []
    for line, tokens, count in _workaround_rows():
        right = f"{_lines(tokens):,}"
        if count != right:
            wrong.append(f"{', '.join(tokens)}: {count} -> {right}")
            cells = line.split("|")
            cells[3] = f" {right} "
            text = text.replace(line, "|".join(cells))
    return text, wrong


def test_workaround_line_counts_are_the_modules_lengths():
    rows = _workaround_rows()
    assert len(rows) >= 9
    for _, tokens, _ in rows:
        assert tokens and all(_path(t).exists() for t in tokens), tokens
    _, wrong = _fixed_table()
    assert not wrong, (
        "docs/internals.md's workaround table has stale line counts (run "
        "`python tests/test_internals_map.py` to write them):\n" + "\n".join(wrong)
    )


def _private_torch(path: pathlib.Path) -> set[str]:
    """The ``torch._x`` names a module uses: imported, or reached as an attribute."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        dotted = []
        if isinstance(node, ast.Import):
            dotted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            dotted = [node.module]
        elif isinstance(node, ast.Attribute):
            parts, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch":
                dotted = [".".join(["torch", *reversed(parts)])]
        for name in dotted:
            parts = [*name.split("."), ""]
            if parts[0] == "torch" and parts[1].startswith("_") and not PUBLIC.match(parts[1]):
                found.add(f"torch.{parts[1]}")
    return found


def _docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_a_module_in_torchs_internals_carries_the_header(path):
    used = _private_torch(path)
    doc = _docstring(path)
    if not used:
        return
    where = f"{path.relative_to(ROOT)} uses {', '.join(sorted(used))}"
    assert HEADER in doc, f"{where} but its docstring has no '{HEADER}' header"
    header = doc[doc.index(HEADER) :]
    for bullet in BULLETS:
        assert f"\n{bullet}" in header, f"{where}: its header has no '{bullet}'"


def test_every_workaround_module_is_in_the_table():
    listed = {p for _, tokens, _ in _workaround_rows() for t in tokens for p in _modules(t)}
    missing = [
        str(p.relative_to(ROOT))
        for p in MODULES
        if (_private_torch(p) or HEADER in _docstring(p)) and p not in listed
    ]
    assert not missing, "docs/internals.md's workaround table lacks: " + ", ".join(missing)


if __name__ == "__main__":  # write the workaround table's line counts
    text, wrong = _fixed_table()
    PAGE.write_text(text)
    print("\n".join(wrong) or "the counts were right", file=sys.stderr)
