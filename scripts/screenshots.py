"""Renew the README's screenshots of the Dagster UI: ``.venv/bin/python scripts/screenshots.py``.

Runs the README's tour on a fresh copy of the example project, in a temporary folder: starts the
example's servers (``python -m example_project.servers``), runs command one (the syncs), publishes
order events to NATS and Kafka, starts ``dg dev`` on a free port and waits until both streams have
certified epochs that Dagster received. Then it opens each page in Debian's Chromium, headless (``apt-get
install -y chromium``; ``--chromium PATH`` for another), driven through the DevTools protocol, waits
until the page shows what the shot is about, and saves it under ``docs/images/``:

* ``sync-materialization.png``: the ``customers`` sync's latest materialization and its metadata;
* ``sync-asset-automation.png``: the ``orders`` sync's asset, its schedule, sensor and checks;
* ``sync-materialization-events.png``: the ``orders`` sync's materializations, a partition each;
* ``stream-asset-automation.png``: the ``order_events_nats`` stream's asset, linked to its sensor;
* ``stream-sensor-ticks.png``: that sensor's ticks, each saying what it reported;
* ``stream-certificate.png``: the ``order_events_nats`` stream's latest report of its certificates;
* ``stream-health.png``: its ``faucet_stream_health`` check, passing with the lag;
* ``stream-stalled.png``: the same check failing with its reason and remedy, once the servers stopped.

Everything it started is stopped at the end, and the temporary folder deleted. Needs the ``dev`` extra
(``dg``, the webserver, the servers' wheels).
"""

import argparse
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

from faucet_dagster.testing.servers._base import _free_port as free_port

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
VENV_BIN = Path(sys.executable).parent
WIDTH, HEIGHT = 1440, 900
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
    f"--window-size={WIDTH},{HEIGHT}",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium executable")
    parser.add_argument("--events", type=int, default=20_000, help="order events published to each server")
    parser.add_argument("--out", type=Path, default=IMAGES, help="where the PNG files go")
    args = parser.parse_args()
    if not Path(args.chromium).is_file():
        print(f"no Chromium at {args.chromium}: apt-get install -y chromium", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="faucet-screenshots-")))
        project = work / "example_project"
        shutil.copytree(
            ROOT / "example_project",
            project,
            ignore=shutil.ignore_patterns(".faucet_data", ".dagster_home", "__pycache__"),
        )
        env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "FAUCET_STATE_URL")}
        env["DAGSTER_HOME"] = str(project / ".dagster_home")
        exports, stop_servers = stack.enter_context(example_servers(project, env))
        env |= exports
        step("command one: the syncs", [str(VENV_BIN / "python"), "-m", "example_project"], project, env)
        for server in ("nats", "kafka"):
            publish = [str(VENV_BIN / "python"), "-m", "example_project.publish", server, str(args.events)]
            step(f"publish {args.events} events to {server}", publish, project, env)
        port = free_port()
        stack.enter_context(dg_dev(project, env, port))
        wait_for_certificates(project, env, ("order_events_nats", "order_events_kafka"))
        browser = stack.enter_context(chromium(args.chromium, work / "chromium"))
        base = f"http://127.0.0.1:{port}"
        shoot(
            browser,
            f"{base}/assets/customers?view=events",
            "faucet/delivery",
            args.out / "sync-materialization.png",
        )
        shoot(
            browser, f"{base}/assets/orders", "faucet_orders_schedule", args.out / "sync-asset-automation.png"
        )
        shoot(
            browser,
            f"{base}/assets/orders?view=events",
            "faucet/delivery",
            args.out / "sync-materialization-events.png",
        )
        shoot(
            browser,
            f"{base}/assets/order_events_nats",
            "order_events_nats_stream",
            args.out / "stream-asset-automation.png",
        )
        shoot(
            browser,
            f"{base}/locations/example_project/sensors/order_events_nats_stream",
            "certified",
            args.out / "stream-sensor-ticks.png",
        )
        shoot(
            browser,
            f"{base}/assets/order_events_nats?view=events",
            "faucet/coverage",
            args.out / "stream-certificate.png",
        )
        shoot(
            browser,
            f"{base}/assets/order_events_nats?view=checks",
            "faucet_stream_health",
            args.out / "stream-health.png",
            click="faucet_stream_health",
            then_shows="faucet/lag",
        )
        print("-- stopping the servers: the next ticks stall", flush=True)
        stop_servers()
        shoot(
            browser,
            f"{base}/assets/order_events_nats?view=checks",
            "faucet_stream_health",
            args.out / "stream-stalled.png",
            click="faucet_stream_health",
            then_shows="faucet/remedy",
            reload_for=240,
        )
    return 0


def step(what: str, command: list[str], cwd: Path, env: dict[str, str]) -> None:
    print(f"-- {what}", flush=True)
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stdout}{done.stderr}")


