"""The shape of the code, checked: imports point down the layers, no package imports itself in a
circle, and no module, function or class grows past what one sitting can read.

Layers, bottom to top (a package may import its own modules and any package of a lower layer,
never one beside it or above it):

0. ``clusterpulse``: the contract (wire schemas, Redis keys, settings, retry, ACL rules);
1. ``agent`` | ``services`` | ``trainer``: the three programs, none importing another
   (``migrations`` belongs to ``services``: its environment reads ``services.models``);
2. ``tools``: the ``pulse`` command, the demo, benchmarks, campaigns and the harness they share
   with the tests.

``python -m tools.architecture`` prints every upward or sideways arrow, every import circle among
the modules of one package (imports inside functions count; those under ``if TYPE_CHECKING:`` do
not, they never run), every module over :data:`MAX_MODULE_LINES` lines and every function over
:data:`MAX_FUNCTION_LINES` or class over :data:`MAX_CLASS_LINES` lines. It exits 1 on an arrow,
a circle not in :data:`CIRCLE_DEBT`, or a module, function or class size that is not in
:data:`MODULE_DEBT` or :data:`SIZE_DEBT` or grew past its recorded length.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LAYER = {"clusterpulse": 0, "agent": 1, "services": 1, "trainer": 1, "migrations": 1, "tools": 2}
# A package of layer 1 may also import these of layer 1 (its own program).
SAME_PROGRAM = {"migrations": {"services"}}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400

# What is over the limits today, with its length: it may shrink or go, never grow, and nothing new
# may join it. Each entry is a split still owed (issue #20).
SIZE_DEBT: dict[str, int] = {}  # every split owed when the check landed is paid
# The same for modules over MAX_MODULE_LINES, and the import circles still owed: an owed circle
# may break, never take in another module.
MODULE_DEBT: dict[str, int] = {}
CIRCLE_DEBT: set[tuple[str, ...]] = set()


@dataclass(frozen=True)
class Arrow:
    """``module`` (a file) imports ``target`` (a module name) against the layers."""

    module: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: imports {self.target} (layer order: {_order()})"


def _order() -> str:
    return "clusterpulse < agent | services | trainer < tools"


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of the tree, also inside functions, except under ``if TYPE_CHECKING``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif _type_checking_only(node):
            assert isinstance(node, ast.If)
            for child in node.orelse:
                yield from _import_nodes(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from _import_nodes(node)


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """Every absolute module name the tree imports (also inside functions), with its line;
    a relative import stays inside its own package and is skipped."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def allowed(importer: str, imported: str) -> bool:
    """Whether package ``importer`` may import package ``imported`` (both top-level names)."""
    if imported not in LAYER or importer == imported:
        return True
    if importer not in LAYER:
        return True  # tests and scripts sit on top of everything
    if imported in SAME_PROGRAM.get(importer, set()):
        return True
    return LAYER[imported] < LAYER[importer]


def import_violations(root: Path) -> list[Arrow]:
    """The arrows that run up or sideways, in every package of :data:`LAYER` under ``root``."""
    found: list[Arrow] = []
    for package in LAYER:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, name in _imports(tree):
                if not allowed(package, name.split(".")[0]):
                    found.append(Arrow(str(path.relative_to(root)), line, name))
    return found


