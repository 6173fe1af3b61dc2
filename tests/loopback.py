"""A test server in its own process on a free loopback port, stopped on exit
(moto for S3, Azurite for Azure): the one place such a process is started,
waited for and reaped."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Callable, Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(argv: list[str], log_path: str, ready: Callable[[], None], what: str, wait_s: float = 60) -> Iterator[None]:
    """Run `argv` (output to `log_path`) until the block ends; `ready()`
    raises OSError until the server answers."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    ready()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{what} did not start (see {log_path})") from None
                    time.sleep(0.1)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
