"""The layering of docs/architecture.md, checked on the source: no import cycles between widebeam's
modules (imports inside functions count; `if TYPE_CHECKING:` blocks do not), and each layer imports
only the layers below it."""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import widebeam

ROOT = Path(widebeam.__file__).parent

# A module's layer is the first prefix that matches; lower numbers are lower layers.
LAYERS = [
    ("widebeam.errors", 0), ("widebeam.units", 0), ("widebeam.defaults", 0), ("widebeam.params", 0),
    ("widebeam.outputs", 0), ("widebeam.argtypes", 0), ("widebeam.memstats", 0), ("widebeam.heap", 0),
    ("widebeam.logprobs", 0),
    ("widebeam.response_format", 0), ("widebeam.score_params", 0), ("widebeam.param_checks", 0),
    ("widebeam.request_checks", 0),
    ("widebeam.kv", 1),
    ("widebeam.model", 2), ("widebeam.decoding", 2), ("widebeam.beam", 2), ("widebeam.sampling", 2),
    ("widebeam.catalogue", 2), ("widebeam.structured", 2),
    ("widebeam.detokenizer", 2),
    ("widebeam.sched", 3), ("widebeam.routing", 3),
    ("widebeam.config", 4), ("widebeam.engine_args", 4), ("widebeam.worker", 4), ("widebeam.speculative", 4),
    ("widebeam.decoder_factory", 4),
    ("widebeam.request", 4),
    ("widebeam.engine", 4), ("widebeam.llm", 4), ("widebeam.plan", 4), ("widebeam.pinning", 4),
    ("widebeam.device", 4),
    ("widebeam.layout", 4), ("widebeam.prompts", 4), ("widebeam.startup", 4), ("widebeam.scoring", 4),
    ("widebeam.request_sizer", 4),
    ("widebeam.cli", 5), ("widebeam.generate_cli", 5), ("widebeam.__main__", 5), ("widebeam.bench", 5),
    ("widebeam.plan_cli", 5),
    ("widebeam.server", 5),
    ("widebeam.batch", 5), ("widebeam.bench_ct2", 5), ("widebeam.bench_serve", 5),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    for prefix, number in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return number
    raise AssertionError(f"{module} is in no layer of docs/architecture.md")


def imports(path: Path) -> set[str]:
    """widebeam modules imported anywhere in the file but under `if TYPE_CHECKING:` or in a module's
    lazy `__getattr__` (a package's front door, which imports on first attribute access only)."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for block in ast.walk(tree)
               if (isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test))
               or (isinstance(block, ast.FunctionDef) and block.name == "__getattr__")
               for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("widebeam")}


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in ROOT.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        # "from widebeam.kv import cache" names a module; "from widebeam.kv.cache import KVCache" a symbol
        edges[name] = {target for target in imports(path) if target in modules and target != name}
    return edges


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(target):] + [target]))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def folder(module: str) -> str:
    """The folder a module lives in (widebeam.kv.cache -> widebeam.kv); a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def test_no_loop_between_folders():
    """Modules collapsed to their folders, the imports form no loop: the modules of one folder may import
    each other, but no two folders import each other, directly or around a longer loop. Downward module
    imports do not ensure it when a folder's modules sit on different floors (params -> structured ->
    decoding -> params, while structured/ held the base floor's formats.py). The package's front door
    (widebeam/__init__.py) is left out: it imports what it re-exports (the layer test skips it too)."""
    arrows: dict[str, dict[str, list[str]]] = {}  # folder -> folder -> the module imports behind the arrow
    for module, targets in graph().items():
        for target in targets:
            source, sink = folder(module), folder(target)
            if source != sink and "widebeam" not in (source, sink):
                arrows.setdefault(source, {}).setdefault(sink, []).append(f"{module} imports {target}")
    loops: list[str] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(arrows.get(node, {})):
            if state.get(target) == 1:  # a loop closes here: name it, and one import behind each arrow
                loop = stack[stack.index(target):] + [target]
                behind = [min(arrows[a][b]) for a, b in pairwise(loop)]
                loops.append(" -> ".join(loop) + " (" + "; ".join(behind) + ")")
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(arrows):
        if node not in state:
            visit(node)
    assert not loops, "loops between folders:\n" + "\n".join(loops)


def test_layers_import_downward_only():
    wrong = []
    for module, targets in graph().items():
        if module == "widebeam":
            continue
        for target in targets:
            if target != "widebeam" and layer(target) > layer(module):
                wrong.append(f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_kv_knows_nothing_of_torch():
    for path in (ROOT / "kv").glob("*.py"):
        assert not any(name in path.read_text() for name in ("import torch", "from torch")), path
