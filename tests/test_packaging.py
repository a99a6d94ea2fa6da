"""The UI installs with Dagster in one resolution, at one version: the ``ui`` extra names the webserver
with the same bounds as Dagster itself, and the ``dev`` extra includes it."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_every_dagster_package_has_dagsters_own_bounds_and_dev_includes_the_ui() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    extras = project["optional-dependencies"]
    [dagster] = [r for r in requirements if r.name == "dagster"]
    assert dagster.specifier.contains("1.13.27") and not dagster.specifier.contains("1.14.0")
    ui = [Requirement(r) for r in extras["ui"]]
    assert {r.name for r in ui} == {"dagster-webserver", "dagster-graphql"}
    dagster_packages = [
        r
        for r in (Requirement(x) for group in extras.values() for x in group)
        if r.name.startswith("dagster")
    ]
    assert all(r.specifier == dagster.specifier for r in dagster_packages), dagster_packages
    assert "faucet-dagster[ui]" in extras["dev"]
