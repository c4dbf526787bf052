"""Run model-written code in an isolated, resource-limited sandbox.

:class:`Sandbox` executes commands (typically ``python solution.py`` and the
hidden unit tests) inside a private working directory with

* no network (a fresh, empty network namespace),
* a private filesystem view: read-only ``/usr`` (plus the ``/bin``, ``/lib*``
  links), a handful of ``/etc`` files that the dynamic loader and Python need
  (never ``/etc/shadow``), a size-capped tmpfs ``/tmp``, minimal ``/dev``, a
  fresh ``/proc`` and the working directory bound read-write at
  :data:`SANDBOX_DIR`; the project checkout and ``/root`` are not visible,
* resource limits: CPU time, wall time, address space, process count, file
  size, open files and captured output,
* whole-tree termination: the command runs in its own session, process group
  and PID namespace, so a detached grandchild dies with it.

Three isolation backends are tried in order (``backend="auto"``) and each is
probed once per interpreter by actually running ``true`` inside it:

``bwrap``
    bubblewrap with ``--unshare-all --unshare-user --disable-userns
    --die-with-parent --new-session``.
``unshare``
    util-linux ``unshare`` (user, mount, net, pid, ipc, uts namespaces) plus a
    small ``sh`` script that assembles the same view on a tmpfs and
    ``chroot``-s into it.
``rlimit``
    resource limits, a dedicated uid (when the host is root) and process-group
    killing only.  Filesystem and network are **not** isolated.

The sandbox fails closed: when neither namespace backend works, ``"auto"``
raises :class:`SandboxUnavailableError` (saying how to install bubblewrap)
instead of dropping to ``rlimit``, unless weak isolation was allowed
explicitly (``K3POST_ALLOW_WEAK_ISOLATION=1``, which the config key
``sandbox.allow_weak_isolation=true`` sets).  Naming ``rlimit`` (argument,
``K3POST_SANDBOX_BACKEND`` or ``sandbox.backend``) is such an explicit choice.
A weak sandbox logs a warning on every run and flags every
:class:`SandboxResult` with ``weak_isolation=True``.

The backend can be forced with ``Sandbox(backend=...)`` or the environment
variable ``K3POST_SANDBOX_BACKEND``.

Resource limits are applied before the command starts or the run does not
happen: a failed ``setrlimit`` raises :class:`RuntimeError` naming the limit.

When the host process is root, every sandbox runs under its own unprivileged
uid (allocated from :data:`UID_BASE`), because ``RLIMIT_NPROC`` is not
enforced for uid 0: the fork-bomb limit only holds for an unprivileged uid.
The uid switch and the rlimits are applied by util-linux ``setpriv`` and
``prlimit`` placed in front of the command (keeping ``subprocess`` on its
``vfork`` fast path and thread-safe), or by a ``preexec_fn`` where those
tools are missing.  Consequences for callers on a root host: a caller-given
``workdir`` must have world-searchable parents for the namespace backends
(pytest's 0700 ``tmp_path`` does not; ``workdir=None`` always works), and
files the sandbox writes are owned by the sandbox uid.

Inside the namespace view ``python``/``python3`` is ``/usr/bin/python3``
(stdlib only) unless ``Sandbox(python="host")`` binds the running
interpreter's prefix read-only.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import itertools
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Self

from k3post.errors import InfrastructureError

__all__ = [
    "BACKENDS",
    "SANDBOX_DIR",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "available_backends",
    "weak_isolation_allowed",
    "probe_backend",
]

logger = logging.getLogger(__name__)

#: Where the working directory appears inside the namespace backends.
SANDBOX_DIR = "/sandbox"
#: Backends in order of preference.
BACKENDS: tuple[str, ...] = ("bwrap", "unshare", "rlimit")
#: First host uid handed to sandboxes when the host process runs as root.
UID_BASE = 200_000
#: Number of uids in the pool starting at :data:`UID_BASE`.
UID_POOL = 100_000
#: uid / gid the sandboxed code sees inside the namespace backends.
INNER_UID = 1000

_ENV_BACKEND = "K3POST_SANDBOX_BACKEND"
#: Environment variable that allows the weak ``rlimit`` fallback (``1``/``true``/``yes``).
ENV_ALLOW_WEAK = "K3POST_ALLOW_WEAK_ISOLATION"
_TOKEN_VAR = "K3POST_SANDBOX_TOKEN"
_OPT_BIN = "/opt/sandbox/bin"
_INNER_PATH = f"{_OPT_BIN}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
# /etc entries bound read-only into the view (if present on the host).  Only
# what the loader, libc and Python need; notably *not* shadow / ssh / ssl keys.
_ETC_ENTRIES: tuple[str, ...] = tuple(
    dict.fromkeys(
        (
            "ld.so.cache",
            "ld.so.conf",
            "ld.so.conf.d",
            "localtime",
            "alternatives",
            "nsswitch.conf",
            "host.conf",
            "mime.types",
            "python3",
            f"python{sys.version_info.major}.{sys.version_info.minor}",
            "python3.11",
            "python3.12",
            "python3.13",
        )
    )
)
_ROOT_LINK_DIRS: tuple[str, ...] = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_READ_CHUNK = 65536
_DRAIN_GRACE_S = 1.0


# --------------------------------------------------------------------------
# public data types
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits applied to every :meth:`Sandbox.run`.

    Attributes:
        cpu_s: CPU seconds per process (``RLIMIT_CPU``; SIGXCPU, then SIGKILL
            one second later).
        wall_s: default wall-clock timeout of a run, in seconds.
        memory_bytes: address-space limit per process (``RLIMIT_AS``).
        nproc: maximum number of processes/threads of the sandbox uid
            (``RLIMIT_NPROC``).
        fsize_bytes: largest file a process may write (``RLIMIT_FSIZE``).
        nofile: maximum open file descriptors (``RLIMIT_NOFILE``).
        max_output_bytes: captured bytes per stream (stdout and stderr each);
            the rest is discarded and the result flagged ``truncated``.
        kill_on_output_limit: kill the run as soon as a stream exceeds
            ``max_output_bytes`` (``killed_reason="output_limit"``); if false,
            the excess is read and discarded until the command ends.
        tmpfs_bytes: size of the private ``/tmp`` in the namespace backends.
    """

    cpu_s: float = 10.0
    wall_s: float = 30.0
    memory_bytes: int = 2 * 1024**3
    nproc: int = 64
    fsize_bytes: int = 64 * 1024**2
    nofile: int = 256
    max_output_bytes: int = 1024**2
    kill_on_output_limit: bool = True
    tmpfs_bytes: int = 64 * 1024**2

    def __post_init__(self) -> None:
        for name in (
            "cpu_s",
            "wall_s",
            "memory_bytes",
            "nproc",
            "fsize_bytes",
            "nofile",
            "max_output_bytes",
            "tmpfs_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")
        for name in ("memory_bytes", "nproc", "fsize_bytes", "nofile", "max_output_bytes", "tmpfs_bytes"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"SandboxLimits.{name} must be an int, got {getattr(self, name)!r}")
        if self.nproc < 4:
            raise ValueError(f"SandboxLimits.nproc must be >= 4 (the sandbox itself needs a few), got {self.nproc}")
        if self.nofile < 16:
            raise ValueError(f"SandboxLimits.nofile must be >= 16, got {self.nofile}")


