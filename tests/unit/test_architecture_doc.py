"""docs/architecture.md names only what exists: every file, class and function it puts in backticks
is in the source, where it says. A renamed or removed name fails here until the map is redrawn.

What is checked, for each `code span` of the document:
- a path (`kv/managers.py`, `sched/`, `tests/unit/test_request_kv.py`): the file or folder exists
  under widebeam/ or the repository root;
- `file.py: name`: `name` is defined in that file (a def, a class or an assignment);
- `Class.member` (a CamelCase first part): the class is defined, and the member in its file;
- `name(...)` or a CamelCase name: a function or class of that name is defined somewhere in widebeam/;
- any other identifier (an attribute, a setting's value): it occurs as a word in widebeam/.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "widebeam"
DOC = ROOT / "docs" / "architecture.md"

PATH = re.compile(r"^[\w./-]+(\.py|/)$")
QUALIFIED = re.compile(r"^(?P<file>[\w/]+\.py):\s*(?P<name>\w+)")
STANDARD_NAMES = {"Protocol", "None", "True", "False"}  # Python's own, named in the map
IDENTIFIER = re.compile(r"^(?P<name>[A-Za-z_]\w*(?:\.\w+)*)(?P<call>\(.*\))?$")


@cache
def definitions() -> dict[Path, tuple[set[str], set[str]]]:
    """Per source file: (names defined at any depth: defs, classes, assignments; class names)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names, classes = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                names.add(node.name)
                classes.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names.add(leaf.id)
                        elif isinstance(leaf, ast.Attribute):
                            names.add(leaf.attr)
        out[path] = (names, classes)
    return out


@cache
def source_words() -> set[str]:
    return {word for path in PACKAGE.rglob("*.py") for word in re.findall(r"\w+", path.read_text())}


def code_spans() -> list[str]:
    text = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.DOTALL)
    return [span.strip() for span in re.findall(r"`([^`\n]+)`", text)]


def resolve(relative: str) -> Path | None:
    """The file or folder a path names: under widebeam/ or the root; a bare file name (in the
    layer table, beside its package) anywhere under widebeam/."""
    for base in (PACKAGE, ROOT):
        if (base / relative).exists():
            return base / relative
    if "/" not in relative:
        found = list(PACKAGE.rglob(relative))
        return found[0] if found else None
    return None


def problem(span: str) -> str | None:
    """Why `span` names something that does not exist, or None."""
    if PATH.match(span):
        return None if resolve(span) else f"no file or folder {span}"
    qualified = QUALIFIED.match(span)
    if qualified:
        path = resolve(qualified["file"])
        if path is None or path not in definitions():
            return f"no file {qualified['file']}"
        name = qualified["name"]
        return None if name in definitions()[path][0] else f"{name} not in {path.name}"
    match = IDENTIFIER.match(span)
    if not match:
        return None  # a formula, a command line, a literal: not a name
    parts = match["name"].split(".")
    if parts[0] == "widebeam" or parts[-1] in {"py", "md", "json"}:
        return None
    first = parts[0]
    if first in STANDARD_NAMES:
        return None
    if first[0].isupper() and any(c.islower() for c in first):
        files = [p for p, (_, classes) in definitions().items() if first in classes]
        if not files:
            return f"no class {first}"
        for member in parts[1:]:
            if not any(member in definitions()[p][0] for p in files):
                return f"{first} has no {member}"
        return None
    if match["call"] is not None and len(parts) == 1:
        if not any(first in names for names, _ in definitions().values()):
            return f"no function {first}"
        return None
    missing = [part for part in parts if part not in source_words()]
    return f"{'.'.join(missing)} occurs nowhere in widebeam/" if missing else None


def test_the_architecture_map_names_only_what_exists():
    problems = sorted({f"`{span}`: {why}" for span in code_spans() if (why := problem(span))})
    assert not problems, "docs/architecture.md names what does not exist:\n" + "\n".join(problems)


def test_the_checker_catches_a_wrong_name():
    """The check itself can fail: names that do not exist are caught, real ones pass."""
    assert problem("kv/managers.py") is None and problem("kv/no_such_file.py")
    assert problem("kv/budget.py: full_attention_blocks") is None
    assert problem("model/families/arch.py: load_arch")  # the stale claim the renovation issue found
    assert problem("RequestKV.decode_slots") is None and problem("RequestKV.no_such_method")
    assert problem("replay_round(decoder, ...)") is None and problem("no_such_function(x)")
    assert problem("NoSuchClass")
