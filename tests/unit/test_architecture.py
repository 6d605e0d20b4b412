"""The import contract, the import circles and the size limits of tools/architecture.py, on this
tree and on small trees built to break them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import architecture
from tools.architecture import (
    allowed,
    circle_violations,
    circles,
    import_graph,
    import_violations,
    long_modules,
    module_violations,
    size_violations,
    sizes,
)

REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in architecture.LAYER:
        (root / package).mkdir(exist_ok=True)
    return root


def test_this_tree_keeps_the_layers_and_owes_no_new_size() -> None:
    # In a process of its own: CPython 3.11's AST constructor keeps a recursion count per
    # interpreter that threads parsing at the same time (hypothesis does, in schemathesis's
    # threads) can leave wrong ("AST constructor recursion depth mismatch"), so the worker
    # running the rest of the suite parses as little as it can.
    done = subprocess.run(
        [sys.executable, "-m", "tools.architecture"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 upward imports, 0 import circles not owed, 0 modules over 600 lines not owed" in done.stdout


def test_the_command_fails_on_each_kind_of_fault(tmp_path: Path) -> None:
    """The command's verdict on a tree that has one fault of each kind: it names each and exits 1."""
    body = "".join(f"x{i} = {i}\n" for i in range(601))
    root = _tree(
        tmp_path / "house",
        {
            "tools/architecture.py": (REPO / "tools" / "architecture.py").read_text(),
            "tools/a.py": "from tools import b\n",
            "tools/b.py": "def f():\n    import tools.a\n",
            "agent/big.py": body,
            "trainer/up.py": "import services.api\n",
        },
    )
    done = subprocess.run(
        [sys.executable, str(root / "tools" / "architecture.py")], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "layers: trainer/up.py:1: imports services.api" in done.stdout
    assert "circle: tools.a <-> tools.b (tools.a -> tools.b, tools.b -> tools.a)" in done.stdout
    assert "module size violation: agent/big.py: 601 lines (new; the limit is 600)" in done.stdout
    assert "1 upward imports, 1 import circles not owed, 1 modules over 600 lines not owed" in done.stdout


@pytest.mark.parametrize(
    ("importer", "imported", "ok"),
    [
        ("agent", "clusterpulse", True),
        ("tools", "services", True),
        ("services", "services", True),
        ("migrations", "services", True),
        ("clusterpulse", "agent", False),  # the contract imports nothing above it
        ("clusterpulse", "tools", False),
        ("services", "trainer", False),  # the programs do not import each other
        ("trainer", "agent", False),
        ("services", "migrations", False),
        ("services", "tools", False),  # nothing imports the tools
        ("agent", "redis", True),
    ],
)
def test_allowed_arrows(importer: str, imported: str, ok: bool) -> None:
    assert allowed(importer, imported) is ok


def test_an_upward_arrow_is_found_even_inside_a_function(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "clusterpulse/wire.py": "import json\n",
            "clusterpulse/settings.py": "def f():\n    from tools.cli import main\n    return main\n",
            "services/api.py": "from clusterpulse import wire\nimport trainer.run\n",
            "tools/cli.py": "from services import api\n",
        },
    )
    found = {(a.module, a.line, a.target) for a in import_violations(root)}
    assert found == {("clusterpulse/settings.py", 2, "tools.cli"), ("services/api.py", 2, "trainer.run")}


def test_a_long_function_or_class_is_named_and_a_grown_debt_refused(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(85))
    root = _tree(
        tmp_path,
        {
            "agent/daemon.py": f"def long():\n{body}\n\ndef short():\n    return 1\n",
            "services/big.py": "class Big:\n"
            + "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(210)),
        },
    )
    over = sizes(root)
    assert over == {"agent/daemon.py:long": 86, "services/big.py:Big": 421}
    assert size_violations(over, debt={}) == [
        "agent/daemon.py:long: 86 lines (new; the limit is 80/400)",
        "services/big.py:Big: 421 lines (new; the limit is 80/400)",
    ]
    assert size_violations(over, debt={"agent/daemon.py:long": 86, "services/big.py:Big": 421}) == []
    assert size_violations(over, debt={"agent/daemon.py:long": 86, "services/big.py:Big": 400}) == [
        "services/big.py:Big: 421 lines, grew from 400"
    ]


