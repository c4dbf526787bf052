"""Host-side helpers of the sandbox: uids, process scans and kills, safe tar members, whether weak isolation
is allowed (`k3post.envs.sandbox`)."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import tarfile
import threading
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from k3post.envs.sandbox.limits import ENV_ALLOW_WEAK, UID_BASE, UID_POOL

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

_uid_counter = itertools.count()
_uid_lock = threading.Lock()


def _allocate_uid() -> int:
    """Pick a host uid for a new sandbox (distinct per process and instance)."""
    with _uid_lock:
        n = next(_uid_counter)
    return UID_BASE + (os.getpid() * 97 + n) % UID_POOL


def _is_root() -> bool:
    return os.geteuid() == 0


def _inner_python(mode: str = "system") -> tuple[str, list[str]]:
    """Interpreter to expose as ``python`` / ``python3`` in the sandbox.

    Args:
        mode: ``"system"`` uses ``/usr/bin/python3`` (or
            ``/usr/local/bin/python3``), which lives under the read-only
            ``/usr`` of the view and needs no extra bind; it falls back to
            ``"host"`` when neither exists.  ``"host"`` uses the interpreter
            running this code (``sys.executable``) with its installed
            packages: its installation prefix (and virtualenv, if any) is bound
            read-only at its own path.

    Returns:
        ``(interpreter_path, prefixes_to_bind)``.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in ("system", "host"):
        raise ValueError(f"python must be 'system' or 'host', got {mode!r}")
    if mode == "system":
        for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
            if os.path.exists(candidate):
                return candidate, []
    prefixes: list[str] = []
    for prefix in (sys.base_prefix, sys.prefix):
        real = os.path.realpath(prefix)
        if real.startswith("/usr/") or real == "/usr" or real in prefixes:
            continue
        prefixes.append(real)
    exe = sys.executable or os.path.join(os.path.realpath(sys.base_prefix), "bin", "python3")
    return exe, prefixes


def _world_traversable(path: str) -> bool:
    """Whether every directory from ``/`` down to ``path`` is world-searchable."""
    current = Path(path).resolve()
    for directory in [current, *current.parents]:
        try:
            if not os.stat(directory).st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _proc_uid(pid: int) -> int | None:
    """Real uid of a live (non-zombie) ``pid`` from ``/proc/<pid>/status``.

    Returns ``None`` for vanished processes and for zombies, which hold no
    resources and cannot be killed any further.
    """
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                    return None
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _scan_procs(token: bytes | None, uid: int | None) -> list[int]:
    """PIDs whose environment holds ``token`` or whose real uid is ``uid``."""
    found: list[int] = []
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == me:
            continue
        if uid is not None and _proc_uid(pid) == uid:
            found.append(pid)
            continue
        if token is not None:
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    if token in fh.read():
                        found.append(pid)
            except OSError:
                continue
    return found


def _count_user_procs(uid: int) -> int:
    """Number of processes whose real uid is ``uid``."""
    try:
        return sum(1 for e in os.listdir("/proc") if e.isdigit() and _proc_uid(int(e)) == uid)
    except OSError:
        return 0


def _kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _safe_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """Tar extraction filter: keep regular files, dirs and in-tree symlinks."""
    data_filter = getattr(tarfile, "data_filter", None)
    if data_filter is not None:
        try:
            return data_filter(member, dest)  # type: ignore[no-any-return]
        except tarfile.FilterError:
            return None
    # Older Pythons: a conservative manual filter.
    name = PurePosixPath(member.name)
    if name.is_absolute() or ".." in name.parts:
        return None
    if not (member.isfile() or member.isdir() or member.issym()):
        return None
    if member.issym():
        target = PurePosixPath(member.linkname)
        if target.is_absolute() or ".." in target.parts:
            return None
    member.mode &= 0o755 if member.isdir() else 0o644 | (member.mode & 0o111)
    member.uid = member.gid = 0
    member.uname = member.gname = ""
    return member


def weak_isolation_allowed() -> bool:
    """Whether :data:`ENV_ALLOW_WEAK` allows the ``rlimit`` fallback of ``backend="auto"``."""
    return os.environ.get(ENV_ALLOW_WEAK, "").strip().lower() in ("1", "true", "yes")