@contextmanager
def example_servers(
    project: Path, env: dict[str, str]
) -> Iterator[tuple[dict[str, str], Callable[[], None]]]:
    """``python -m example_project.servers``: its ``export`` lines, and a function that stops the
    servers (as Ctrl-C does in the README's tour), while it runs."""
    print("-- the example's servers", flush=True)
    process = subprocess.Popen(
        [str(VENV_BIN / "python"), "-m", "example_project.servers"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )

    def stop() -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)

    try:
        exports: dict[str, str] = {}
        assert process.stdout is not None
        for line in process.stdout:
            found = re.match(r"export (\w+)=(.*)$", line.strip())
            if found:
                exports[found.group(1)] = found.group(2)
            if line.startswith("# running"):
                break
        if len(exports) != 3:
            raise RuntimeError(f"the servers printed {sorted(exports)}, not three export lines")
        yield exports, stop
    finally:
        stop()


@contextmanager
def dg_dev(project: Path, env: dict[str, str], port: int) -> Iterator[None]:
    """``dg dev`` (webserver, daemon, code servers) on ``port``, stopped with its whole process group."""
    print(f"-- dg dev on port {port}", flush=True)
    log = open(project / "dg-dev.log", "w")  # noqa: SIM115 - closed below, after the process
    process = subprocess.Popen(
        [str(VENV_BIN / "dg"), "dev", "-p", str(port)],
        cwd=project,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not answers(f"http://127.0.0.1:{port}/server_info"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dg dev did not serve: {(project / 'dg-dev.log').read_text()[-3000:]}")
            time.sleep(1)
        yield
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        log.close()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def wait_for_certificates(project: Path, env: dict[str, str], streams: tuple[str, ...]) -> None:
    """Until Dagster received the report of a certificate of each stream (the state store says)."""
    print(f"-- waiting for certificates of {', '.join(streams)}", flush=True)
    deadline = time.monotonic() + 600
    while True:
        done = subprocess.run(
            [str(VENV_BIN / "faucet"), "streams", "status", "--json"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        statuses = {status["stream"]: status for status in json.loads(done.stdout or "[]")}
        if all((statuses.get(name, {}).get("reported_through") or 0) >= 1 for name in streams):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no certificates reported within 600 s: {statuses}")
        time.sleep(5)


class Browser:
    """One Chromium page driven through the DevTools protocol."""

    def __init__(self, page: ClientConnection) -> None:
        self._page = page
        self._next = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        self._page.send(json.dumps({"id": self._next, "method": method, "params": params}))
        while True:
            message = json.loads(self._page.recv(timeout=120))
            if message.get("id") == self._next:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")


@contextmanager
def chromium(executable: str, profile: Path) -> Iterator[Browser]:
    """Headless Chromium with a fresh profile, and a connection to its first page."""
    profile.mkdir()
    process = subprocess.Popen(
        [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not active.exists() or len(active.read_text().splitlines()) < 2:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.2)
        port = active.read_text().splitlines()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            pages = [target for target in json.load(response) if target["type"] == "page"]
        with connect(pages[0]["webSocketDebuggerUrl"], max_size=None) as page:
            browser = Browser(page)
            browser.call(
                "Emulation.setDeviceMetricsOverride",
                width=WIDTH,
                height=HEIGHT,
                deviceScaleFactor=1,
                mobile=False,
            )
            yield browser
    finally:
        process.terminate()
        process.wait(timeout=60)


CLICK = """(text) => {
  const found = [...document.querySelectorAll("button, a, span, div")]
    .filter((node) => node.innerText && node.innerText.trim() === text);
  if (!found.length) return false;
  found[found.length - 1].click();
  return true;
}"""
"""Click the innermost element whose text is ``text`` (false when there is none)."""


def shoot(
    browser: Browser,
    url: str,
    shows: str,
    path: Path,
    *,
    click: str | None = None,
    then_shows: str | None = None,
    reload_for: float = 0.0,
) -> None:
    """Open ``url``, wait until the page's text holds ``shows`` (after clicking ``click``, until it holds
    ``then_shows``, reloading the page for up to ``reload_for`` seconds), close Dagster's welcome
    dialog (:func:`close_welcome`), let the page's other queries end, and save a PNG."""
    print(f"-- {path.name}: {url}", flush=True)
    deadline = time.monotonic() + reload_for
    while True:
        browser.call("Page.navigate", url=url)
        wait_for_text(browser, shows, url)
        close_welcome(browser)
        if click is None:
            break
        if not browser.evaluate(f"({CLICK})({json.dumps(click)})"):
            raise RuntimeError(f"{url} has nothing to click named {click!r}")
        try:
            wait_for_text(browser, then_shows or click, url, timeout=30 if reload_for else 120)
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
    time.sleep(3)  # the rest of the page's queries
    close_welcome(browser)  # it may open only after the page's queries
    png = browser.call("Page.captureScreenshot", format="png")["data"]
    path.write_bytes(base64.b64decode(png))


WELCOME = "Join the Dagster community"


def close_welcome(browser: Browser) -> None:
    """Skip Dagster's welcome dialog if it shows: it opens over every page until skipped once."""
    deadline = time.monotonic() + 30
    while browser.evaluate(f"document.body.innerText.includes({json.dumps(WELCOME)})"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {WELCOME!r} dialog did not close")
        browser.evaluate(f"({CLICK})('Skip')")
        time.sleep(0.5)


def wait_for_text(browser: Browser, text: str, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not browser.evaluate(f"document.body && document.body.innerText.includes({json.dumps(text)})"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not show {text!r} within {timeout:.0f} s")
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
