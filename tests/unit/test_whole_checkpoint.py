"""A checkpoint the live ranks recovered inside is taken again, whole, once by the outermost save
(trainer/job_checkpoint.py ``whole``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from trainer.job_checkpoint import whole


class Save:
    """A save that moves ``groups`` to the next salt of ``salts`` as it runs (a recovery inside it)."""

    def __init__(self, groups: Any, salts: list[str]) -> None:
        self.groups, self.salts, self.calls = groups, salts, 0

    def __call__(self) -> int:
        self.calls += 1
        if self.salts:
            self.groups.salt = self.salts.pop(0)
        return self.calls


def test_a_save_without_a_recovery_runs_once() -> None:
    groups = SimpleNamespace(salt="j/1")
    assert whole(Save(groups, []), groups) == 1  # type: ignore[arg-type]


def test_a_recovery_inside_takes_it_again_and_a_third_try_is_the_last() -> None:
    groups = SimpleNamespace(salt="j/1")
    assert whole(Save(groups, ["j/2"]), groups) == 2  # type: ignore[arg-type]
    assert whole(Save(groups, ["j/3", "j/4", "j/5"]), groups) == 3  # type: ignore[arg-type]


def test_a_save_inside_another_runs_once_and_the_outer_one_takes_both_again() -> None:
    groups = SimpleNamespace(salt="j/1")
    inner: list[int] = []

    def inner_save() -> None:
        inner.append(1)
        if len(inner) == 1:
            groups.salt = "j/2"  # the recovery happened in the inner save's barrier

    def outer_save() -> str:
        whole(inner_save, groups)  # type: ignore[arg-type]
        return groups.salt

    assert whole(outer_save, groups) == "j/2"  # type: ignore[arg-type]
    assert len(inner) == 2  # once per outer try, not retaken inside as well
