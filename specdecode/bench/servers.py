"""`specdecode serve` subprocesses for the serving benchmark: one per speculation mode (off / fixed K / adaptive),
started on free local ports, waited for until /health answers, their CPU time read from /proc, stopped at the end."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specdecode.errors import ConfigError

MODES = ("off", "fixed", "adaptive")


@dataclasses.dataclass
class ServerSpec:
    """How to start one server."""

    mode: str
    """off (plain decoding), fixed (always K draft tokens) or adaptive (K per step, the default)."""
    model: str | None = "smollm2-135m-instruct"
    """--model (None: serve's default model)."""
    method: str = "ngram"
    """--speculative-method of the fixed and adaptive modes."""
    k: int = 5
    """--num-speculative-tokens (fixed: K; adaptive: the most)."""
    max_num_seqs: int = 16
    """--max-num-seqs."""
    max_model_len: int = 2048
    """--max-model-len."""
    dtype: str = "float32"
    threads: int = 1
    """torch threads of the server process (OMP_NUM_THREADS)."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"unknown server mode {self.mode!r}; choose from {', '.join(MODES)}")

    def argv(self, port: int) -> list[str]:
        args = [sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port), "--max-num-seqs",
                str(self.max_num_seqs), "--max-model-len", str(self.max_model_len), "--dtype", self.dtype,
                "--log-level", "warning"]
        if self.model is not None:
            args += ["--model", str(self.model)]
        if self.mode == "off":
            return args + ["--no-speculation"]
        args += ["--speculative-method", self.method, "--num-speculative-tokens", str(self.k)]
        return args + (["--no-adaptive"] if self.mode == "fixed" else ["--adaptive"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedServer:
    """A running `specdecode serve`; use as a context manager (stopped on exit, even on errors)."""

    def __init__(self, spec: ServerSpec, log_dir: Path, startup_timeout: float = 600.0):
        self.spec = spec
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server_{spec.mode}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads), "MKL_NUM_THREADS": str(spec.threads)}
        self.command = spec.argv(self.port)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.startup_timeout = startup_timeout

    def wait_ready(self) -> float:
        """Seconds until /health answered 200; raises (with the server's log) if it died or took too long."""
        start = time.perf_counter()
        while time.perf_counter() - start < self.startup_timeout:
            if self.process.poll() is not None:
                raise ConfigError(f"specdecode serve ({self.spec.mode}) exited with {self.process.returncode}:\n"
                                  + self.log_path.read_text()[-2000:])
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ConfigError(f"specdecode serve ({self.spec.mode}) was not ready after {self.startup_timeout:.0f} s; "
                          f"see {self.log_path}")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far (0 where /proc is missing)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def stop(self) -> None:
        terminate(self.process)

    def __enter__(self) -> "ManagedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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


def terminate(process: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM a child process, SIGKILL it if it has not ended within `timeout` seconds, and reap it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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
