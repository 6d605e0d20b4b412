"""trainer/imports.py: a hook runs once its module really executed, not on an availability probe."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from trainer.imports import after_import


def test_a_probe_does_not_use_the_hook_up_and_the_import_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pulse_probe_target.py").write_text("def initialize():\n    return 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pulse_probe_target", raising=False)
    seen: list[str] = []

    def patch(module: ModuleType) -> None:
        seen.append(module.__name__)
        module.initialize = lambda: "patched"

    after_import("pulse_probe_target", patch)
    try:
        # transformers' and accelerate's availability checks
        assert importlib.util.find_spec("pulse_probe_target") is not None
        assert importlib.util.find_spec("pulse_probe_target") is not None
        assert seen == []
        from pulse_probe_target import initialize  # type: ignore[import-not-found]

        assert initialize() == "patched"
        assert seen == ["pulse_probe_target"]
        assert not any(type(f).__name__ == "_AfterImport" for f in sys.meta_path)  # gone once it ran
    finally:
        sys.modules.pop("pulse_probe_target", None)


def test_a_module_already_imported_is_patched_at_once() -> None:
    seen: list[str] = []
    after_import("json", lambda m: seen.append(m.__name__))
    assert seen == ["json"]
