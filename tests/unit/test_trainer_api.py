"""The trainer's public API: every exported name resolves, and importing the package loads
neither torch nor DeepSpeed (``python -m trainer.run`` checks the job's store first)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import trainer

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_package_loads_no_torch() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, trainer; print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "[]"


def test_every_exported_name_is_the_object_of_its_module() -> None:
    assert sorted(trainer.__all__) == sorted(trainer._WHERE)
    for name in trainer.__all__:
        assert getattr(trainer, name) is getattr(importlib.import_module(trainer._WHERE[name]), name)
    assert set(trainer.__all__) <= set(dir(trainer))


def test_an_unknown_name_is_an_attribute_error_and_submodules_still_import() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        trainer.nothing_here  # noqa: B018
    from trainer import resilience

    assert resilience.attach is trainer.attach
