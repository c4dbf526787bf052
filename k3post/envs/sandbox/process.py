"""A long-lived sandboxed child (`Sandbox.spawn`, `k3post.envs.sandbox`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time


class SandboxProcess:
    """A child started by `Sandbox.spawn`: its pipes, its host pid (the command, not bwrap) and a kill."""

    def __init__(self, proc: subprocess.Popen[bytes], stderr_path: str, *, inner: bool, weak_isolation: bool) -> None:
        self.popen = proc
        self.stdin = proc.stdin
        self.stdout = proc.stdout
        self.weak_isolation = weak_isolation
        self._stderr_path = stderr_path
        self._inner = inner
        self._pid: int | None = None if inner else proc.pid

    @property
    def pid(self) -> int:
        """Host pid of the command (bwrap's namespace pid 1); waits up to 10 s for bwrap to start it."""
        deadline = time.monotonic() + 10.0
        while self._pid is None:
            try:
                with open(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children") as fh:
                    kids = fh.read().split()
            except OSError:
                kids = []
            if kids:
                self._pid = int(kids[0])
            elif self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sandbox child did not start (exit status {self.popen.poll()})")
            else:
                time.sleep(0.001)
        return self._pid

    def stderr_tail(self, limit: int = 4000) -> str:
        """The last ``limit`` characters the child wrote to stderr."""
        try:
            with open(self._stderr_path, "rb") as fh:
                fh.seek(max(0, os.fstat(fh.fileno()).st_size - limit))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the child's process group (bwrap's ``--die-with-parent`` takes the namespace with it)."""
        for target in (self._pid,):
            if target is not None:
                try:
                    os.kill(target, signal.SIGKILL)
                except OSError:
                    pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except OSError:
            pass
        for stream in (self.stdin, self.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
