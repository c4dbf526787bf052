"""What a sandboxed command printed and why it ended: the output pump (stdin fed, stdout / stderr captured up to a
cap, the wall-clock deadline and the output limit enforced by killing the run's tree) and the exit classifier
(`k3post.envs.sandbox`)."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from k3post.envs.sandbox.host import _signal_name
from k3post.envs.sandbox.limits import _DRAIN_GRACE_S, _READ_CHUNK


@dataclass(frozen=True)
class Captured:
    """One finished run as the pump saw it (exit status as `subprocess` reports it)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None  # "wall_timeout" / "output_limit" when the pump killed the run, else None
    truncated: bool
    wall_s: float


def communicate(proc: subprocess.Popen[bytes], stdin_bytes: bytes | None, timeout: float, start: float, *,
                cap: int, kill_on_output_limit: bool, kill: Callable[[], None]) -> Captured:
    """Feed ``stdin_bytes`` to ``proc`` and capture at most ``cap`` bytes of each of its stdout and stderr until it
    and every process holding its pipes are gone. ``kill()`` kills the run's whole tree: called at the deadline
    (``start`` + ``timeout``, monotonic), when the output passes ``cap`` with ``kill_on_output_limit``, and once
    the main process has exited (stragglers holding the pipes)."""
    bufs: dict[int, bytearray] = {}
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    for stream in (proc.stdout, proc.stderr):
        fd = stream.fileno()
        os.set_blocking(fd, False)
        bufs[fd] = bytearray()
        sel.register(fd, selectors.EVENT_READ)
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    stdin_view = memoryview(stdin_bytes) if stdin_bytes else None
    if stdin_view is not None and proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)

    deadline = start + timeout
    killed_reason: str | None = None
    timed_out = False
    truncated = False
    killed = False
    drain_deadline: float | None = None
    exited_cleanup_done = False

    def close_stdin() -> None:
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                sel.unregister(proc.stdin.fileno())
            except (KeyError, ValueError):
                pass
            try:
                proc.stdin.close()
            except OSError:
                pass

    try:
        while sel.get_map():
            now = time.monotonic()
            if not killed and now >= deadline:
                timed_out = True
                killed_reason = "wall_timeout"
                kill()
                killed = True
                drain_deadline = time.monotonic() + _DRAIN_GRACE_S
            if drain_deadline is not None and time.monotonic() >= drain_deadline:
                break
            wait = 0.1
            limit_at = drain_deadline if drain_deadline is not None else deadline
            wait = max(0.0, min(wait, limit_at - time.monotonic()))
            events = sel.select(wait)
            if not exited_cleanup_done and proc.poll() is not None:
                # Main process is gone; stragglers may still hold the pipes.
                exited_cleanup_done = True
                kill()
                if drain_deadline is None:
                    drain_deadline = time.monotonic() + _DRAIN_GRACE_S
            for key, _mask in events:
                fd = int(key.fd)
                if proc.stdin is not None and not proc.stdin.closed and fd == proc.stdin.fileno():
                    assert stdin_view is not None
                    try:
                        n = os.write(fd, stdin_view[:_READ_CHUNK])
                        stdin_view = stdin_view[n:]
                    except BlockingIOError:
                        continue
                    except (BrokenPipeError, OSError):
                        stdin_view = stdin_view[len(stdin_view) :]
                    if not len(stdin_view):
                        close_stdin()
                    continue
                try:
                    chunk = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                room = cap - len(buf)
                if room > 0:
                    buf += chunk[:room]
                if len(chunk) > room:
                    truncated = True
                    if kill_on_output_limit and not killed:
                        killed_reason = "output_limit"
                        kill()
                        killed = True
                        drain_deadline = time.monotonic() + _DRAIN_GRACE_S
    finally:
        close_stdin()
        sel.close()
        for stream in (proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass

    remaining = max(0.1, deadline - time.monotonic()) if not killed else 5.0
    try:
        proc.wait(timeout=remaining)
    except subprocess.TimeoutExpired:
        timed_out = True
        killed_reason = killed_reason or "wall_timeout"
        kill()
        proc.wait(timeout=5)
    if not exited_cleanup_done:
        kill()
    wall = time.monotonic() - start
    return Captured(returncode=int(proc.returncode), stdout=bytes(bufs[out_fd]).decode("utf-8", errors="replace"),
                    stderr=bytes(bufs[err_fd]).decode("utf-8", errors="replace"), timed_out=timed_out,
                    killed_reason=killed_reason, truncated=truncated, wall_s=wall)


def classify_exit(rc: int, stderr: str) -> str | None:
    """Map an exit status (and stderr tail) to a ``killed_reason``."""
    if rc == 0:
        return None
    if rc == -signal.SIGXCPU:
        return "cpu_limit"
    if rc == -signal.SIGXFSZ:
        return "file_size"
    tail = stderr[-4000:]
    if rc > 0:
        if "MemoryError" in tail or "Cannot allocate memory" in tail or "std::bad_alloc" in tail:
            return "memory"
        if "File too large" in tail:
            return "file_size"
        return None
    if rc == -signal.SIGKILL:
        # Our own kills are classified by the caller; an unexplained SIGKILL
        # is the hard CPU limit (soft+1 s) or the kernel OOM killer.
        return "signal:SIGKILL"
    return f"signal:{_signal_name(-rc)}"

