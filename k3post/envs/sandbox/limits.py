"""The sandbox's constants, limits and result types (`k3post.envs.sandbox`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from k3post.errors import InfrastructureError

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


class SandboxUnavailableError(InfrastructureError):
    """No isolating backend works here and weak isolation was not allowed, or the backend's launcher is gone
    (an infrastructure failure: a rollout it ends is masked out of its group, `k3post.errors`)."""

    kind = "sandbox"