def test_a_module_over_600_lines_is_named(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "services/db/__init__.py": "x = 1\n" * 601,
            "services/short.py": "x = 1\n" * 600,
            "tests/long.py": "x = 1\n" * 900,  # the tests are not measured
        },
    )
    assert long_modules(root) == {"services/db/__init__.py": 601}


def test_the_circles_of_the_issue_are_found(tmp_path: Path) -> None:
    """bench <-> bench_scale by name; cli -> demo -> cli and demo_train -> cli, one inside a
    function; a relative import and a submodule imported by ``from package import name``."""
    root = _tree(
        tmp_path,
        {
            "tools/__init__.py": "",
            "tools/bench.py": "from tools.bench_scale import scale_out\n",
            "tools/bench_scale.py": "from tools.bench import _payloads\n",
            "tools/cli.py": "def demo():\n    from tools.demo import run_demo\n    return run_demo\n",
            "tools/demo.py": "from tools.cli import format_nodes\nfrom tools import demo_train\n",
            "tools/demo_train.py": "from .cli import format_jobs\n",
            "tools/format.py": "import json\n",
            "services/__init__.py": "",
            "services/db/__init__.py": "from services.db.models import Node\n",
            "services/db/models.py": "from ..clock import now\n",
            "services/clock.py": "import time\n",
        },
    )
    graph = import_graph(root, "tools")
    assert graph["tools.demo"] == {"tools.cli", "tools.demo_train"}
    assert graph["tools.demo_train"] == {"tools.cli"}
    assert circles(graph) == [["tools.bench", "tools.bench_scale"], ["tools.cli", "tools.demo", "tools.demo_train"]]
    assert import_graph(root, "services")["services.db.models"] == {"services.clock"}
    assert circle_violations(root) == [
        "tools.bench <-> tools.bench_scale (tools.bench -> tools.bench_scale, tools.bench_scale -> tools.bench)",
        "tools.cli <-> tools.demo <-> tools.demo_train (tools.cli -> tools.demo, tools.demo -> tools.cli, "
        "tools.demo -> tools.demo_train, tools.demo_train -> tools.cli)",
    ]


def test_a_tree_without_circles_passes_and_type_checking_imports_do_not_count(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "tools/format.py": "import json\n",
            "tools/cli.py": "from tools.format import table\nfrom tools import demo\n",
            "tools/demo.py": "from tools.format import table\n",
            "tools/soak.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tools.cli import main\n",
            "tools/harness.py": "import tools.soak\n",
        },
    )
    graph = import_graph(root, "tools")
    assert graph["tools.soak"] == set()
    assert graph["tools.cli"] == {"tools.format", "tools.demo"}
    assert circles(graph) == []
    assert circle_violations(root) == []


def test_an_owed_module_may_shrink_never_grow_and_an_owed_circle_never_widen(tmp_path: Path) -> None:
    long = {"trainer/resilience.py": 622, "tools/new.py": 601}
    assert module_violations(long, debt={"trainer/resilience.py": 622}) == [
        "tools/new.py: 601 lines (new; the limit is 600)"
    ]
    assert module_violations({"trainer/resilience.py": 630}, debt={"trainer/resilience.py": 622}) == [
        "trainer/resilience.py: 630 lines, grew from 622"
    ]
    assert module_violations({"trainer/resilience.py": 610}, debt={"trainer/resilience.py": 622}) == []
    root = _tree(
        tmp_path,
        {
            "trainer/resilience.py": "from trainer import world\n",
            "trainer/world.py": "def f():\n    from trainer import resilience\n",
        },
    )
    owed = {("trainer.resilience", "trainer.world")}
    assert circle_violations(root, debt=owed) == []
    assert circle_violations(root, debt=set()) != []
    (root / "trainer" / "world.py").write_text("from trainer import rendezvous\n")
    (root / "trainer" / "rendezvous.py").write_text("from trainer import resilience\n")
    assert circle_violations(root, debt=owed) == [
        "trainer.rendezvous <-> trainer.resilience <-> trainer.world (trainer.rendezvous -> trainer.resilience, "
        "trainer.resilience -> trainer.world, trainer.world -> trainer.rendezvous)"
    ]
