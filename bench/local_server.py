"""A ``python -m serving.server`` in a subprocess on a free loopback port, for the load
test (``bench.load``) and the CI tests that drive a real server (``tests/test_load.py``,
``tests/test_fuzz.py``); and the reading of its ``/metrics``.

The server runs with ``JAX_LOG_COMPILES=1``, so every XLA compile writes one "Compiling"
line to its log: ``compiled()`` lists them, which says whether a load compiled anything
even when the server exports no compile counter of its own.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
# jax's log line for one compile (pxla, with jax_log_compiles): "Compiling jit(name) with ..."
COMPILE_LINE = re.compile(r"Compiling (\S+) with")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", re.M)


def check_loopback(url: str) -> str:
    """``url`` without a trailing slash.

    Raises:
      ValueError: ``url`` is not http(s) on a loopback address (the load test only
        targets servers on this machine).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"--url {url!r}: only http(s) on a loopback address is allowed")
    return url.rstrip("/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(client: httpx.Client | None, url: str) -> dict[str, float]:
    """The unlabelled samples of ``url``'s ``/metrics`` (Prometheus text), by name."""
    text = (client or httpx).get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[3]) for m in _SAMPLE.finditer(text) if not m[2]}


def compile_counter(metrics: dict[str, float]) -> float | None:
    """The server's own count of compiles, if it exports one (a counter whose name says
    ``compil``), else None."""
    values = [v for name, v in metrics.items() if "compil" in name and name.endswith("_total")]
    return sum(values) if values else None


class LocalServer:
    """``python -m serving.server *args`` on 127.0.0.1 and a free port, logging to
    ``log_path``; a context manager that waits for ``/health`` and stops it (SIGTERM)."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 600.0,
    ):
        self.args, self.log_path, self.start_timeout_s = list(args), Path(log_path), start_timeout_s
        self.env = {**os.environ, **(env or {}), "JAX_LOG_COMPILES": "1"}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LocalServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "serving.server", *self.args]
                + ["--host", "127.0.0.1", "--port", str(self.port)],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited at start:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.log_tail()}")
            time.sleep(0.25)

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def compiled(self) -> list[str]:
        """What the server has compiled since it started, in order (``jit(name)``, one
        entry per compile)."""
        return COMPILE_LINE.findall(self.log())