@dataclass
class SandboxResult:
    """Outcome of one :meth:`Sandbox.run`.

    Attributes:
        returncode: exit status; negative ``-N`` when killed by signal ``N``
            (also normalised for the namespace backends, whose launcher
            reports ``128 + N``).
        stdout: captured standard output (UTF-8, undecodable bytes replaced),
            at most ``max_output_bytes`` bytes of it.
        stderr: captured standard error, same rules.
        timed_out: the wall-clock timeout fired.
        killed_reason: ``None`` for a normal exit, else one of
            ``"wall_timeout"``, ``"cpu_limit"``, ``"memory"``,
            ``"output_limit"``, ``"file_size"``, ``"signal:<NAME>"``.
        wall_s: wall-clock seconds of the run (launch to reap).
        backend: isolation backend used.
        truncated: some output was discarded because of the cap.
        weak_isolation: the run had rlimits only (no filesystem or network
            isolation); set for the ``rlimit`` backend.
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    wall_s: float
    backend: str
    truncated: bool = False
    weak_isolation: bool = False

    @property
    def ok(self) -> bool:
        """True when the command exited with status 0 and was not killed."""
        return self.returncode == 0 and self.killed_reason is None


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


# --------------------------------------------------------------------------
# backend command builders
# --------------------------------------------------------------------------


@dataclass
class _Launch:
    """Everything needed to start one sandboxed command."""

    argv: list[str]
    cwd: str
    pass_fds: tuple[int, ...] = ()
    close_after: list[int] = field(default_factory=list)


def _etc_files(etc_dir: str, uid: int) -> None:
    """Write the synthetic passwd/group/hosts used inside the view."""
    os.makedirs(etc_dir, exist_ok=True)
    files = {
        "passwd": f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
        f"sandbox:x:{uid}:{uid}:sandbox:{SANDBOX_DIR}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
        "hostname": "sandbox\n",
    }
    for name, text in files.items():
        path = os.path.join(etc_dir, name)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(path, 0o644)


_ETC_SYNTHETIC: tuple[str, ...] = ("passwd", "group", "hosts", "hostname")


def _bwrap_argv(
    workdir_fd: int,
    prefixes: list[str],
    etc_fds: Mapping[str, int],
    limits: SandboxLimits,
    python: str,
    read_only: bool = False,
) -> list[str]:
    """bubblewrap command line (without the user command) for one run.

    Every fd handed to bwrap is one that bwrap closes after use (``--bind-fd``,
    ``--ro-bind-data``): an fd that survived into the command would be a
    handle on the host filesystem outside the view (``/proc/self/fd/N/..``).
    """
    bwrap = shutil.which("bwrap") or "/usr/bin/bwrap"
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--uid",
        str(INNER_UID),
        "--gid",
        str(INNER_UID),
        "--hostname",
        "sandbox",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for name in _ROOT_LINK_DIRS:
        host = f"/{name}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    argv += ["--dir", "/etc"]
    for name in _ETC_ENTRIES:
        host = f"/etc/{name}"
        if os.path.lexists(host):
            argv += ["--ro-bind-try", host, host]
    for name in _ETC_SYNTHETIC:
        argv += ["--ro-bind-data", str(etc_fds[name]), f"/etc/{name}"]
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(limits.tmpfs_bytes),
        "--tmpfs",
        "/dev/shm",
        "--size",
        str(limits.tmpfs_bytes),
        "--tmpfs",
        "/tmp",
        "--dir",
        _OPT_BIN,
        "--symlink",
        python,
        f"{_OPT_BIN}/python",
        "--symlink",
        python,
        f"{_OPT_BIN}/python3",
    ]
    for prefix in prefixes:
        argv += ["--ro-bind", prefix, prefix]
    argv += [
        "--ro-bind-fd" if read_only else "--bind-fd",
        str(workdir_fd),
        SANDBOX_DIR,
        "--chdir",
        SANDBOX_DIR,
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--",
    ]
    return argv


_UNSHARE_SCRIPT = r"""
set -e
R="$SBX_ROOT"
/usr/bin/mount -t tmpfs -o "size=$SBX_TMPFS,mode=0755" sandbox-root "$R"
cd "$R"
/usr/bin/mkdir -p usr etc dev proc tmp sandbox opt/sandbox/bin .oldroot
/usr/bin/mount --rbind /usr usr
/usr/bin/mount -o remount,bind,ro usr 2>/dev/null || true
for d in $SBX_LINKS; do /usr/bin/ln -s "$(/usr/bin/readlink "/$d")" "$d"; done
for d in $SBX_DIRS; do /usr/bin/mkdir -p "$d"; /usr/bin/mount --rbind "/$d" "$d"; /usr/bin/mount -o remount,bind,ro "$d" 2>/dev/null || true; done
for f in $SBX_ETC; do /usr/bin/cp -a "/etc/$f" "etc/$f" 2>/dev/null || true; done
/usr/bin/cp "$SBX_ETCDIR/passwd" "$SBX_ETCDIR/group" "$SBX_ETCDIR/hosts" "$SBX_ETCDIR/hostname" etc/
for n in null zero full random urandom tty; do
    /usr/bin/touch "dev/$n"; /usr/bin/mount --bind "/dev/$n" "dev/$n"
