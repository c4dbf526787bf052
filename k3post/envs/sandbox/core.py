"""The `Sandbox` class and its long-lived `SandboxProcess` (`k3post.envs.sandbox`)."""

from __future__ import annotations

import base64
import dataclasses
import io
import logging
import os
import resource
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
from pathlib import Path, PurePosixPath
from typing import Any, Self

from k3post.envs.sandbox.capture import classify_exit, communicate
from k3post.envs.sandbox.host import (
    _allocate_uid,
    _count_user_procs,
    _inner_python,
    _is_root,
    _kill_pids,
    _safe_member,
    _scan_procs,
    _world_traversable,
    release_uid,
    weak_isolation_allowed,
)
from k3post.envs.sandbox.launch import (
    _ETC_SYNTHETIC,
    HIDDEN_HOME,
    HIDDEN_LAUNCHER,
    _bwrap_argv,
    _etc_files,
    _Launch,
    _unshare_argv,
    check_limit_wrapper,
    limit_wrapper,
    rlimit_pairs,
)
from k3post.envs.sandbox.limits import (
    _ENV_BACKEND,
    _INNER_PATH,
    _TOKEN_VAR,
    BACKENDS,
    ENV_ALLOW_WEAK,
    INNER_UID,
    SANDBOX_DIR,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
)
from k3post.envs.sandbox.process import SandboxProcess

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------
# backend probing
# --------------------------------------------------------------------------

_probe_cache: dict[str, bool] = {}
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
        self._uid_claim: int | None = None
        self._drop_uid: int | None = None
        if _is_root():
            self._drop_uid, self._uid_claim = _allocate_uid()
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
        return rlimit_pairs(self.limits, self._nproc_slack)

    def _wrapper_argv(self) -> list[str] | None:
        return limit_wrapper(self._rlimit_pairs(), self._drop_uid)

    _check_wrapper = staticmethod(check_limit_wrapper)

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
        got = communicate(proc, stdin_bytes, timeout, start, cap=self.limits.max_output_bytes,
                          kill_on_output_limit=self.limits.kill_on_output_limit,
                          kill=lambda: self._kill_tree(proc, token))
        rc = got.returncode
        if self.backend != "rlimit" and 128 < rc < 128 + 65:
            rc = -(rc - 128)  # launcher reports 128+N for a child killed by signal N
        return SandboxResult(
            returncode=rc,
            stdout=got.stdout,
            stderr=got.stderr,
            timed_out=got.timed_out,
            killed_reason=got.killed_reason or classify_exit(rc, got.stderr),
            wall_s=got.wall_s,
            backend=self.backend,
            truncated=got.truncated,
            weak_isolation=self.weak_isolation,
        )

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
        release_uid(getattr(self, "_uid_claim", None))  # also after a constructor that failed past the claim
        self._uid_claim = None
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
