"""The documentation keeps up with the code: every ``PULSE_*`` setting is in docs/configuration.md,
README.md stays a short page for users, and every relative link in README.md and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from clusterpulse.settings import Settings
from trainer.settings import TrainerSettings

REPO = Path(__file__).resolve().parents[2]
SOURCE_PACKAGES = ("agent", "services", "trainer", "tools", "clusterpulse")
SETTINGS_CLASSES: tuple[type[BaseSettings], ...] = (Settings, TrainerSettings)
# os.environ.get("PULSE_X"), os.environ["PULSE_X"], environ.get("PULSE_X"), os.getenv("PULSE_X")
ENV_READ = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?|getenv)\s*[(\[]\s*["'](PULSE_[A-Z0-9_]+)["']""")
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 300


def settings_in_code() -> set[str]:
    """Every ``PULSE_*`` name the code reads: the pydantic-settings fields with their env prefix,
    plus the variables read straight from the environment in the product's packages."""
    names: set[str] = set()
    for cls in SETTINGS_CLASSES:
        prefix = str(cls.model_config.get("env_prefix", "")).upper()
        names.update(prefix + field.upper() for field in cls.model_fields)
    for package in SOURCE_PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            names.update(ENV_READ.findall(path.read_text()))
    return names


def documented() -> set[str]:
    return set(re.findall(r"PULSE_[A-Z0-9_]*[A-Z0-9]", (REPO / "docs" / "configuration.md").read_text()))


def test_the_collector_finds_fields_and_direct_reads() -> None:
    found = settings_in_code()
    assert {"PULSE_REDIS_URL", "PULSE_DEGRADED_AFTER_S", "PULSE_COLLECTIVE_TIMEOUT_S"} <= found  # fields
    assert {"PULSE_NODE_LABELS", "PULSE_SLURM_CROSS_RANK"} <= found  # read from os.environ
    assert ENV_READ.findall('x = os.environ.get("PULSE_NEW_THING", "")') == ["PULSE_NEW_THING"]
    assert ENV_READ.findall('environ["PULSE_OTHER"]') == ["PULSE_OTHER"]


def test_every_setting_is_in_the_configuration_doc() -> None:
    missing = sorted(settings_in_code() - documented())
    assert not missing, f"docs/configuration.md lacks {missing}: add each with its default and meaning"


def test_readme_is_short_and_starts_with_your_own_script() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    head = "\n".join(lines[:100])
    assert "trainer.run" in head and "POST /v1/jobs" in head, "the launch lines belong in the first 100 lines"


def test_readme_names_no_commit() -> None:
    text = (REPO / "README.md").read_text()
    assert not HASH.findall(text), f"commit-like hashes in README.md: {HASH.findall(text)}"


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    head = (REPO / "README.md").read_text().splitlines()[:15]
    assert any(line.startswith(ci) for line in head), f"README.md's first lines should show .ci/run's {ci!r}"


@pytest.mark.parametrize(
    ("text", "hashes"),
    [("at 89c269d, then", ["89c269d"]), ("deadbeef0 and 2048 x 8", ["deadbeef0"]), ("PULSE_ZERO 1234567", [])],
)
def test_the_hash_pattern(text: str, hashes: list[str]) -> None:
    assert HASH.findall(text) == hashes


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as dashes."""
    headings = re.findall(r"^#+\s+(.*)$", path.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves() -> None:
    broken = []
    for path in markdown_files():
        for target in LINK.findall(path.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file) if file else path
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert not broken, f"links to files or headings that do not exist: {broken}"