done
/usr/bin/ln -s /proc/self/fd dev/fd
/usr/bin/ln -s /proc/self/fd/0 dev/stdin
/usr/bin/ln -s /proc/self/fd/1 dev/stdout
/usr/bin/ln -s /proc/self/fd/2 dev/stderr
/usr/bin/mount -t tmpfs -o "size=$SBX_TMPFS,mode=1777" sandbox-tmp tmp
/usr/bin/mkdir -p dev/shm
/usr/bin/mount -t tmpfs -o "size=$SBX_TMPFS,mode=1777" sandbox-shm dev/shm
/usr/bin/mount -t proc proc proc
for p in $SBX_PREFIXES; do
    /usr/bin/mkdir -p ".$p"
    /usr/bin/mount --rbind "$p" ".$p"
    /usr/bin/mount -o remount,bind,ro ".$p" 2>/dev/null || true
done
/usr/bin/mount --bind "$SBX_WORK" sandbox
if [ -n "$SBX_WORK_RO" ]; then /usr/bin/mount -o remount,bind,ro sandbox; fi
/usr/bin/ln -s "$SBX_PYTHON" opt/sandbox/bin/python
/usr/bin/ln -s "$SBX_PYTHON" opt/sandbox/bin/python3
/usr/sbin/pivot_root . .oldroot
cd /
/usr/bin/umount -l /.oldroot
/usr/bin/rmdir /.oldroot
/usr/bin/mount -o remount,bind,ro / 2>/dev/null || true
unset SBX_ROOT SBX_TMPFS SBX_LINKS SBX_DIRS SBX_ETC SBX_ETCDIR SBX_PREFIXES SBX_WORK SBX_WORK_RO SBX_PYTHON
cd /sandbox
# pid 1 of the namespace is a shell that waits for the command: the kernel
# ignores SIGXCPU for a namespace init, and the namespace (with every detached
# descendant) dies as soon as that shell exits.
exec /usr/bin/setpriv --no-new-privs --inh-caps=-all --bounding-set=-all \
    --securebits=+noroot,+noroot_locked,+no_setuid_fixup,+no_setuid_fixup_locked,+keep_caps_locked -- \
    /bin/sh -c '"$@"; exit $?' sandbox-init "$@"
"""


def _unshare_argv(
    root_mount: str,
    workdir: str,
    prefixes: list[str],
    etc_dir: str,
    limits: SandboxLimits,
    python: str,
    read_only: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """``unshare`` command line and setup environment for one run.

    Paths only, no fds: an fd inherited by the command would be a handle on the host filesystem
    outside the view (``/proc/self/fd/N/..``), and dash cannot close fds above 9.
    """
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    links = [d for d in _ROOT_LINK_DIRS if os.path.islink(f"/{d}")]
    dirs = [d for d in _ROOT_LINK_DIRS if not os.path.islink(f"/{d}") and os.path.isdir(f"/{d}")]
    etc = [e for e in _ETC_ENTRIES if os.path.lexists(f"/etc/{e}")]
    env = {
        "SBX_ROOT": root_mount,
        "SBX_TMPFS": str(limits.tmpfs_bytes),
        "SBX_LINKS": " ".join(links),
        "SBX_DIRS": " ".join(dirs),
        "SBX_ETC": " ".join(etc),
        "SBX_ETCDIR": etc_dir,
        "SBX_PREFIXES": " ".join(prefixes),
        # Bind sources must be paths (a bind from an fd opened in the host mount
        # namespace is refused), so the sandbox uid needs search permission on
        # the workdir's ancestors for this backend.
        "SBX_WORK": workdir,
        "SBX_WORK_RO": "1" if read_only else "",
        "SBX_PYTHON": python,
    }
    argv = [
        unshare,
        "--user",
        "--map-root-user",
        "--mount",
        "--net",
        "--pid",
        "--ipc",
        "--uts",
        "--fork",
        "--kill-child",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        _UNSHARE_SCRIPT,
        "sandbox-setup",
    ]
    return argv, env


# --------------------------------------------------------------------------
# backend probing
# --------------------------------------------------------------------------

_probe_cache: dict[str, bool] = {}
# Limit wrappers (``prlimit`` options, uid dropped or not) that applied cleanly once.
_wrapper_ok: set[tuple[str, ...]] = set()
_probe_lock = threading.Lock()


def probe_backend(name: str) -> bool:
    """Return whether backend ``name`` really works here (cached per process).

    The probe runs ``true`` through the backend with the same command line a
    real run would use, so it fails where namespaces are forbidden (seccomp,
    missing binaries, disabled user namespaces, ...).

    Raises:
        ValueError: ``name`` is not a known backend.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {name!r}; choose from {BACKENDS}")
    if name == "rlimit":
        return True
    with _probe_lock:
        if name in _probe_cache:
            return _probe_cache[name]
        ok = False
        binary = "bwrap" if name == "bwrap" else "unshare"
        if shutil.which(binary) is not None and sys.platform.startswith("linux"):
            try:
                with Sandbox(backend=name, _probing=True) as sb:
                    res = sb.run(["true"], timeout=15)
                ok = res.returncode == 0 and res.killed_reason is None
                if not ok:
                    logger.info("sandbox backend %s probe failed: rc=%s %s", name, res.returncode, res.stderr[-500:])
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                logger.info("sandbox backend %s probe raised %r", name, exc)
                ok = False
        _probe_cache[name] = ok
        return ok


def available_backends() -> list[str]:
    """Backends that work on this machine, best first (``rlimit`` always)."""
    return [b for b in BACKENDS if probe_backend(b)]


class SandboxUnavailableError(InfrastructureError):
    """No isolating backend works here and weak isolation was not allowed, or the backend's launcher is gone
    (an infrastructure failure: a rollout it ends is masked out of its group, `k3post.errors`)."""

    kind = "sandbox"


