"""The shape of the code, checked: imports point down the layers, and no function or class grows
past what one sitting can read.

Layers, bottom to top (a package may import its own modules and any package of a lower layer,
never one beside it or above it):

0. ``clusterpulse``: the contract (wire schemas, Redis keys, settings, retry, ACL rules);
1. ``agent`` | ``services`` | ``trainer``: the three programs, none importing another
   (``migrations`` belongs to ``services``: its environment reads ``services.models``);
2. ``tools``: the ``pulse`` command, the demo, benchmarks, campaigns and the harness they share
   with the tests.

``python -m tools.architecture`` prints every upward or sideways arrow and every function over
:data:`MAX_FUNCTION_LINES` or class over :data:`MAX_CLASS_LINES` lines, and exits 1 on an arrow
or on a size that is not in :data:`SIZE_DEBT` or grew past its recorded length.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

LAYER = {"clusterpulse": 0, "agent": 1, "services": 1, "trainer": 1, "migrations": 1, "tools": 2}
# A package of layer 1 may also import these of layer 1 (its own program).
SAME_PROGRAM = {"migrations": {"services"}}
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400

# What is over the limits today, with its length: it may shrink or go, never grow, and nothing new
# may join it. Each entry is a split still owed (issue #20).
SIZE_DEBT: dict[str, int] = {}  # every split owed when the check landed is paid


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


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    arrows = import_violations(root)
    over = sizes(root)
    grown = size_violations(over)
    for a in arrows:
        print(f"layers: {a}")
    for name, length in sorted(over.items(), key=lambda kv: -kv[1]):
        print(f"size: {name} {length} lines")
    for g in grown:
        print(f"size violation: {g}")
    paid = sorted(set(SIZE_DEBT) - set(over))
    for name in paid:
        print(f"size: {name} is within the limits now: remove it from SIZE_DEBT")
    print(
        f"architecture: {len(arrows)} upward imports, {len(over)} over the size limits "
        f"({len(grown)} not owed or grown), {len(paid)} debts paid"
    )
    return 1 if arrows or grown else 0


if __name__ == "__main__":
    sys.exit(main())
