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
uid (allocated from :data:`UID_BASE`, claimed with a ``flock`` in
``host.UID_LOCKS`` while the sandbox is open, so no two open sandboxes on the
host share one, whichever processes hold them), because ``RLIMIT_NPROC`` is not
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

The package: `limits` (limits, results, constants), `host` (uids, process scans, safe tar members), `launch` (the
bwrap / unshare command lines, the rlimit wrapper, the hidden launcher), `capture` (the output pump and the exit
classifier), `core` (`Sandbox` and the backends' probes), `process` (`SandboxProcess`).
"""

from __future__ import annotations

from k3post.envs.sandbox.core import Sandbox, available_backends, probe_backend
from k3post.envs.sandbox.host import weak_isolation_allowed
from k3post.envs.sandbox.limits import BACKENDS, SANDBOX_DIR, SandboxLimits, SandboxResult, SandboxUnavailableError
from k3post.envs.sandbox.process import SandboxProcess

__all__ = [
    "BACKENDS",
    "SANDBOX_DIR",
    "Sandbox",
    "SandboxLimits",
    "SandboxProcess",
    "SandboxResult",
    "SandboxUnavailableError",
    "available_backends",
    "weak_isolation_allowed",
    "probe_backend",
]
