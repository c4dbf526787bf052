"""The sandbox fails closed (issue 20): refusal without isolation, explicit weak opt-in, limits that
must apply, and the escapes that the namespace backends must contain.

Every escape runs real code inside the sandbox and asserts the contained outcome; the backend probe is
forced with monkeypatch (never by uninstalling bubblewrap).
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_sandbox import FAST, NAMESPACE_BACKENDS, REPO_ROOT, _make, _py

import k3post.envs.sandbox.core as sandbox_mod  # the backends' probe cache lives beside Sandbox
from k3post.config import load_config
from k3post.config.sandbox import apply_sandbox_config
from k3post.envs.sandbox import Sandbox, SandboxUnavailableError, available_backends


@pytest.fixture
def no_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine where neither bwrap nor unshare works (forced probe results)."""
    monkeypatch.delenv("K3POST_SANDBOX_BACKEND", raising=False)
    monkeypatch.delenv("K3POST_ALLOW_WEAK_ISOLATION", raising=False)
    monkeypatch.setattr(sandbox_mod, "_probe_cache", {"bwrap": False, "unshare": False})


@pytest.fixture(params=NAMESPACE_BACKENDS)
def ns_sb(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    sb = _make(request.param)
    yield sb
    sb.close()


# ------------------------------------------------------------------ fails closed


def test_auto_refuses_without_isolation(no_namespaces: None) -> None:
    with pytest.raises(SandboxUnavailableError) as err:
        Sandbox(limits=FAST)
    msg = str(err.value)
    assert "bash scripts/install.sh" in msg and "apt-get install bubblewrap" in msg
    assert "sandbox.allow_weak_isolation=true" in msg and "K3POST_ALLOW_WEAK_ISOLATION=1" in msg


def test_coding_environment_refuses_without_isolation(no_namespaces: None) -> None:
    from k3post.envs.families.coding.family import _verify_in_fresh_sandbox
    from k3post.envs.sandbox_tools import SandboxState

    with pytest.raises(SandboxUnavailableError, match="install bubblewrap"):
        SandboxState({"solution.py": "x = 1\n"})
    with pytest.raises(SandboxUnavailableError):
        _verify_in_fresh_sandbox({"solution.py": "def f():\n    return 1\n"}, [])


def test_weak_opt_in_by_env_logs_every_run_and_flags_results(
    no_namespaces: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("K3POST_ALLOW_WEAK_ISOLATION", "1")
    with pytest.warns(RuntimeWarning, match="isolation is WEAK"):
        sb = Sandbox(limits=FAST)
    with sb, caplog.at_level(logging.WARNING, logger="k3post.envs.sandbox"):
        assert sb.backend == "rlimit" and sb.weak_isolation
        results = [sb.run(["python", "-c", "print(1)"]) for _ in range(2)]
    assert [r.stdout for r in results] == ["1\n", "1\n"]
    assert all(r.weak_isolation for r in results)
    assert sum("WEAK isolation" in r.getMessage() for r in caplog.records) == 2


def test_weak_opt_in_by_config_flags_the_verdict(no_namespaces: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from k3post.envs.families.coding.family import _verify_in_fresh_sandbox
    from k3post.envs.families.coding.problems import encode_value
    from k3post.envs.task import Verdict

    cfg = load_config(None, ["sandbox.allow_weak_isolation=true"])
    apply_sandbox_config(cfg.sandbox)  # what the CLI does after loading a config (monkeypatch restores the env)
    assert os.environ["K3POST_ALLOW_WEAK_ISOLATION"] == "1"
    case = {"module": "solution", "func": "f", "args": [], "expected": encode_value(1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        verdict = _verify_in_fresh_sandbox({"solution.py": "def f():\n    return 1\n"}, [case])
    assert verdict.reward == 1.0 and verdict.weak_isolation
    assert verdict.to_dict()["weak_isolation"] is True
    assert Verdict.from_dict(verdict.to_dict()) == verdict


def test_isolated_results_are_not_flagged(ns_sb: Sandbox) -> None:
    assert not ns_sb.weak_isolation and not ns_sb.run(["true"]).weak_isolation
    assert "weak_isolation" not in __import__("k3post.envs.task", fromlist=["Verdict"]).Verdict(1.0).to_dict()


def test_sandbox_config_rejects_unknown_backend() -> None:
    from k3post.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="sandbox.backend"):
        load_config(None, ["sandbox.backend=chroot"])


# ------------------------------------------------------------------ limits must apply


def test_failed_setrlimit_in_preexec_raises_naming_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    available_backends()  # probe before breaking setrlimit
    monkeypatch.setattr(Sandbox, "_wrapper_argv", lambda self: None)  # the preexec_fn path (no util-linux)
    real = resource.setrlimit

    def failing(res: int, lim: tuple[int, int]) -> None:  # runs in the forked child
        if res == resource.RLIMIT_NPROC:
            raise OSError(1, "Operation not permitted")
        real(res, lim)

    monkeypatch.setattr(resource, "setrlimit", failing)
    with Sandbox(limits=FAST) as sb:
        with pytest.raises(RuntimeError, match="setrlimit failed.*RLIMIT_NPROC"):
            sb.run(["true"])


def test_failed_prlimit_raises_naming_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    available_backends()
    with Sandbox(limits=FAST) as sb:
        if sb._wrapper_argv() is None:
            pytest.skip("util-linux prlimit is not installed")
        pairs = sb._rlimit_pairs()
        bad = [(r, o, 100, 50) if o == "--nofile" else (r, o, s, h) for r, o, s, h in pairs]  # soft > hard
        monkeypatch.setattr(Sandbox, "_rlimit_pairs", lambda self: bad)
        with pytest.raises(RuntimeError, match="could not apply the resource limits.*(?i:nofile)"):
            sb.run(["true"])


# ------------------------------------------------------------------ escapes


def test_no_host_fd_reaches_the_command(ns_sb: Sandbox) -> None:
    """Hole found and fixed here: the O_PATH fd of the private /etc dir (and, for unshare, of the workdir)
    reached the command, and `/proc/self/fd/N/..` walked out to the host /tmp and from there anywhere."""
    res = _py(
        ns_sb,
        f"""
        import os
        fds = sorted(int(f) for f in os.listdir('/proc/self/fd'))
        print(fds)
        for fd in fds:
            try:
                print(open(f'/proc/self/fd/{{fd}}/../../{str(REPO_ROOT / "pyproject.toml").lstrip("/")}').read()[:20])
            except OSError:
                pass
        """,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["[0, 1, 2, 3]"]  # stdio and listdir's own fd, nothing else


def test_symlink_escapes_stay_inside(ns_sb: Sandbox) -> None:
    target = str(REPO_ROOT / "pyproject.toml")
    res = _py(
        ns_sb,
        f"""
        import os
        for name, dest in [('l1', {target!r}), ('l2', '/proc/1/root' + {target!r}), ('l3', '/proc/self/root/../../' + {target!r})]:
            os.symlink(dest, name)
            try:
                print(name, open(name).read()[:20])
            except OSError as e:
                print(name, 'denied', type(e).__name__)
        """,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["l1 denied FileNotFoundError", "l2 denied FileNotFoundError",
                                       "l3 denied FileNotFoundError"]
    # the host-side helpers do not follow them either
    for name in ("l1", "l2", "l3"):
        with pytest.raises(ValueError, match="outside"):
            ns_sb.read_file(name)
    assert "[build-system]" not in str(ns_sb.state_dict())
    assert ns_sb.list_files() == ["prog.py"]


def test_proc_root_escapes_stay_inside(ns_sb: Sandbox) -> None:
    res = _py(
        ns_sb,
        f"""
        import os
        pids = [p for p in os.listdir('/proc') if p.isdigit()]
        print('pids', len(pids))
        seen = []
        for p in ['self', *pids]:
            for path in (f'/proc/{{p}}/root{str(REPO_ROOT)}', f'/proc/{{p}}/cwd/..{str(REPO_ROOT)}', f'/proc/{{p}}/root/root'):
                if os.path.exists(path):
                    seen.append(path)
        print('seen', seen)
        """,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert int(lines[0].split()[1]) <= 4  # a private PID namespace: only the sandbox's own processes
    assert lines[1] == "seen []"


def test_dev_shm_is_private_per_run(ns_sb: Sandbox) -> None:
    name = f"k3post-shm-{uuid.uuid4().hex}"
    write = _py(ns_sb, f"open('/dev/shm/{name}', 'w').write('x'); import os; print(os.listdir('/dev/shm'))")
    assert write.returncode == 0 and name in write.stdout, write.stderr
    assert not os.path.exists(f"/dev/shm/{name}")  # not on the host
    again = ns_sb.run(["python", "-c", f"import os; print(os.path.exists('/dev/shm/{name}'))"])
    assert again.stdout == "False\n"  # nor in the next run
    with _make(ns_sb.backend) as other:
        seen = other.run(["python", "-c", f"import os; print(os.path.exists('/dev/shm/{name}'))"])
    assert seen.stdout == "False\n"  # nor in another sandbox


@pytest.mark.parametrize("backend", [*NAMESPACE_BACKENDS, "rlimit"])
def test_ptrace_of_the_host_parent_fails(backend: str) -> None:
    """The trainer that launched the run can be neither traced nor read through /proc/<pid>/mem.
    (Under bwrap / unshare ``getppid()`` is the namespace's own init, with no capabilities and no host
    fds; tracing it only stalls the run until the wall timeout: docs/decisions.md.)"""
    if backend == "rlimit" and os.geteuid() != 0:
        pytest.skip("rlimit without root runs as the host uid, which may trace its own processes (weak)")
    with _make(backend) as sb:
        res = _py(
            sb,
            """
            import ctypes, ctypes.util, os, sys
            libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6', use_errno=True)
            libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
            PTRACE_ATTACH, PTRACE_SEIZE = 16, 0x4206
            host = int(sys.argv[1])
            targets = [host] + ([os.getppid()] if sys.argv[2] == 'rlimit' else [])
            for pid in targets:
                for req in (PTRACE_ATTACH, PTRACE_SEIZE):
                    ctypes.set_errno(0)
                    print(libc.ptrace(req, pid, None, None), ctypes.get_errno() != 0)
                try:
                    open(f'/proc/{pid}/mem', 'rb').read(1); print('mem readable')
                except OSError:
                    print('mem denied')
            """,
            str(os.getpid()),
            backend,
        )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == (6 if backend == "rlimit" else 3), res.stdout
    assert set(lines) == {"-1 True", "mem denied"}, res.stdout


def test_parallel_sandboxes_cannot_read_each_other(ns_sb: Sandbox) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    ns_sb.write_file("secret.txt", secret)
    started = threading.Event()
    holder: dict[str, object] = {}

    def hold() -> None:  # keeps ns_sb's run (and its mounts) alive while the other sandbox looks
        started.set()
        holder["res"] = ns_sb.run(["python", "-c", "import time; print(open('secret.txt').read()); time.sleep(2)"])

    t = threading.Thread(target=hold)
    t.start()
    started.wait()
    with _make(ns_sb.backend) as other:
        res = _py(
            other,
            f"""
            import glob, os
            found = []
            for pattern in ['{ns_sb.workdir}/*', '/tmp/k3sbx-*/*', '/tmp/*/*', '/sandbox/../*/secret.txt',
                            '/proc/*/root/sandbox/secret.txt', '/proc/*/cwd/secret.txt']:
                for path in glob.glob(pattern):
                    try:
                        found.append((path, open(path).read()[:80]))
                    except OSError:
                        pass
            print(found)
            """,
        )
    t.join()
    assert holder["res"].stdout.strip() == secret  # type: ignore[union-attr]
    assert res.returncode == 0, res.stderr
    assert secret not in res.stdout


@pytest.mark.parametrize("backend", [*NAMESPACE_BACKENDS, "rlimit"])
def test_host_secrets_in_env_do_not_leak(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "rlimit" and os.geteuid() != 0:
        pytest.skip("rlimit without root runs as the host uid, which can read /proc/<parent>/environ (weak)")
    secret = f"hunter2-{uuid.uuid4().hex}"
    monkeypatch.setenv("K3POST_TEST_SECRET", secret)
    with _make(backend) as sb:
        res = _py(
            sb,
            """
            import glob, os
            print(sorted(os.environ))
            for path in glob.glob('/proc/*/environ'):
                try:
                    print(open(path, 'rb').read().decode(errors='replace'))
                except OSError:
                    pass
            """,
        )
    assert res.returncode == 0, res.stderr
    assert "K3POST_TEST_SECRET" not in res.stdout and secret not in res.stdout


# ------------------------------------------------------------------ install


def _fake_bin(tmp_path: Path, apt_rc: int) -> Path:
    """A PATH holding only `uname` (Linux), `id` (root) and an `apt-get` exiting ``apt_rc``: no bwrap."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"uname": "echo Linux", "id": "echo 0", "apt-get": f"exit {apt_rc}"}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_install_fails_when_apt_cannot_provide_bubblewrap(tmp_path: Path) -> None:
    import subprocess

    script = REPO_ROOT / "scripts" / "install_sandbox.sh"
    env = {"PATH": str(_fake_bin(tmp_path, apt_rc=100)), "HOME": str(tmp_path)}
    proc = subprocess.run(["/bin/bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "apt-get install bubblewrap failed" in proc.stderr
    install = (REPO_ROOT / "scripts" / "install.sh").read_text()
    assert "bash scripts/install_sandbox.sh\n" in install and "install_sandbox.sh ||" not in install
