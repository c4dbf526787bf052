"""Host-side helpers of the sandbox: uids, process scans and kills, safe tar members, whether weak isolation
is allowed (`k3post.envs.sandbox`)."""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import signal
import stat
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


UID_LOCKS = Path("/tmp/k3post-sandbox-uids")
"""Where a sandbox's uid is claimed: an exclusive ``flock`` on the file named by the uid, held while it is open. A
fixed path, not ``$TMPDIR``'s: every process on the host must see the same claims."""


def _allocate_uid() -> tuple[int, int]:
    """A host uid for a new sandbox that no other open sandbox on this host holds, and the fd of its claim.

    The candidates start at a point spread by pid and instance count and go up the pool; the first whose file in
    `UID_LOCKS` this process can ``flock`` is taken, held until the sandbox closes (`release_uid`) or its process
    dies. The start point alone was the whole allocation before: two processes' sandboxes shared a uid whenever
    their points met (pids d apart, counts 97·d apart), and ``RLIMIT_NPROC`` counts every process and thread of
    a uid, so one sandbox's processes (a browser's) spent the other's budget and its next process failed with
    EAGAIN: a correct kernel that did not compile scored 0 (seen in the test run, two pytest workers)."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    st = UID_LOCKS.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:  # lstat: a link is no dir
        raise RuntimeError(f"{UID_LOCKS}: the sandbox uid claims need a directory of this user's only (mode 0700); "
                           "remove it or fix its owner and mode")
    with _uid_lock:
        n = next(_uid_counter)
    start = (os.getpid() * 97 + n) % UID_POOL
    for k in range(UID_POOL):
        uid = UID_BASE + (start + k) % UID_POOL
        fd = os.open(UID_LOCKS / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise RuntimeError(f"all {UID_POOL} sandbox uids from {UID_BASE} are held by open sandboxes")


def release_uid(fd: int | None) -> None:
    """Give back a uid `_allocate_uid` claimed (closing its fd drops the lock)."""
    if fd is not None:
        os.close(fd)


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
