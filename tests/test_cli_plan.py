"""`faucet plan`: prints the plan, or every violation with its code and a non-zero exit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from faucet_dagster.cli.main import EXIT_BAD_INPUT, EXIT_REFUSED, main

BEST_EFFORT_SOURCE = [
    "--set-source", "emits=changes",
    "--set-source", "operations=insert,update,delete",
    "--set-source", "ordering=partition",
    "--set-source", "replay=best_effort",
    "--set-source", "bounded=true",
    "--set-source", "continuous=true",
]  # fmt: skip
TABLE_SINK = [
    "--set-sink", "bounded_policies=append,upsert,replace,apply_changes",
    "--set-sink", "continuous_policies=append,apply_changes",
    "--set-sink", "durability=transactional",
]  # fmt: skip


def test_continuous_replace_from_best_effort_source_prints_every_violation() -> None:
    args = ["plan", "--mode", "continuous", "--policy", "replace", "--delivery", "effectively_once"]
    result = subprocess.run(
        [sys.executable, "-m", "faucet_dagster.cli.main", *args, *BEST_EFFORT_SOURCE, *TABLE_SINK],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == EXIT_REFUSED
    for code in (
        "source-not-replayable",
        "policy-not-supported",
        "replace-not-continuous",
        "operation-not-accepted",
        "effectively-once-unreachable",
    ):
        assert f"[{code}]" in result.stdout, result.stdout


def test_order_dependent_policy_without_key_from_partitioned_source(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "plan",
            "--mode",
            "continuous",
            "--policy",
            "apply_changes",
            "--json",
            *BEST_EFFORT_SOURCE,
            *TABLE_SINK,
        ]
    )
    assert code == EXIT_REFUSED
    result = json.loads(capsys.readouterr().out)
    assert result["accepted"] is False
    assert {v["code"] for v in result["violations"]} == {
        "source-not-replayable",
        "order-dependent-policy",
        "key-required",
    }


def test_accepted_pair_prints_its_guarantee_from_a_yaml_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = tmp_path / "pairs.yaml"
    pairs.write_text(
        """
pairs:
  - name: table_to_warehouse
    mode: bounded
    policy: upsert
    key: [id]
    source:
      capabilities: {emits: rows, operations: [insert], ordering: strict_global,
                     replay: replayable_at_least_once, bounded: true, continuous: false,
                     deterministic: true, columns: [id, name]}
    sink:
      capabilities: {bounded_policies: [append, upsert], atomic_watermark: true, durability: transactional}
  - name: log_to_queue
    mode: continuous
    policy: append
    source:
      capabilities: {emits: messages, operations: [insert], ordering: partition,
                     replay: replayable_at_least_once, bounded: false, continuous: true}
    sink:
      capabilities: {bounded_policies: [append], continuous_policies: [append], durability: acknowledged}
"""
    )
    assert main(["plan", "-f", str(pairs)]) == 0
    out = capsys.readouterr().out
    assert "table_to_warehouse: accepted, bounded upsert by (id): effectively-once" in out
    assert "atomic watermark" in out and "keyed upsert" in out
    assert "log_to_queue: accepted, continuous append: at-least-once" in out


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", "--mode", "bounded", "--policy", "append", "--set-source", "emits=nonsense"])
        == EXIT_BAD_INPUT
    )
    assert "emits" in capsys.readouterr().err
    missing = tmp_path / "missing.yaml"
    assert main(["plan", "-f", str(missing)]) == EXIT_BAD_INPUT
    assert str(missing) in capsys.readouterr().err
