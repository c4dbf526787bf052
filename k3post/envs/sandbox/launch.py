"""How a sandboxed command is launched: the bwrap and unshare command lines, the view's /etc, and the hidden
launcher (`k3post.envs.sandbox`)."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from k3post.envs.sandbox.limits import _ETC_ENTRIES, _OPT_BIN, _ROOT_LINK_DIRS, INNER_UID, SANDBOX_DIR, SandboxLimits

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


#: Limit wrappers (``prlimit`` options, uid dropped or not) that applied cleanly once.
_wrapper_ok: set[tuple[str, ...]] = set()


def rlimit_pairs(lim: SandboxLimits, nproc_slack: int) -> list[tuple[int, str, int, int]]:
    """``(resource, prlimit option, soft, hard)`` for every limit, capped at our own hard limits."""
    nproc = lim.nproc + nproc_slack
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

def limit_wrapper(pairs: list[tuple[int, str, int, int]], drop_uid: int | None) -> list[str] | None:
    """``setpriv`` + ``prlimit`` prefix that drops the uid and sets the limits.

    Using exec'd helpers instead of a ``preexec_fn`` keeps process creation
    on the fast ``vfork`` path (a large trainer process forks slowly) and
    is safe in multi-threaded hosts.  ``None`` when util-linux is missing.
    """
    prlimit = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if prlimit is None or (drop_uid is not None and setpriv is None):
        return None
    argv: list[str] = []
    if drop_uid is not None:
        assert setpriv is not None
        uid = str(drop_uid)
        argv += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--"]
    argv.append(prlimit)
    argv += [f"{opt}={soft}:{hard}" for _res, opt, soft, hard in pairs]
    argv.append("--")
    return argv

def check_limit_wrapper(wrapper: list[str]) -> None:
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
