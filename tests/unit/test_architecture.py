"""The import contract and the size limits of tools/architecture.py, on this tree and on small
trees built to break them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import architecture
from tools.architecture import allowed, import_violations, size_violations, sizes

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
    assert "0 upward imports" in done.stdout


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
