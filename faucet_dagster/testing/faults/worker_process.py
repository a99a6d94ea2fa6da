"""A fault worker as the controller sees it: a child process (``python -m
faucet_dagster.testing.faults.worker``) given its :class:`~.spec.WorkerSpec` on stdin, armed with a
fault point through the environment, its events read from stdout on a thread (and copied beside its
stderr log), signalled, waited for and killed.
"""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from faucet_dagster.runner.faults import FAULT_POINT_ENV, Arming
from faucet_dagster.testing.faults.spec import Event, WorkerSpec


class HarnessError(Exception):
    """The harness itself could not carry a case out (a worker hung past every deadline)."""


class WorkerProcess:
    """A fault worker process, its events (read on a thread) and its stderr log."""

    def __init__(self, spec: WorkerSpec, arming: Arming | None, log: Path) -> None:
        env = {key: value for key, value in os.environ.items() if key != FAULT_POINT_ENV}
        if arming is not None:
            env[FAULT_POINT_ENV] = arming.to_env()
        self.spec = spec
        self.log = log
        self._stderr: IO[bytes] = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "faucet_dagster.testing.faults.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(spec.to_json().encode())
        self.proc.stdin.close()
        self.events: list[Event] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[bytes]) -> None:
        with self.log.with_suffix(".events").open("wb") as copy:
            for line in stream:
                copy.write(line)
                with contextlib.suppress(ValueError, KeyError):
                    event = Event.from_line(line.decode())
                    with self._changed:
                        self.events.append(event)
                        self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, wanted: Callable[[Event], bool], timeout: float) -> Event | None:
        """The first event ``wanted`` accepts, waiting up to ``timeout`` seconds (None: none came)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((event for event in self.events if wanted(event)), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0 or not self._reader.is_alive():
                    return found
                self._changed.wait(left)

    def wait(self, timeout: float) -> int:
        """The exit code (negative: the signal that ended it); HarnessError after ``timeout``."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise HarnessError(f"worker {self.spec.worker_id} did not exit within {timeout:.0f}s") from None
        self._reader.join(10)
        return code

    def send(self, sig: signal.Signals) -> bool:
        """Send ``sig`` while the process runs; False when it had already exited."""
        if self.proc.poll() is not None:
            return False
        self.proc.send_signal(sig)
        return True

    def is_stopped(self) -> bool:
        """True while the process is stopped (SIGSTOP)."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    def error(self) -> Event | None:
        return next((event for event in reversed(self.events) if event.event == "error"), None)

    def count(self, *names: str) -> int:
        return sum(1 for event in self.events if event.event in names)

    def tail(self) -> str:
        """The last lines of the worker's stderr (tracebacks, warnings)."""
        self._stderr.flush()
        lines = self.log.read_text(errors="replace").splitlines()
        return " | ".join(lines[-6:])

    def close(self) -> None:
        """Kill the process if it still runs (a stopped one is continued first) and release files."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
                self.proc.send_signal(signal.SIGCONT)
            self.proc.wait(30)
        self._reader.join(10)
        self._stderr.close()
