"""Start and stop the services as processes on loopback: used by the tests and the benchmark harness.

A model service is started with `--port 0`; it prints the port it bound on its first line, then "ready" once the
model is loaded. The gateway is started on a free port and polled on /health. Processes are stopped by PID.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LISTEN = re.compile(r"tandem: \S+ listening on ([\d.]+):(\d+)")
READY = re.compile(r"tandem: \S+ ready on ")


@dataclass
class Process:
    name: str
    proc: subprocess.Popen
    address: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_line(path: Path, pattern: re.Pattern, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = pattern.search(path.read_text(errors="replace"))
        if match:
            return match
        if proc.poll() is not None:
            tail = path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{tail}")
        time.sleep(0.05)
    raise TimeoutError(f"{proc.args} did not print {pattern.pattern!r} within {timeout} s")


def start_model_service(
    module: str,
    args: list[str],
    log_dir: Path,
    wait_ready: bool = True,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
) -> Process:
    """Start `python -m module --host 127.0.0.1 --port 0 ...` and return once it is ready (or just listening).

    `cpus` pins the process (and every thread it starts) to those cores, e.g. to give a draft and a target a core
    each, as two devices would.
    """
    name = module.rsplit(".", 1)[-1]
    log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0", *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
    try:
        match = wait_for_line(log_path, LISTEN, proc, 60)
        process = Process(name, proc, f"{match.group(1)}:{match.group(2)}", log_path)
        if wait_ready:
            wait_for_line(log_path, READY, proc, timeout)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        raise
    return process


def wait_http_ok(url: str, proc: subprocess.Popen, timeout: float, any_status: bool = False) -> None:
    """Poll `url` until it answers 200 (with any_status: until it answers at all)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError:
            if any_status:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not OK within {timeout} s")


def start_gateway(
    target: str,
    draft: str | None,
    log_dir: Path,
    *extra: str,
    timeout: float = 300,
    module: str = "services.gateway",
    env: dict[str, str] | None = None,
    wait_healthy: bool = True,
) -> Process:
    """Start a gateway on a free port and wait for /health. A co-located gateway (`--colocate`, see
    start_colocated_gateway) ignores the addresses and loads the models named in `env` itself."""
    port = free_port()
    log_path = log_dir / f"gateway-{port}.log"
    args = ["--host", "127.0.0.1", "--port", str(port), "--target", target, "--draft", draft or "", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    process = Process("gateway", proc, f"http://127.0.0.1:{port}", log_path)
    try:
        if not wait_healthy:  # only until it answers HTTP at all (/health may say 503: loading, or an error)
            wait_http_ok(f"{process.address}/v1/models", proc, timeout, any_status=True)
            return process
        wait_http_ok(f"{process.address}/health", proc, timeout)
    except BaseException:
        process.stop()
        raise
    return process


def settings_from_flags(flags: list[str]) -> dict[str, str]:
    """A service's flags as the settings names a co-located gateway reads from TANDEM_TARGET_* / TANDEM_DRAFT_*:
    ['--n-threads', '2', '--no-prefix-cache'] -> {'n_threads': '2', 'prefix_cache': 'false'}."""
    settings: dict[str, str] = {}
    i = 0
    while i < len(flags):
        name = flags[i].removeprefix("--").replace("-", "_")
        if name.startswith("no_"):
            settings[name[3:]] = "false"
            i += 1
        else:
            settings[name] = flags[i + 1]
            i += 2
    return settings


def start_colocated_gateway(
    log_dir: Path,
    target_args: dict[str, str],
    draft_args: dict[str, str] | None,
    *extra: str,
    timeout: float = 300,
    module: str = "services.gateway",
    wait_healthy: bool = True,
) -> Process:
    """A gateway that loads the target (and the draft, unless None) into its own process: `--colocate`, with each
    model's settings as its TANDEM_TARGET_* / TANDEM_DRAFT_* variables ({"n_threads": "1"} -> TANDEM_TARGET_N_THREADS).
    """
    env = {f"TANDEM_TARGET_{k.upper()}": v for k, v in target_args.items()}
    env.update({f"TANDEM_DRAFT_{k.upper()}": v for k, v in (draft_args or {}).items()})
    # The addresses only say whether there is a draft (an empty --draft means none); nothing is dialled.
    return start_gateway(
        "in-process", "in-process" if draft_args is not None else None, log_dir, "--colocate", *extra,
        timeout=timeout, module=module, env=env, wait_healthy=wait_healthy,
    )  # fmt: skip
