"""The prose of funcamp's public docstrings: ``--`` asides, words per sentence, long Args entries.

Public means module docstrings and the docstrings of non-underscore functions, classes and
methods. Doctest lines and their output are left out. A sentence ends at ``.``, ``!`` or ``?``
followed by a space; a section heading, an Args/Attributes entry and a bullet start a new one.

Run: ``python benchmarks/docstring_prose.py [root]`` (default ``funcamp``).
"""

import ast
import pathlib
import re
import sys

ENTRY = re.compile(r"\s*([\w*]+( \([^)]*\))?: |- |\* )")
HEADING = re.compile(r"\b(Args|Returns|Raises|Attributes|Example|Examples|Yields|Note):")


def public_docstrings(root: str):
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        tree = ast.parse(path.read_text())
        nodes = [tree]
        while nodes:
            node = nodes.pop()
            doc = ast.get_docstring(node)
            if doc:
                yield doc
            nodes += [
                child
                for child in getattr(node, "body", [])
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and not child.name.startswith("_")
            ]


def prose(doc: str) -> str:
    out, in_example = [], False
    for line in doc.splitlines():
        if line.strip().startswith((">>>", "...")):
            in_example = True
        elif in_example and line.strip():
            continue  # a doctest's expected output
        else:
            in_example = False
            out.append(". " + line if ENTRY.match(line) else line)
    return HEADING.sub(". ", " ".join(" ".join(out).split()))


def long_entries(doc: str) -> int:
    """Args/Attributes entries longer than 3 lines."""
    count, section, lines = 0, None, 0
    for line in [*doc.splitlines(), ""]:
        indent = len(line) - len(line.lstrip())
        if line.strip() in ("Args:", "Attributes:"):
            section, lines = indent, 0
        elif section is None:
            continue
        elif not line.strip() or indent <= section:
            count, section = count + (lines > 3), None
        elif indent == section + 4:
            count, lines = count + (lines > 3), 1
        else:
            lines += 1
    return count


def main(root: str = "funcamp") -> None:
    dashes = words = sentences = long = 0
    for doc in public_docstrings(root):
        text = prose(doc)
        dashes += text.count(" -- ")
        long += long_entries(doc)
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            n = len(re.findall(r"[\w`]+", sentence))
            if n >= 2:
                words, sentences = words + n, sentences + 1
    print(f"' -- ' asides: {dashes}")
    print(f"words per sentence: {words / sentences:.1f} ({sentences} sentences)")
    print(f"Args/Attributes entries over 3 lines: {long}")


if __name__ == "__main__":
    main(*sys.argv[1:])
