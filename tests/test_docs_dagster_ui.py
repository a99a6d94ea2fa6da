"""Every ``defs.yaml`` in docs/dagster-ui.md loads: its component resolves, every pair is planned, and
its syncs and streams become definitions (no I/O)."""

import re
from pathlib import Path

import dagster as dg
import pytest
import yaml

from faucet_dagster.components import FaucetComponent

PAGE = Path(__file__).resolve().parents[1] / "docs" / "dagster-ui.md"
SNIPPETS = re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"yaml{n}" for n in range(len(SNIPPETS))])
def test_each_defs_yaml_of_the_page_loads(snippet: str) -> None:
    declared = yaml.safe_load(snippet)
    assert declared["type"] == "faucet_dagster.components.FaucetComponent"
    component = FaucetComponent.resolve_from_yaml(yaml.safe_dump(declared["attributes"]))
    component.check("docs/dagster-ui.md")
    defs = dg.Definitions.merge(component.build_sync_defs(), component.build_stream_defs())
    dg.Definitions.validate_loadable(defs)
    assert defs.assets


def test_the_page_has_its_snippets() -> None:
    assert len(SNIPPETS) == 2