def weak_isolation_allowed() -> bool:
    """Whether :data:`ENV_ALLOW_WEAK` allows the ``rlimit`` fallback of ``backend="auto"``."""
    return os.environ.get(ENV_ALLOW_WEAK, "").strip().lower() in ("1", "true", "yes")


def _select_backend(requested: str) -> str:
    requested = requested.strip().lower()
    if requested == "auto":
        env_choice = os.environ.get(_ENV_BACKEND, "").strip().lower()
        if env_choice and env_choice != "auto":
            requested = env_choice
    if requested == "auto":
        for name in BACKENDS[:-1]:
            if probe_backend(name):
                return name
        if weak_isolation_allowed():
            return "rlimit"
        raise SandboxUnavailableError(
            "no isolating sandbox backend works on this machine (bwrap: unavailable, unshare: unavailable), so "
            "model-written code will not run. Install bubblewrap: `bash scripts/install.sh` (or "
            "`apt-get install bubblewrap`). To run it anyway with rlimits only (WEAK isolation: host files "
            f"readable, network open), set sandbox.allow_weak_isolation=true or {ENV_ALLOW_WEAK}=1."
        )
    if requested not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {requested!r}; choose from {('auto',) + BACKENDS}")
    return requested


#: HOME of `Sandbox.run_hidden`: outside the tree, and absent.
HIDDEN_HOME = "/nonexistent"
#: ``python -I -B -c HIDDEN_LAUNCHER ARGV`` runs ``python ARGV`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``) as the
#: task defines it, except that the working directory comes LAST on ``sys.path`` (it cannot shadow the standard
#: library) and modules under it load from source only (no ``.pyc`` / ``__pycache__``, no extension modules;
#: ``-I`` already skips ``.pth`` files, ``usercustomize`` and the ``PYTHON*`` variables of the tree).
HIDDEN_LAUNCHER = r"""
import os, sys, types
from importlib.machinery import SOURCE_SUFFIXES, FileFinder, SourceFileLoader


class _SourceOnly(SourceFileLoader):
    def get_code(self, fullname):
        path = self.get_filename(fullname)
        return compile(self.get_data(path), path, "exec", dont_inherit=True)


def _tree_hook(path, _tree=os.getcwd() + os.sep, _finder=FileFinder, _loaders=(_SourceOnly, SOURCE_SUFFIXES)):
    if path + os.sep == _tree or path.startswith(_tree):
        return _finder(path, _loaders)
    raise ImportError(path)


sys.dont_write_bytecode = True
sys.path_hooks.insert(0, _tree_hook)
sys.path_importer_cache.clear()
sys.path.append(os.getcwd())
args = sys.argv[1:]
if len(args) >= 2 and args[0] == "-m":
    import runpy
    sys.argv = args[1:]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
elif args and not args[0].startswith("-"):
    sys.argv = args
    with open(args[0], "rb") as fh:
        code = compile(fh.read(), args[0], "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__file__ = args[0]
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    exec(code, main.__dict__)
else:
    sys.stderr.write("hidden launcher: expected SCRIPT ARGS or -m MODULE ARGS\n")
    sys.exit(2)
"""


# --------------------------------------------------------------------------
# the sandbox
# --------------------------------------------------------------------------