def _qualified(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """``(Class.method or function name, node)`` for every class and function, nested ones too."""
    out: list[tuple[str, ast.AST]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                out.append((name, child))
                walk(child, f"{name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def sizes(root: Path) -> dict[str, int]:
    """Every function over :data:`MAX_FUNCTION_LINES` and class over :data:`MAX_CLASS_LINES`
    lines outside the tests, as ``path:Qualified.name`` -> its length in lines."""
    over: dict[str, int] = {}
    for package in LAYER:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for name, node in _qualified(tree):
                assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                if length > limit:
                    over[f"{path.relative_to(root)}:{name}"] = length
    return over


def size_violations(over: dict[str, int], debt: dict[str, int] = SIZE_DEBT) -> list[str]:
    """What is over the limits and not owed, or grew past what is owed."""
    bad = []
    for name, length in sorted(over.items()):
        owed = debt.get(name)
        if owed is None:
            bad.append(f"{name}: {length} lines (new; the limit is {MAX_FUNCTION_LINES}/{MAX_CLASS_LINES})")
        elif length > owed:
            bad.append(f"{name}: {length} lines, grew from {owed}")
    return bad


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` under ``root``."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that one import statement in ``module`` loads by name: the named
    module itself, or for ``from X import n`` the submodule ``X.n`` where there is one."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".")
            anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join([*anchor, base] if base else anchor)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = set()
    for name in names:
        found = name
        while found and found not in known:  # ``import a.b.c`` of a name inside a module
            found = found.rpartition(".")[0]
        if found:
            out.add(found)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of the same top-level package it imports (inside functions too)."""
    modules = _modules(root, package)
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _import_nodes(tree):
            edges |= _targets(node, module, is_package, known)
        edges.discard(module)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected parts of two modules or more,
    each sorted, found with Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def import_circles(root: Path) -> dict[tuple[str, ...], str]:
    """Every import circle inside one package of :data:`LAYER` (its modules, sorted) -> the
    circle in words, with the arrows that tie it."""
    out: dict[tuple[str, ...], str] = {}
    for package in LAYER:
        graph = import_graph(root, package)
        for part in circles(graph):
            members = set(part)
            ties = ", ".join(f"{a} -> {b}" for a in part for b in sorted(graph[a] & members))
            out[tuple(part)] = f"{' <-> '.join(part)} ({ties})"
    return out


def circle_violations(root: Path, debt: set[tuple[str, ...]] | None = None) -> list[str]:
    """The import circles under ``root`` that are not owed (:data:`CIRCLE_DEBT` by default)."""
    owed = CIRCLE_DEBT if debt is None else debt
    return [text for part, text in sorted(import_circles(root).items()) if part not in owed]


def long_modules(root: Path) -> dict[str, int]:
    """Every module over :data:`MAX_MODULE_LINES` lines, as its path -> its length in lines."""
    over: dict[str, int] = {}
    for package in LAYER:
        for path in sorted((root / package).rglob("*.py")):
            length = len(path.read_text().splitlines())
            if length > MAX_MODULE_LINES:
                over[str(path.relative_to(root))] = length
    return over


def module_violations(long: dict[str, int], debt: dict[str, int] | None = None) -> list[str]:
    """The modules over :data:`MAX_MODULE_LINES` that are not owed (:data:`MODULE_DEBT` by
    default), or grew past what is owed."""
    owed = MODULE_DEBT if debt is None else debt
    bad = []
    for path, length in sorted(long.items()):
        if path not in owed:
            bad.append(f"{path}: {length} lines (new; the limit is {MAX_MODULE_LINES})")
        elif length > owed[path]:
            bad.append(f"{path}: {length} lines, grew from {owed[path]}")
    return bad


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    arrows = import_violations(root)
    found = import_circles(root)
    loops = circle_violations(root)
    long = long_modules(root)
    long_bad = module_violations(long)
    over = sizes(root)
    grown = size_violations(over)
    for a in arrows:
        print(f"layers: {a}")
    for part, text in sorted(found.items()):
        print(f"circle: {text}" + (" (owed)" if part in CIRCLE_DEBT else ""))
    for path, length in sorted(long.items(), key=lambda kv: -kv[1]):
        owed = " (owed)" if path in MODULE_DEBT else ""
        print(f"module size: {path} {length} lines (the limit is {MAX_MODULE_LINES}){owed}")
    for bad in long_bad:
        print(f"module size violation: {bad}")
    for name, length in sorted(over.items(), key=lambda kv: -kv[1]):
        print(f"size: {name} {length} lines")
    for g in grown:
        print(f"size violation: {g}")
    paid = [
        *(f"size: {n} is within the limits now: remove it from SIZE_DEBT" for n in sorted(set(SIZE_DEBT) - set(over))),
        *(
            f"module size: {n} is within the limit now: remove it from MODULE_DEBT"
            for n in sorted(set(MODULE_DEBT) - set(long))
        ),
        *(
            f"circle: {' <-> '.join(c)} is broken now: remove it from CIRCLE_DEBT"
            for c in sorted(CIRCLE_DEBT - set(found))
        ),
    ]
    for line in paid:
        print(line)
    print(
        f"architecture: {len(arrows)} upward imports, {len(loops)} import circles not owed, "
        f"{len(long_bad)} modules over {MAX_MODULE_LINES} lines not owed or grown, {len(over)} over the size "
        f"limits ({len(grown)} not owed or grown), {len(paid)} debts paid"
    )
    return 1 if arrows or loops or long_bad or grown else 0


if __name__ == "__main__":
    sys.exit(main())
