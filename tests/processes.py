"""Real processes a test starts and reads: a command's output line by line
(:class:`Output`), and a cluster of ``dask scheduler`` and ``dask worker`` processes as a
deployment starts them (:class:`DaskProcesses`). Test modules import it as ``processes``
(pytest puts ``tests/`` first on ``sys.path``; ``conftest`` is ambiguous there, with
``tests/data/conftest.py`` beside it)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import psutil
from distributed import Client


def stacks(pid: int) -> str:
    """Every thread's Python stack in process ``pid``, as py-spy dumps them (a test
    dependency; "" where it is not installed): what a test that found a process stuck
    says of where."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return ""
    done = subprocess.run(
        [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
    )
    return done.stdout + done.stderr


class Output:
    """A process started with its output (stdout and stderr together) read line by line on a
    thread of its own, so that a test waits for a line it expects instead of polling."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, **kwargs) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            args,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **kwargs,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self.lines.append("")  # the end of the output
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        """The first line that matches ``pattern``, once it was printed."""
        regex = re.compile(pattern)
        seen = 0

        def found() -> re.Match[str] | bool | None:
            nonlocal seen
            for line in self.lines[seen:]:
                if line == "":
                    return True  # the process closed its output
                if m := regex.search(line):
                    return m
            seen = len(self.lines)
            return None

        with self._cond:
            match = self._cond.wait_for(found, timeout)
        if not isinstance(match, re.Match):
            raise AssertionError(
                f"{self.proc.args[:4]} never printed {pattern!r}:\n{self.text()[-3000:]}"
            )
        return match

    def text(self) -> str:
        with self._cond:
            return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._reader.join(timeout)


class DaskProcesses:
    """``dask scheduler`` (no preload) and ``dask worker`` processes (one thread, with a
    nanny each) on loopback ports the OS picks, as a deployment starts them by hand."""

    def __init__(self, n_workers: int = 2, env: dict[str, str] | None = None) -> None:
        self.env = env or {}
        self.scheduler = Output(
            [sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
             "--dashboard-address", "127.0.0.1:0"],
            self.env,
        )  # fmt: skip
        self.address = self.scheduler.wait_for(r"Scheduler at:\s+(\S+)")[1]
        self.workers = [self.add_worker() for _ in range(n_workers)]
        if n_workers:
            with Client(self.address) as client:
                client.wait_for_workers(n_workers, timeout=120)

    def add_worker(self, worker_port: int | None = None, *args: str) -> Output:
        """One more worker; ``worker_port`` fixes its port, as deployments often do (then a
        worker its nanny restarts comes back at the same address); ``args`` go to
        ``dask worker`` too (``--no-nanny``)."""
        port = [] if worker_port is None else ["--worker-port", str(worker_port)]
        return Output(
            [sys.executable, "-m", "dask", "worker", self.address, "--nthreads", "1",
             "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0", *port, *args],
            self.env,
        )  # fmt: skip

    def stacks(self) -> str:
        """Every thread's Python stack in the worker processes (each ``dask worker``'s
        nanny runs its worker as a child), for a test that found them unresponsive."""
        dumps = []
        for worker in self.workers:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(worker.proc.pid).children():
                    dumps.append(f"--- worker (pid {child.pid})\n{stacks(child.pid)}")
        return "\n".join(dumps)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.scheduler.stop()
