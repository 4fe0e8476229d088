"""Run a benchmark child process with a wall-clock limit, streaming its output.

Used by ``bench_decode.py`` (the Hugging Face worker). The child gets its own process group, so a timeout
kills it together with anything it started (torch.compile workers); its output is echoed
line by line with a prefix, optionally copied to a log file, and the last lines are kept for
error records.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM (children save partial results on it), then SIGKILL, the child's group."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_streaming(cmd: list[str], timeout: float, prefix: str = "    | ",
                  env: dict | None = None, cwd: str | None = None, log_path: str | None = None,
                  tail_lines: int = 60, grace_s: float = 10.0):
    """Run ``cmd``; returns ``(returncode or "timeout", tail lines, wall seconds)``."""
    tail: collections.deque = collections.deque(maxlen=tail_lines)
    log_file = open(log_path, "w") if log_path else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace",
                            env=dict(env or os.environ, PYTHONUNBUFFERED="1"),
                            start_new_session=True, cwd=cwd)

    def pump():
        for line in proc.stdout:
            if log_file:
                log_file.write(line)
                log_file.flush()
            line = line.rstrip("\n")
            tail.append(line)
            print(f"{prefix}{line}", flush=True)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        if proc.poll() is None:          # timeout, or we are being stopped ourselves
            kill_group(proc, grace_s)
        reader.join(5)
        if log_file:
            log_file.close()
    return rc, list(tail), time.perf_counter() - t0
