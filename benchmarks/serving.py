"""`specdecode serve` in a child process for the server benchmarks (fuzz_server.py, soak.py): start, wait until it
answers, read its memory, stop."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], port: int | None = None, timeout: float = 600) -> tuple[subprocess.Popen, str]:
    """Run `specdecode serve ARGS --port PORT` and wait for /health; returns (process, base url)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer within {timeout:g} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