class Sandbox:
    """An isolated working directory in which commands run under limits.

    Args:
        workdir: host directory used as the sandbox's working directory
            (created if missing).  ``None`` creates a temporary directory that
            :meth:`close` removes.
        limits: resource limits for every run.
        backend: ``"auto"`` (default; honours ``K3POST_SANDBOX_BACKEND``),
            ``"bwrap"``, ``"unshare"`` or ``"rlimit"``.  A forced namespace
            backend that does not work here raises :class:`RuntimeError`;
            ``"auto"`` where no namespace backend works raises
            :class:`SandboxUnavailableError` unless weak isolation is allowed
            (:func:`weak_isolation_allowed`).
        python: which interpreter ``python``/``python3`` run inside:
            ``"system"`` (default; ``/usr/bin/python3``, stdlib only) or
            ``"host"`` (this interpreter and its site-packages, bound
            read-only at its own path).  ``"host"`` needs the bwrap backend,
            or a prefix the sandbox uid can read for the other backends.

    Example::

        with Sandbox(limits=SandboxLimits(wall_s=5)) as sb:
            sb.write_file("solution.py", "print(sum(range(10)))")
            res = sb.run(["python", "solution.py"])
            assert res.stdout == "45\\n"
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        limits: SandboxLimits | None = None,
        *,
        backend: str = "auto",
        python: str = "system",
        _probing: bool = False,
    ) -> None:
        if limits is None:
            limits = SandboxLimits()
        if not isinstance(limits, SandboxLimits):
            raise ValueError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        if not isinstance(backend, str):
            raise ValueError(f"backend must be a string, got {backend!r}")
        self.limits = limits
        if _probing:
            if backend not in BACKENDS:
                raise ValueError(f"unknown sandbox backend {backend!r}")
            self.backend = backend
        else:
            self.backend = _select_backend(backend)
            if self.backend != "rlimit" and not probe_backend(self.backend):
                raise RuntimeError(
                    f"sandbox backend {self.backend!r} does not work on this machine (working: {available_backends()})"
                )
            if self.backend == "rlimit":
                why = (
                    "rlimit backend requested"
                    if backend.strip().lower() != "auto" or os.environ.get(_ENV_BACKEND, "").strip()
                    else f"no namespace backend (bwrap / unshare) works here and {ENV_ALLOW_WEAK} allows that"
                )
                msg = (
                    f"k3post sandbox: {why}; using rlimits only, so isolation is WEAK: sandboxed code "
                    "can read world-readable host files and use the network."
                )
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                logger.warning(msg)
        self._drop_uid: int | None = _allocate_uid() if _is_root() else None
        self._python, self._prefixes = _inner_python(python)
        if self._drop_uid is not None:
            for prefix in self._prefixes:
                if not _world_traversable(prefix):
                    raise RuntimeError(
                        f"python='host' needs the interpreter prefix {prefix} to be readable by the unprivileged "
                        "sandbox uid (a parent directory is not world-searchable); use python='system'"
                    )
        resolved_workdir = None if workdir is None else Path(workdir).resolve()
        if (
            resolved_workdir is not None
            and self._drop_uid is not None
            and self.backend != "rlimit"
            and not _world_traversable(str(resolved_workdir.parent))
        ):
            raise ValueError(
                f"workdir {resolved_workdir} is not reachable by the unprivileged sandbox uid (a parent directory "
                "is not world-searchable, e.g. pytest's 0700 tmp_path); pass workdir=None for a private temp dir "
                "or choose a directory whose parents are world-searchable"
            )
        self._owns_workdir = resolved_workdir is None
        if resolved_workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="k3sbx-"))
        else:
            self.workdir = resolved_workdir
            self.workdir.mkdir(parents=True, exist_ok=True)
        self._closed = False
        self._private = Path(tempfile.mkdtemp(prefix="k3sbx-etc-"))
        os.chmod(self._private, 0o755)
        _etc_files(str(self._private), INNER_UID)
        # `python` / `python3` for the rlimit backend (the namespace backends
        # create the same links inside their view).
        (self._private / "bin").mkdir(mode=0o755)
        (self._private / "root").mkdir(mode=0o755)  # mount point of the unshare backend's view
        for alias in ("python", "python3"):
            os.symlink(self._python, self._private / "bin" / alias)
        self._nproc_slack = 0
        self._last_token: str | None = None
        self._limits_cache: list[tuple[int, str, int, int]] = []
        self._preexec_err = -1
        self._fix_ownership()

    # ------------------------------------------------------------------ files

    def _resolve(self, path: str | os.PathLike[str], *, must_exist: bool = False) -> Path:
        """Map a sandbox-relative path to a host path inside the workdir.

        Raises:
            ValueError: absolute paths, ``..`` traversal, or symlinks that
                resolve outside the working directory.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path must be a string, got {path!r}")
        raw = os.fspath(path)
        if isinstance(raw, bytes):
            raise ValueError("path must be str, not bytes")
        if not raw or "\x00" in raw:
            raise ValueError(f"invalid path {raw!r}")
        pure = PurePosixPath(raw)
        if pure.is_absolute():
            raise ValueError(f"absolute paths are not allowed in the sandbox: {raw!r}")
        if ".." in pure.parts:
            raise ValueError(f"path traversal is not allowed in the sandbox: {raw!r}")
        root = self.workdir.resolve()
        try:
            candidate = (root / pure).resolve()
        except OSError as exc:  # e.g. a planted link into /proc/1/root: unresolvable means outside
            raise ValueError(f"path {raw!r} resolves outside the sandbox working directory ({exc})") from exc
        if candidate != root and root not in candidate.parents:
            raise ValueError(f"path {raw!r} resolves outside the sandbox working directory")
        if must_exist and not candidate.exists():
            raise FileNotFoundError(f"no such file in sandbox: {raw!r}")
        return candidate

    def write_file(self, path: str | os.PathLike[str], text: str | bytes) -> None:
        """Write ``text`` (str as UTF-8, or bytes) to ``path`` inside the workdir."""
        self._check_open()
        if not isinstance(text, (str, bytes)):
            raise ValueError(f"text must be str or bytes, got {type(text).__name__}")
        target = self._resolve(path)
        if target == self.workdir.resolve():
            raise ValueError("cannot write to the working directory itself")
        target.parent.mkdir(parents=True, exist_ok=True)
        data = text.encode("utf-8") if isinstance(text, str) else text
        tmp = target.parent / f".{target.name}.k3sbx-tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
        self._fix_ownership()

    def read_file(self, path: str | os.PathLike[str], *, max_bytes: int | None = None) -> str:
        """Read a UTF-8 text file (undecodable bytes replaced) from the workdir; at most ``max_bytes`` bytes of it."""
        self._check_open()
        target = self._resolve(path, must_exist=True)
        if not target.is_file():
            raise ValueError(f"not a regular file in sandbox: {os.fspath(path)!r}")
        if max_bytes is None:
            return target.read_bytes().decode("utf-8", errors="replace")
        with open(target, "rb") as fh:
            return fh.read(max(0, max_bytes)).decode("utf-8", errors="replace")

    def list_files(self) -> list[str]:
        """Sorted relative POSIX paths of all regular files in the workdir."""
        self._check_open()
        out: list[str] = []
        root = self.workdir
        for dirpath, _dirnames, filenames in os.walk(root):
            for name in filenames:
                full = Path(dirpath) / name
                if full.is_symlink() or not full.is_file():
                    continue
                out.append(full.relative_to(root).as_posix())
        return sorted(out)

    # --------------------------------------------------------------- snapshot

    def snapshot(self) -> bytes:
        """The working directory as an in-memory gzip'd tar archive."""
        self._check_open()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
            for entry in sorted(os.listdir(self.workdir)):
                tar.add(str(self.workdir / entry), arcname=entry, recursive=True)
        return buf.getvalue()

    def restore(self, blob: bytes) -> None:
        """Replace the working directory's contents with a :meth:`snapshot`.

        Raises:
            ValueError: ``blob`` is not a snapshot archive.
        """
        self._check_open()
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise ValueError(f"snapshot must be bytes, got {type(blob).__name__}")
        try:
            tar = tarfile.open(fileobj=io.BytesIO(bytes(blob)), mode="r:*")
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise ValueError(f"invalid sandbox snapshot: {exc}") from exc
        with tar:
            for entry in os.listdir(self.workdir):
                full = self.workdir / entry
                if full.is_dir() and not full.is_symlink():
                    shutil.rmtree(full)
                else:
                    full.unlink()
            dest = str(self.workdir)
            try:
                tar.extractall(dest, filter=lambda m, p: _safe_member(m, dest))
            except TypeError:  # Python without the extraction-filter API
                members = [m for m in tar.getmembers() if _safe_member(m, dest) is not None]
                tar.extractall(dest, members=members)
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise ValueError(f"invalid sandbox snapshot: {exc}") from exc
        self._fix_ownership()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: the working directory snapshot (tar.gz, base64) plus metadata."""
        return {
            "version": 1,
            "files": base64.b64encode(self.snapshot()).decode("ascii"),
            "limits": dataclasses.asdict(self.limits),
            "backend": self.backend,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the working directory from :meth:`state_dict` output.

        Limits and backend are configuration of this instance and are kept.

        Raises:
            ValueError: ``state`` is not a sandbox state dict.
        """
        if not isinstance(state, Mapping) or "files" not in state:
            raise ValueError("not a Sandbox state_dict (missing 'files')")
        if state.get("version", 1) != 1:
            raise ValueError(f"unsupported Sandbox state_dict version {state.get('version')!r}")
        files = state["files"]
        self.restore(base64.b64decode(files) if isinstance(files, str) else files)

    # -------------------------------------------------------------------- run

    def _fix_ownership(self) -> None:
        """Hand workdir entries to the sandbox uid (when we drop privileges).

        Never follows symlinks, and skips multiply-linked files (a hard link
        to a host file planted by sandboxed code must not be re-owned).
        """
        uid = self._drop_uid
        if uid is None:
            return
        paths = [str(self.workdir)]
        for dirpath, dirnames, filenames in os.walk(self.workdir):
            paths.extend(os.path.join(dirpath, n) for n in dirnames + filenames)
        for p in paths:
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if st.st_uid == uid and st.st_gid == uid:
                continue
            if os.path.islink(p):
                continue
            if not os.path.isdir(p) and st.st_nlink > 1:
                continue
            try:
                os.chown(p, uid, uid, follow_symlinks=False)
            except OSError:
                pass
        try:
            os.chmod(self.workdir, 0o755)
        except OSError:
            pass

    def _rlimit_pairs(self) -> list[tuple[int, str, int, int]]:
        """``(resource, prlimit option, soft, hard)`` for every limit, capped at our own hard limits."""
        lim = self.limits
        nproc = lim.nproc + self._nproc_slack
        cpu = max(1, round(lim.cpu_s))
        wanted = [
            (resource.RLIMIT_CPU, "--cpu", cpu, cpu + 1),
            (resource.RLIMIT_AS, "--as", lim.memory_bytes, lim.memory_bytes),
            (resource.RLIMIT_FSIZE, "--fsize", lim.fsize_bytes, lim.fsize_bytes),
            (resource.RLIMIT_NOFILE, "--nofile", lim.nofile, lim.nofile),
            (resource.RLIMIT_CORE, "--core", 0, 0),
            (resource.RLIMIT_NPROC, "--nproc", nproc, nproc),
        ]
        out: list[tuple[int, str, int, int]] = []
        for res, opt, soft, hard in wanted:
            _cur_soft, cur_hard = resource.getrlimit(res)
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            out.append((res, opt, soft, hard))
        return out

    def _wrapper_argv(self) -> list[str] | None:
        """``setpriv`` + ``prlimit`` prefix that drops the uid and sets the limits.

        Using exec'd helpers instead of a ``preexec_fn`` keeps process creation
        on the fast ``vfork`` path (a large trainer process forks slowly) and
        is safe in multi-threaded hosts.  ``None`` when util-linux is missing.
        """
        prlimit = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
        setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
        if prlimit is None or (self._drop_uid is not None and setpriv is None):
            return None
        argv: list[str] = []
        if self._drop_uid is not None:
            assert setpriv is not None
            uid = str(self._drop_uid)
            argv += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--"]
        argv.append(prlimit)
        argv += [f"{opt}={soft}:{hard}" for _res, opt, soft, hard in self._rlimit_pairs()]
        argv.append("--")
        return argv

    def _check_wrapper(self, wrapper: list[str]) -> None:
        """Run ``true`` under ``wrapper`` once per distinct limit set: a limit ``prlimit`` cannot set is an error.

        ``prlimit`` refuses to exec the command when a ``setrlimit`` fails, so a
        run would only come back as exit status 1; checking with a trusted
        command turns that into a :class:`RuntimeError` naming the limit (the
        sandboxed program's own stderr is never parsed for it).
        """
        key = tuple(a for a in wrapper if not a.startswith(("--reuid=", "--regid=")))
        if key in _wrapper_ok:
            return
        proc = subprocess.run([*wrapper, "true"], capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(
                f"sandbox: could not apply the resource limits ({' '.join(wrapper)}): {proc.stderr.strip()[-500:]}"
            )
        _wrapper_ok.add(key)

    def _preexec(self) -> None:
        """Fallback child-side setup between fork and exec: rlimits (uid is set by Popen).

        Runs after the uid switch, so it must not import anything (the host
        interpreter's files may be unreadable to the sandbox uid).  A failed
        ``setrlimit`` writes the limit's name to :attr:`_preexec_err` and
        raises, so ``Popen`` fails and :meth:`run` raises naming the limit.
        """
        for res, opt, soft, hard in self._limits_cache:
            try:
                resource.setrlimit(res, (soft, hard))
            except (ValueError, OSError) as exc:
                os.write(self._preexec_err, f"RLIMIT_{opt[2:].upper()}={soft}:{hard}: {exc}".encode())
                raise

    def _env(self, token: str, extra: Mapping[str, str] | None) -> dict[str, str]:
        if self.backend == "rlimit":
            home = str(self.workdir)
            path = f"{self._private / 'bin'}:/usr/local/bin:/usr/bin:/bin"
        else:
            home = SANDBOX_DIR
            path = _INNER_PATH
        env = {
            "PATH": path,
            "HOME": home,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "TMPDIR": "/tmp",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
            "USER": "sandbox",
            "LOGNAME": "sandbox",
        }
        if extra:
            for key, value in extra.items():
                if not isinstance(key, str) or not isinstance(value, str) or not key or "=" in key or "\x00" in value:
                    raise ValueError(f"invalid environment entry {key!r}={value!r}")
                env[key] = value
        env[_TOKEN_VAR] = token
        return env

    def _build(self, argv: list[str], env: dict[str, str], read_only: bool = False) -> tuple[_Launch, dict[str, str]]:
        if self.backend == "rlimit":
            return _Launch(argv=list(argv), cwd=str(self.workdir)), env
        if self.backend == "unshare":
            cmd, setup_env = _unshare_argv(
                str(self._private / "root"), str(self.workdir), self._prefixes, str(self._private), self.limits,
                self._python,
                read_only,
            )
            return _Launch(argv=cmd + list(argv), cwd="/"), {**env, **setup_env}
        opened: list[int] = []
        try:
            wfd = os.open(self.workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            opened.append(wfd)
            etc_fds: dict[str, int] = {}
            for name in _ETC_SYNTHETIC:
                etc_fds[name] = os.open(self._private / name, os.O_RDONLY | os.O_CLOEXEC)
                opened.append(etc_fds[name])
        except OSError:
            for fd in opened:
                os.close(fd)
            raise
        cmd = _bwrap_argv(wfd, self._prefixes, etc_fds, self.limits, self._python, read_only) + list(argv)
        return _Launch(argv=cmd, cwd="/", pass_fds=tuple(opened), close_after=opened), env

    def run(
        self,
        argv: Sequence[str] | str,
        *,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        read_only: bool = False,
    ) -> SandboxResult:
        """Run ``argv`` in the sandbox's working directory.

        Args:
            argv: the command (``["python", "solution.py"]``); a string is
                split with :func:`shlex.split`.  ``python``/``python3`` resolve
                to an interpreter visible in the view.
            stdin: data fed to the command's standard input (else empty).
            timeout: wall-clock limit in seconds (default ``limits.wall_s``).
            env: extra environment variables (the environment is otherwise
                minimal: PATH, HOME, LANG, ...).
            read_only: bind the working directory read-only (namespace
                backends; the ``rlimit`` backend cannot, and is flagged weak).

        Returns:
            A :class:`SandboxResult`; resource violations are reported there,
            not raised.

        Raises:
            ValueError: empty/invalid ``argv``, ``timeout`` or ``env``.
        """
        self._check_open()
        if isinstance(argv, str):
            import shlex

            argv = shlex.split(argv)
        argv = list(argv)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"argv must be a non-empty sequence of strings, got {argv!r}")
        if any("\x00" in a for a in argv):
            raise ValueError("argv entries must not contain NUL bytes")
        if timeout is None:
            timeout = self.limits.wall_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number, got {timeout!r}")
        if stdin is not None and not isinstance(stdin, (str, bytes)):
            raise ValueError(f"stdin must be str, bytes or None, got {type(stdin).__name__}")
        stdin_bytes = stdin.encode("utf-8") if isinstance(stdin, str) else stdin

        token = uuid.uuid4().hex
        self._last_token = token
        full_env = self._env(token, env)
        self._fix_ownership()
        launch, launch_env = self._build(argv, full_env, read_only)

        # RLIMIT_NPROC counts every process of the (host) uid.  A dedicated uid
        # starts from zero; a shared non-root uid gets its current count added.
        self._nproc_slack = 0 if self._drop_uid is not None else _count_user_procs(os.getuid())
        popen_kwargs: dict[str, Any] = {}
        wrapper = self._wrapper_argv()
        err_r = err_w = -1
        if wrapper is not None:
            self._check_wrapper(wrapper)
            argv_full = wrapper + launch.argv
        else:
            argv_full = launch.argv
            self._limits_cache = self._rlimit_pairs()
            err_r, err_w = os.pipe()
            launch.close_after += [err_r, err_w]
            self._preexec_err = err_w
            popen_kwargs["preexec_fn"] = self._preexec
            if self._drop_uid is not None:
                popen_kwargs.update(user=self._drop_uid, group=self._drop_uid, extra_groups=[])
        if self.weak_isolation:
            logger.warning(
                "k3post sandbox: WEAK isolation (rlimit backend): %s runs without filesystem or network isolation",
                argv[0],
            )
        launchers = ([] if wrapper is None else [wrapper[0]]) + ([] if self.backend == "rlimit" else [launch.argv[0]])
        gone = [p for p in launchers if not os.access(p, os.X_OK)]
        if gone:  # bwrap / unshare / prlimit vanished since the probe: the machine's fault, not the command's
            for fd in launch.close_after:
                os.close(fd)
            raise SandboxUnavailableError(f"sandbox ({self.backend}): its launcher {', '.join(gone)} is missing; "
                                          "reinstall it (`bash scripts/install.sh`)")
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv_full,
                stdin=subprocess.PIPE if stdin_bytes else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=launch.cwd,
                env=launch_env,
                start_new_session=True,
                pass_fds=launch.pass_fds,
                close_fds=True,
                **popen_kwargs,
            )
        except FileNotFoundError:
            if self.backend == "rlimit":
                return SandboxResult(
                    returncode=127,
                    stdout="",
                    stderr=f"{argv[0]}: command not found\n",
                    timed_out=False,
                    killed_reason=None,
                    wall_s=time.monotonic() - start,
                    backend=self.backend,
                    weak_isolation=True,
                )
            raise
        except subprocess.SubprocessError as exc:
            if err_r < 0:
                raise
            os.close(err_w)
            launch.close_after.remove(err_w)
            why = os.read(err_r, 4096).decode(errors="replace") or str(exc)
            raise RuntimeError(f"sandbox: setrlimit failed before the command started: {why}") from exc
        finally:
            for fd in launch.close_after:
                try:
                    os.close(fd)
                except OSError:
                    pass
        try:
            return self._communicate(proc, stdin_bytes, float(timeout), token, start)
        finally:
            if proc.poll() is None:
                self._kill_tree(proc, token)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass

    def run_hidden(
        self,
        argv: Sequence[str],
        *,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        """Run ``python ARGV`` for hidden verification: the program under test as the task defines it, isolated.

        ``argv`` is what follows ``python``: ``["tally.py", ...]`` or ``["-m", "app.router", ...]``. The run is
        ``python -I -B -c`` `HIDDEN_LAUNCHER` (no user site, no ``.pth`` / ``PYTHON*`` / cwd hooks; the working
        directory last on ``sys.path``, source modules only), ``HOME`` = `HIDDEN_HOME`, the working directory
        bound read-only, and like every run its own PID namespace and a fresh ``/tmp``. Nothing of a previous
        run survives into the next, and no process of the caller is visible to it.
        """
        argv = list(argv)
        if not argv:
            raise ValueError("run_hidden needs SCRIPT ARGS or -m MODULE ARGS")
        return self.run(
            ["python", "-I", "-B", "-c", HIDDEN_LAUNCHER, *argv],
            stdin=stdin,
            timeout=timeout,
            env={**(env or {}), "HOME": HIDDEN_HOME},
            read_only=True,
        )

    def _kill_tree(self, proc: subprocess.Popen[bytes], token: str) -> None:
        """SIGKILL the run's process group and any stragglers carrying its token."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        uid = self._drop_uid if self.backend == "rlimit" else None
        tok = f"{_TOKEN_VAR}={token}".encode()
        for _ in range(50):
            pids = [p for p in _scan_procs(tok, uid) if p != proc.pid]
            if not pids:
                break
            _kill_pids(pids)
            time.sleep(0.005)

    def _communicate(
        self, proc: subprocess.Popen[bytes], stdin_bytes: bytes | None, timeout: float, token: str, start: float
    ) -> SandboxResult:
        cap = self.limits.max_output_bytes
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
                    self._kill_tree(proc, token)
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
                    self._kill_tree(proc, token)
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
                        if self.limits.kill_on_output_limit and not killed:
                            killed_reason = "output_limit"
                            self._kill_tree(proc, token)
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
            self._kill_tree(proc, token)
            proc.wait(timeout=5)
        if not exited_cleanup_done:
            self._kill_tree(proc, token)
        wall = time.monotonic() - start

        rc = int(proc.returncode)
        if self.backend != "rlimit" and 128 < rc < 128 + 65:
            rc = -(rc - 128)  # launcher reports 128+N for a child killed by signal N
        stdout = bytes(bufs[out_fd]).decode("utf-8", errors="replace")
        stderr = bytes(bufs[err_fd]).decode("utf-8", errors="replace")
        if killed_reason is None:
            killed_reason = self._classify(rc, stderr)
        return SandboxResult(
            returncode=rc,
            stdout=stdout,
            stderr=stderr,
            timed_out=timed_out,
            killed_reason=killed_reason,
            wall_s=wall,
            backend=self.backend,
            truncated=truncated,
            weak_isolation=self.weak_isolation,
        )

    @staticmethod
    def _classify(rc: int, stderr: str) -> str | None:
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

    def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              pass_fds: Sequence[int] = ()) -> SandboxProcess:
        """Start ``argv`` as a long-lived child with binary pipes (issue 30: the kernel harness's children).

        With the bwrap backend the command is **pid 1 alone in its own PID namespace** (``--as-pid-1``): it
        sees no other process (not the caller, not the other children), so it cannot signal, ptrace or read
        the memory (``/proc/<pid>/mem``) of anything but itself; its parent pid reads 0. The caller gets the
        command's host pid (`SandboxProcess.pid`) to signal it (``SIGSTOP`` / ``SIGCONT``), pin it and read
        its CPU clock. The ``unshare`` backend is refused (its command is not pid 1); ``rlimit`` spawns the
        command directly (weak isolation, flagged). stdin / stdout are unbuffered pipes, stderr goes to a
        file in the sandbox's private directory (`SandboxProcess.stderr_tail`). ``pass_fds`` are inherited at
        the same numbers: pass only anonymous objects (a memfd, a pipe), never a handle on the host filesystem.
        """
        self._check_open()
        argv = list(argv)
        if not argv or not all(isinstance(a, str) and "\x00" not in a for a in argv):
            raise ValueError(f"argv must be a non-empty sequence of strings without NUL, got {argv!r}")
        if self.backend == "unshare":
            raise RuntimeError("Sandbox.spawn needs the bwrap backend (or an explicit rlimit one)")
        token = uuid.uuid4().hex
        self._last_token = token
        self._fix_ownership()
        launch, launch_env = self._build(argv, self._env(token, env))
        if self.backend == "bwrap":
            launch.argv.insert(launch.argv.index("--unshare-all"), "--as-pid-1")
        self._nproc_slack = 0 if self._drop_uid is not None else _count_user_procs(os.getuid())
        wrapper = self._wrapper_argv()
        if wrapper is None:
            raise RuntimeError("Sandbox.spawn needs util-linux prlimit (and setpriv on a root host)")
        self._check_wrapper(wrapper)
        err_fd, err_path = tempfile.mkstemp(prefix="spawn-", suffix=".err", dir=self._private)
        try:
            proc = subprocess.Popen(wrapper + launch.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err_fd, cwd=launch.cwd, env=launch_env, start_new_session=True,
                                    pass_fds=(*launch.pass_fds, *pass_fds), close_fds=True, bufsize=0)
        finally:
            os.close(err_fd)
            for fd in launch.close_after:
                try:
                    os.close(fd)
                except OSError:
                    pass
        return SandboxProcess(proc, err_path, inner=self.backend == "bwrap", weak_isolation=self.weak_isolation)

    # -------------------------------------------------------------- lifecycle

    @property
    def weak_isolation(self) -> bool:
        """True for the ``rlimit`` backend: no filesystem or network isolation."""
        return self.backend == "rlimit"

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("sandbox is closed")

    def wait_gone(self, timeout: float = 5.0) -> int:
        """Block until no process of this sandbox's private uid (a root host), or else of its last run (found by the
        run's environment token), is alive.

        A run's process tree is killed before :meth:`run` returns, but the kernel tears processes down
        asynchronously and a large one (a browser with many processes) takes a moment to disappear. Processes
        still there at ``timeout`` are SIGKILLed again; returns how many were left then (0: all gone in time).
        """
        uid = self._drop_uid
        token = None if uid is not None or self._last_token is None else f"{_TOKEN_VAR}={self._last_token}".encode()
        if uid is None and token is None:
            return 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not (_count_user_procs(uid) if uid is not None else _scan_procs(token, None)):
                return 0
            time.sleep(0.01)
        left = _scan_procs(token, uid)
        _kill_pids(left)
        return len(left)

    def close(self) -> None:
        """Release resources; removes the working directory if it was created here."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        private = getattr(self, "_private", None)
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"Sandbox(workdir={str(self.workdir)!r}, backend={self.backend!r}, limits={self.limits!r})"


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
