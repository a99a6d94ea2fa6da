"""The example project deployed as a user deploys it, for tests that look at what the UI shows.

One code server (``dagster api grpc``) serves a copy of the example project, named in a
``workspace.yaml`` that a real ``dagster-daemon run`` (it ticks the sensors: the streams run) and a real
``dagster-webserver`` (the UI and its GraphQL API) both load. :meth:`UiDeployment.graphql` asks the
webserver what its pages ask it.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "example_project"
LOCATION = "example_project"
REPOSITORY = "__repository__"
BOUND = 180.0
"""Generous bound for any condition (a loaded machine)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class UiDeployment:
    """A copy of the example project, its code server, a daemon and a webserver (see the module)."""

    def __init__(self, root: Path, env: Mapping[str, str], *, interval: int = 5) -> None:
        self.root = root
        self.project = root / "example_project"
        shutil.copytree(
            EXAMPLE,
            self.project,
            ignore=shutil.ignore_patterns(".faucet_data", ".dagster_home", "__pycache__", ".mypy_cache"),
        )
        streams = self.project / "example_project" / "defs" / "streams" / "defs.yaml"
        # The streams tick every few seconds here (30 s by default), for a test that waits on ticks.
        streams.write_text(
            streams.read_text().replace(
                "      running: true\n", f"      running: true\n      minimum_interval_seconds: {interval}\n"
            )
        )
        self.home = root / "dagster_home"
        self.home.mkdir()
        # No onboarding dialog over the pages, no telemetry from a test.
        (self.home / "dagster.yaml").write_text("nux:\n  enabled: false\ntelemetry:\n  enabled: false\n")
        self.env = {**os.environ, **env, "DAGSTER_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.web_port = free_port()

    def start(self) -> "UiDeployment":
        grpc_port = free_port()
        (self.project / "workspace.yaml").write_text(
            "load_from:\n"
            f"  - grpc_server: {{host: 127.0.0.1, port: {grpc_port}, location_name: {LOCATION}}}\n"
        )
        self._start(
            "server", "dagster", "api", "grpc", "-m", "example_project.definitions", "-p", str(grpc_port)
        )
        self.wait_for("the code server listening", lambda: _accepts(grpc_port))
        self._start("daemon", "dagster-daemon", "run", "-w", "workspace.yaml")
        self._start(
            "webserver",
            "dagster-webserver",
            "-w",
            "workspace.yaml",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.web_port),
        )
        self.wait_for("the webserver answering", self._answers)
        return self

    def _start(self, name: str, command: str, *args: str) -> None:
        log = self.root / f"{name}.log"
        self.logs.append(log)
        with log.open("wb") as out:
            self.processes.append(
                subprocess.Popen(
                    [str(Path(sys.executable).parent / command), *args],
                    cwd=self.project,
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def _answers(self) -> bool:
        try:
            self.graphql("{ version }")
        except OSError:
            return False
        return True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    def graphql(self, query: str, **variables: Any) -> Any:
        """The ``data`` of a GraphQL query to the webserver (its errors raise)."""
        request = urllib.request.Request(
            f"{self.url}/graphql",
            data=json.dumps({"query": query, "variables": variables}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert not answer.get("errors"), answer["errors"]
        return answer["data"]

    def wait_for(self, what: str, condition: Callable[[], bool], bound: float = BOUND) -> None:
        ends = time.monotonic() + bound
        while not condition():
            for process in self.processes:
                assert process.poll() is None, f"{process.args[0]} exited: {self.tail()}"
            assert time.monotonic() < ends, f"{what}: not within {bound:.0f}s\n{self.tail()}"
            time.sleep(0.5)

    def tail(self) -> str:
        return "\n".join(f"{log.name}: {log.read_text(errors='replace')[-2500:]}" for log in self.logs)

    def stop(self) -> None:
        """SIGTERM to the webserver, the daemon and the code server (each given a minute)."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def sensor_selector(name: str) -> dict[str, str]:
    return {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY, "sensorName": name}
