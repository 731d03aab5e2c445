"""No test-only API in the library: every public function, class and method of widebeam/ that a test
uses is used by something real too, or it belongs in tests/ (tests/kv_helpers.py is the pattern: a
plain function over the library's object).

Real uses: widebeam/ itself outside the name's own definition, benchmarks/*.py, README.md,
docs/*.md, the web page's scripts (widebeam/server/ui/*.js) and pyproject.toml (entry points).
Python is read as a syntax tree (names, attributes, imported names, strings that are one identifier:
`__all__`, getattr); markdown, scripts and toml as words. Names are matched by name, not by owner: a
method that shares its name with one the library calls passes.

Not counted as test-only: private and dunder names, and definitions a decorator registers (pydantic
validators, Typer commands, routes): their caller is the framework.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import widebeam

ROOT = Path(widebeam.__file__).parent
REPO = ROOT.parent

# Decorators that only shape a definition; any other decorator registers it with its caller.
PLAIN_DECORATORS = {"property", "staticmethod", "classmethod", "abstractmethod", "cached_property",
                    "setter", "overload", "override", "cache", "lru_cache", "wraps"}


def decorator_name(node: ast.expr) -> str:
    while isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def definitions(path: Path) -> list[tuple[str, str, ast.AST]]:
    """(name, qualified name, node) of the module's public top-level functions and classes and its
    classes' public methods, registered ones left out."""
    found = []

    def add(node: ast.AST, qualname: str) -> None:
        if node.name.startswith("_"):
            return
        if any(decorator_name(d) not in PLAIN_DECORATORS for d in getattr(node, "decorator_list", [])):
            return
        found.append((node.name, qualname, node))

    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            add(node, node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    add(item, f"{node.name}.{item.name}")
    return found


def references(path: Path) -> tuple[set[str], set[str]]:
    """Names the file uses: (as names: names and imported names; as attributes: `x.name`), both with
    the one-identifier strings; a function's uses of its own name inside its body left out (recursion
    is no caller)."""
    names: set[str] = set()
    attributes: set[str] = set()

    def visit(node: ast.AST, enclosing: frozenset[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            enclosing = enclosing | {node.name}
        found, kinds = None, ()
        if isinstance(node, ast.Name):
            found, kinds = node.id, (names,)
        elif isinstance(node, ast.alias):
            found, kinds = node.name.rsplit(".", 1)[-1], (names,)
        elif isinstance(node, ast.Attribute):
            found, kinds = node.attr, (attributes,)
        elif isinstance(node, ast.keyword) and node.arg:
            found, kinds = node.arg, (attributes,)  # a keyword may name a callback's parameter
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            found, kinds = node.value, (names, attributes)
        if found and found not in enclosing:
            for kind in kinds:
                kind.add(found)
        for child in ast.iter_child_nodes(node):
            visit(child, enclosing)

    visit(ast.parse(path.read_text()), frozenset())
    return names, attributes


def uses(paths) -> tuple[set[str], set[str]]:
    """`references` of every file, merged."""
    names: set[str] = set()
    attributes: set[str] = set()
    for path in paths:
        file_names, file_attributes = references(path)
        names |= file_names
        attributes |= file_attributes
    return names, attributes


def used(name: str, is_method: bool, names: set[str], attributes: set[str]) -> bool:
    """A method is used through an attribute (`obj.name`); a function or class by name, import, or as
    a module's attribute."""
    return name in attributes or (not is_method and name in names)


def words(paths) -> set[str]:
    return {word for path in paths for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text())}


def find_test_only_names() -> list[str]:
    """'path:line qualname' of each public library name that tests use and nothing real does."""
    test_names, test_attributes = uses((REPO / "tests").rglob("*.py"))
    real_names, real_attributes = uses([*ROOT.rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")])
    text = words([REPO / "README.md", REPO / "pyproject.toml", *(REPO / "docs").glob("*.md"),
                  *(ROOT / "server" / "ui").glob("*.js")])
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for name, qualname, node in definitions(path):
            is_method = "." in qualname
            if (used(name, is_method, test_names, test_attributes) and name not in text
                    and not used(name, is_method, real_names, real_attributes)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {qualname}")
    return found


def test_no_library_name_is_used_by_tests_alone():
    found = find_test_only_names()
    assert not found, ("used only by tests (move them to tests/, e.g. tests/kv_helpers.py):\n"
                       + "\n".join(found))


def test_a_test_only_method_is_found(tmp_path):
    """The check itself: a method only a test calls is reported, the same one called by the library
    is not."""
    library = tmp_path / "lib.py"
    library.write_text("class Pool:\n    def allocate_two(self):\n        return self.allocate_two()\n"
                       "    def used(self):\n        return 1\n\ndef main():\n    return Pool().used()\n")
    a_test = tmp_path / "test_lib.py"
    a_test.write_text("from lib import Pool\n\n\ndef test_it():\n"
                      "    assert Pool().allocate_two() and Pool().used()\n")
    test_names, test_attributes = references(a_test)
    real_names, real_attributes = references(library)
    names = [qualname for name, qualname, _ in definitions(library)
             if used(name, "." in qualname, test_names, test_attributes)
             and not used(name, "." in qualname, real_names, real_attributes)]
    assert names == ["Pool.allocate_two"]
