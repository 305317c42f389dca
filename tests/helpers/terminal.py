"""A child process on a pseudo-terminal, for tests of what a command does in a real terminal."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time


class Terminal:
    """A child process on a pseudo-terminal, and everything it wrote so far."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.fd, child_fd = pty.openpty()
        self.process = subprocess.Popen(command, stdin=child_fd, stdout=child_fd, stderr=child_fd, env=env,
                                        close_fds=True, start_new_session=True)
        os.close(child_fd)
        self.screen = ""

    def read_until(self, text: str, timeout_s: float = 30.0, start: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.screen[start:]:
            assert time.monotonic() < deadline, f"no {text!r} in {self.screen!r}"
            if select.select([self.fd], [], [], 0.05)[0]:
                try:
                    self.screen += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    break

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait(self, timeout_s: float = 30.0) -> int:
        """The child's exit code, reading its output meanwhile (a full pty would block its writes)."""
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None:
            assert time.monotonic() < deadline, "the child did not exit"
            if select.select([self.fd], [], [], 0.05)[0]:
                try:
                    self.screen += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:
                    pass
        return self.process.returncode

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        os.close(self.fd)
