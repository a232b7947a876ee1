"""README.md's two commands: CI runs the test command word for word, and constraints.txt, which
both install with, pins versions that pyproject.toml's ranges admit."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_ci_runs_the_readme_test_command_word_for_word():
    serve, test = _commands()
    assert serve.endswith("tollway serve") and test.endswith("python -m pytest -q")
    assert test in (ROOT / ".ci" / "run").read_text().splitlines()
    assert "-c constraints.txt" in serve and "-c constraints.txt" in test


def test_constraints_pin_versions_that_pyproject_admits():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    for requirement in map(Requirement, wanted):
        if canonicalize_name(requirement.name) == "tollway":
            continue
        version = pins.get(canonicalize_name(requirement.name))
        assert version is not None, f"constraints.txt does not pin {requirement.name}"
        assert requirement.specifier.contains(version, prereleases=True), f"{requirement}: pinned {version}"
