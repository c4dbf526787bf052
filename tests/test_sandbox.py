"""Tests for k3post.envs.sandbox: functional behaviour and adversarial containment.

Every adversarial case runs inside the sandbox and asserts the specific
contained outcome.  Cases that only a namespace backend can contain (network,
filesystem view) run on each namespace backend; a missing bubblewrap fails them
(`bash scripts/install.sh` provides it), a missing ``unshare`` skips them outside CI.
"""

from __future__ import annotations

import ast
import json
import os
import random
import resource
import socket
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from k3post.envs.sandbox import (
    SANDBOX_DIR,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    available_backends,
    probe_backend,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMESPACE_BACKENDS = ("bwrap", "unshare")
ALL_BACKENDS = ("bwrap", "unshare", "rlimit")

FAST = SandboxLimits(cpu_s=5, wall_s=10, memory_bytes=1024**3, nproc=32, max_output_bytes=256 * 1024)


def require_backend(backend: str) -> None:
    """Fail (not skip) when bubblewrap does not work: `bash scripts/install.sh` provides it wherever it can
    (and fails where apt is present but cannot), so a missing bwrap is a broken install. ``unshare`` may skip, except in
    CI (``CI`` set), which must run every isolation test."""
    if backend == "rlimit" or probe_backend(backend):
        return
    if backend == "bwrap" or os.environ.get("CI"):
        pytest.fail(f"sandbox backend {backend!r} does not work here; run `bash scripts/install.sh`")
    pytest.skip(f"sandbox backend {backend!r} is not available on this machine")


def _make(backend: str, limits: SandboxLimits = FAST, **kw: object) -> Sandbox:
    require_backend(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return Sandbox(limits=limits, backend=backend, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=ALL_BACKENDS)
def any_sb(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """A sandbox on each backend (namespace ones skip if unavailable)."""
    sb = _make(request.param)
    yield sb
    sb.close()


@pytest.fixture(params=NAMESPACE_BACKENDS)
def ns_sb(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """A sandbox on each namespace backend; skips when that backend is missing."""
    sb = _make(request.param)
    yield sb
    sb.close()


@pytest.fixture(
    params=[
        "ns",
        "rlimit",
        pytest.param("unshare", marks=pytest.mark.slow),
        pytest.param("bwrap", marks=pytest.mark.slow),
    ]
)
def timed_sb(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """For the timeout-bound cases: the best namespace backend and rlimit by default
    (every namespace backend explicitly under ``-m slow``)."""
    backend = str(request.param)
    if backend == "ns":
        require_backend("bwrap")
        backend = "bwrap"
    sb = _make(backend)
    yield sb
    sb.close()


@pytest.fixture
def sb() -> Iterator[Sandbox]:
    """A sandbox on the automatically chosen backend."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        s = Sandbox(limits=FAST)
    yield s
    s.close()


def _py(sb: Sandbox, code: str, *args: str, **kw: object) -> SandboxResult:
    sb.write_file("prog.py", textwrap.dedent(code))
    return sb.run(["python", "prog.py", *args], **kw)  # type: ignore[arg-type]


def _marker() -> str:
    """A unique `sleep` duration usable as an argv marker (e.g. 1000.123456789)."""
    return f"1000.{random.randrange(10**8, 10**9)}"


def _procs_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _assert_no_procs(marker: str, within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while _procs_with(marker):
        if time.monotonic() > deadline:
            raise AssertionError(f"sandboxed processes with marker {marker} survived: {_procs_with(marker)}")
        time.sleep(0.05)


# ----------------------------------------------------------------- functional


def test_backend_selection_reports_working_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("K3POST_SANDBOX_BACKEND", raising=False)
    backends = available_backends()
    assert backends[-1] == "rlimit"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with Sandbox() as s:
            assert s.backend == backends[0]
            assert s.run(["true"]).backend == backends[0]


def test_backend_override_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3POST_SANDBOX_BACKEND", "rlimit")
    with pytest.warns(RuntimeWarning, match="WEAK"):
        s = Sandbox()
    with s:
        assert s.backend == "rlimit"
        assert s.run(["python", "-c", "print(1)"]).stdout == "1\n"


def test_fallback_to_rlimit_warns_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    import k3post.envs.sandbox.core as sandbox_mod  # the backends' probe cache lives beside Sandbox

    monkeypatch.delenv("K3POST_SANDBOX_BACKEND", raising=False)
    monkeypatch.setenv("K3POST_ALLOW_WEAK_ISOLATION", "1")  # without it: tests/test_sandbox_isolation.py
    monkeypatch.setattr(sandbox_mod, "_probe_cache", {"bwrap": False, "unshare": False})
    with pytest.warns(RuntimeWarning, match="isolation is WEAK"):
        s = Sandbox(limits=FAST)
    with s:
        assert s.backend == "rlimit"
        with pytest.raises(RuntimeError):
            Sandbox(backend="bwrap")


def test_stdout_stderr_returncode(any_sb: Sandbox) -> None:
    res = _py(any_sb, "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(7)\n")
    assert res.returncode == 7
    assert res.stdout == "out\n"
    assert res.stderr == "err\n"
    assert not res.timed_out and res.killed_reason is None
    assert res.backend == any_sb.backend
    assert res.wall_s > 0


def test_stdin_is_passed(any_sb: Sandbox) -> None:
    res = any_sb.run(["python", "-c", "import sys; print(sys.stdin.read().upper())"], stdin="hello sandbox")
    assert res.ok, res
    assert res.stdout == "HELLO SANDBOX\n"


def test_large_stdin_is_passed(any_sb: Sandbox) -> None:
    data = "x" * 200_000
    res = any_sb.run(["python", "-c", "import sys; print(len(sys.stdin.read()))"], stdin=data)
    assert res.stdout.strip() == "200000"


def test_env_is_minimal_and_extendable(any_sb: Sandbox) -> None:
    os.environ["K3POST_TEST_SECRET"] = "leak"
    try:
        res = any_sb.run(
            ["python", "-c", "import os; print(os.environ.get('FOO'), os.environ.get('K3POST_TEST_SECRET'))"],
            env={"FOO": "bar"},
        )
    finally:
        del os.environ["K3POST_TEST_SECRET"]
    assert res.stdout == "bar None\n"


def test_files_persist_across_runs(any_sb: Sandbox) -> None:
    assert any_sb.run(["python", "-c", "open('state.txt', 'w').write('42')"]).ok
    res = any_sb.run(["python", "-c", "print(open('state.txt').read())"])
    assert res.stdout == "42\n"
    assert any_sb.read_file("state.txt") == "42"
    assert "state.txt" in any_sb.list_files()


def test_python_solution_and_unittest_run(any_sb: Sandbox) -> None:
    any_sb.write_file("solution.py", "def add(a, b):\n    return a + b\n")
    any_sb.write_file(
        "tests/test_solution.py",
        "import unittest\nfrom solution import add\n\n"
        "class T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n",
    )
    any_sb.write_file("tests/__init__.py", "")
    res = any_sb.run(["python", "-m", "unittest", "-q", "tests.test_solution"])
    assert res.returncode == 0, res.stderr
    assert "OK" in res.stderr


def test_command_not_found(any_sb: Sandbox) -> None:
    res = any_sb.run(["definitely-not-a-command-k3"])
    assert res.returncode != 0


def test_workdir_visible_at_sandbox_dir(ns_sb: Sandbox) -> None:
    res = ns_sb.run(["python", "-c", "import os; print(os.getcwd()); print(os.getuid())"])
    cwd, _uid = res.stdout.split()
    assert cwd == SANDBOX_DIR


def test_host_python_mode() -> None:
    """python='host' exposes this interpreter read-only, or refuses clearly when it can't."""
    from k3post.envs.sandbox.host import _inner_python, _world_traversable

    with pytest.raises(ValueError):
        Sandbox(python="java")
    backend = available_backends()[0]
    _exe, prefixes = _inner_python("host")
    reachable = os.geteuid() != 0 or all(_world_traversable(p) for p in prefixes)
    if not reachable:
        # e.g. a pyenv under /root (mode 0700) while the sandbox runs as its own unprivileged uid
        with pytest.raises(RuntimeError, match="python='system'"):
            _make(backend, python="host")
        return
    with _make(backend, python="host") as s:
        code = f"import sys, pytest; print(sys.version_info[:2] == {tuple(sys.version_info[:2])})"
        res = s.run(["python", "-c", code])
        assert res.stdout == "True\n", res
        if s.backend != "rlimit":
            res = _py(s, f"print(open({str(REPO_ROOT / 'pyproject.toml')!r}).read())")
            assert res.returncode != 0 and "[project]" not in res.stdout


def test_preexec_fallback_without_util_linux_wrappers(monkeypatch: pytest.MonkeyPatch, any_sb: Sandbox) -> None:
    """Without setpriv/prlimit the limits and uid switch come from a preexec_fn."""
    monkeypatch.setattr(Sandbox, "_wrapper_argv", lambda self: None)
    res = any_sb.run(["python", "-c", "import resource; print(resource.getrlimit(resource.RLIMIT_CPU))"])
    assert res.ok, res
    assert res.stdout == f"({int(FAST.cpu_s)}, {int(FAST.cpu_s) + 1})\n"
    if os.geteuid() == 0:  # the dedicated uid is in force: the NPROC limit holds
        res = _py(
            any_sb,
            "import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time; time.sleep(30)\n        n += 1\nexcept OSError:\n    print(n)\n",
        )
        assert int(res.stdout.strip().splitlines()[-1]) < FAST.nproc, res
    res = any_sb.run(["python", "-c", "x = bytearray(4 * 1024**3)"])
    assert res.killed_reason == "memory", res


def test_write_read_list_helpers(sb: Sandbox) -> None:
    sb.write_file("a.txt", "alpha")
    sb.write_file("sub/dir/b.txt", "beta")
    sb.write_file("raw.bin", b"\x00\x01")
    assert sb.read_file("sub/dir/b.txt") == "beta"
    assert sb.list_files() == ["a.txt", "raw.bin", "sub/dir/b.txt"]
    res = sb.run(["python", "-c", "print(open('sub/dir/b.txt').read())"])
    assert res.stdout == "beta\n"


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "sub/../../etc/passwd", "", "/"])
def test_path_traversal_rejected(sb: Sandbox, bad: str) -> None:
    with pytest.raises(ValueError):
        sb.write_file(bad, "nope")
    with pytest.raises(ValueError):
        sb.read_file(bad)


def test_symlink_escape_rejected(sb: Sandbox) -> None:
    res = sb.run(["python", "-c", "import os; os.symlink('/etc', 'etclink'); os.symlink('/etc/hostname', 'h')"])
    assert res.ok, res
    with pytest.raises(ValueError):
        sb.read_file("etclink/passwd")
    with pytest.raises(ValueError):
        sb.read_file("h")
    with pytest.raises(ValueError):
        sb.write_file("etclink/evil", "x")
    assert not Path("/etc/evil").exists()


def test_snapshot_modify_restore(any_sb: Sandbox) -> None:
    any_sb.write_file("keep.txt", "v1")
    any_sb.run(["python", "-c", "import os; os.makedirs('d', exist_ok=True); open('d/made.txt','w').write('m')"])
    blob = any_sb.snapshot()
    assert isinstance(blob, bytes)
    any_sb.write_file("keep.txt", "v2")
    any_sb.write_file("new.txt", "later")
    any_sb.run(["python", "-c", "import os; os.remove('d/made.txt')"])
    any_sb.restore(blob)
    assert any_sb.list_files() == ["d/made.txt", "keep.txt"]
    assert any_sb.read_file("keep.txt") == "v1"
    # the restored files are usable (and writable) by sandboxed code
    res = any_sb.run(["python", "-c", "print(open('d/made.txt').read()); open('keep.txt','a').write('+')"])
    assert res.ok, res
    assert res.stdout == "m\n"
    assert any_sb.read_file("keep.txt") == "v1+"


def test_snapshot_restore_into_fresh_sandbox(sb: Sandbox) -> None:
    sb.write_file("solution.py", "print('resumed')\n")
    sb.run(["python", "-c", "open('progress.txt','w').write('step 3')"])
    state = json.loads(json.dumps(sb.state_dict()))  # JSON-able: travels with a paused trajectory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with Sandbox(limits=FAST) as fresh:
            assert fresh.list_files() == []
            fresh.load_state_dict(state)
            assert fresh.read_file("progress.txt") == "step 3"
            assert fresh.run(["python", "solution.py"]).stdout == "resumed\n"


def test_restore_rejects_garbage_and_skips_unsafe_members(sb: Sandbox) -> None:
    import io
    import tarfile

    with pytest.raises(ValueError):
        sb.restore(b"not a tarball")
    with pytest.raises(ValueError):
        sb.load_state_dict({"nope": 1})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("ok.txt", b"fine"), ("../evil.txt", b"bad")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("shadow")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/shadow"
        tar.addfile(link)
    sb.restore(buf.getvalue())
    assert sb.list_files() == ["ok.txt"]
    assert not (sb.workdir.parent / "evil.txt").exists()
    assert not (sb.workdir / "shadow").is_symlink()


def test_close_removes_temp_workdir_but_not_user_workdir() -> None:
    import shutil
    import tempfile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        s = Sandbox(limits=FAST)
        wd = s.workdir
        s.write_file("x", "1")
        s.close()
        assert not wd.exists()
        with pytest.raises(ValueError):
            s.run(["true"])
        parent = Path(tempfile.mkdtemp(prefix="k3sbx-test-"))
        parent.chmod(0o755)
        try:
            user_dir = parent / "wd"
            with Sandbox(workdir=user_dir, limits=FAST) as s2:
                s2.write_file("x", "1")
                assert s2.run(["python", "-c", "print(open('x').read())"]).stdout == "1\n"
            assert (user_dir / "x").read_text() == "1"
        finally:
            shutil.rmtree(parent)


def test_unreachable_user_workdir_rejected(ns_sb: Sandbox, tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("only a root host drops to a separate sandbox uid")
    with pytest.raises(ValueError, match="not reachable"):
        Sandbox(workdir=private / "wd", limits=FAST, backend=ns_sb.backend)
    assert not (private / "wd").exists()


def test_invalid_arguments_raise_value_error(sb: Sandbox) -> None:
    with pytest.raises(ValueError):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError):
        SandboxLimits(memory_bytes=-1)
    with pytest.raises(ValueError):
        Sandbox(backend="docker")
    with pytest.raises(ValueError):
        sb.run([])
    with pytest.raises(ValueError):
        sb.run(["true"], timeout=0)
    with pytest.raises(ValueError):
        sb.run(["true"], env={"A=B": "x"})


# ---------------------------------------------------- adversarial: network


def test_network_localhost_host_server_unreachable(ns_sb: Sandbox) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        res = _py(
            ns_sb,
            f"""
            import socket
            try:
                s = socket.create_connection(("127.0.0.1", {port}), timeout=3)
                s.sendall(b"escaped")
                print("CONNECTED")
            except OSError as e:
                print("BLOCKED", type(e).__name__)
            """,
        )
        assert res.returncode == 0, res
        assert "BLOCKED" in res.stdout and "CONNECTED" not in res.stdout
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


def test_network_internet_unreachable(ns_sb: Sandbox) -> None:
    res = _py(
        ns_sb,
        """
        import socket
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=3)
            print("CONNECTED")
        except OSError as e:
            print("BLOCKED", type(e).__name__)
        print(sorted(n for _, n in socket.if_nameindex()))
        """,
    )
    assert res.returncode == 0, res
    assert "BLOCKED" in res.stdout
    assert "['lo']" in res.stdout  # a private network namespace: loopback only


# ----------------------------------------------------- adversarial: files


def test_cannot_read_project_checkout(ns_sb: Sandbox) -> None:
    target = REPO_ROOT / "pyproject.toml"
    assert target.exists()
    res = _py(ns_sb, f"print(open({str(target)!r}).read())")
    assert res.returncode != 0
    assert "FileNotFoundError" in res.stderr or "PermissionError" in res.stderr
    assert "[project]" not in res.stdout


def test_cannot_read_etc_shadow(any_sb: Sandbox) -> None:
    if os.geteuid() != 0 and any_sb.backend == "rlimit":
        pytest.skip("rlimit backend without root cannot switch to an unprivileged uid")
    res = _py(any_sb, "print(open('/etc/shadow').read())")
    assert res.returncode != 0
    assert "FileNotFoundError" in res.stderr or "PermissionError" in res.stderr
    assert "root:" not in res.stdout


def test_cannot_see_root_home(ns_sb: Sandbox) -> None:
    host_entries = set(os.listdir("/root")) if os.access("/root", os.R_OK) else set()
    res = _py(ns_sb, "import os\nprint(sorted(os.listdir('/root')) if os.path.exists('/root') else 'ABSENT')")
    assert res.returncode == 0, res
    if res.stdout.strip() != "ABSENT":
        # only the ancestors of a bound interpreter prefix may appear
        allowed = {Path(p).parts[2] for p in ns_sb._prefixes if p.startswith("/root/")}
        visible = set(ast.literal_eval(res.stdout))
        assert not (visible & host_entries) - allowed


def test_cannot_read_host_tmp_file(ns_sb: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    os.chmod(tmp_path, 0o755)
    secret.chmod(0o644)
    res = _py(ns_sb, f"print(open({str(secret)!r}).read())")
    assert res.returncode != 0
    assert "host secret" not in res.stdout


def test_write_to_tmp_does_not_escape(ns_sb: Sandbox) -> None:
    name = f"/tmp/escape-{random.randrange(10**12)}"
    res = _py(ns_sb, f"open({name!r}, 'w').write('x'); print('wrote-in-private-tmp')")
    assert res.returncode == 0, res
    assert not Path(name).exists()


def test_write_to_usr_fails(any_sb: Sandbox) -> None:
    if os.geteuid() != 0 and any_sb.backend == "rlimit":
        pytest.skip("rlimit backend without root cannot switch to an unprivileged uid")
    name = f"/usr/escape-{random.randrange(10**12)}"
    res = _py(
        any_sb,
        f"""
        try:
            open({name!r}, 'w').write('x')
            print('WROTE')
        except OSError as e:
            print('DENIED', type(e).__name__)
        """,
    )
    assert "DENIED" in res.stdout, res
    assert not Path(name).exists()


def test_view_is_read_only_outside_workdir_and_tmp(ns_sb: Sandbox) -> None:
    res = _py(
        ns_sb,
        """
        for path in ("/evil", "/dev/evil", "/etc/evil", "/opt/evil", "/usr/bin/evil"):
            try:
                open(path, "w").write("x")
                print("WROTE", path)
            except OSError as e:
                print("DENIED", path, type(e).__name__)
        """,
    )
    assert res.returncode == 0, res
    assert "WROTE" not in res.stdout
    assert res.stdout.count("DENIED") == 5


def test_private_tmp_is_size_capped(ns_sb: Sandbox) -> None:
    with _make(ns_sb.backend, SandboxLimits(tmpfs_bytes=4 * 1024**2, fsize_bytes=64 * 1024**2)) as s:
        res = _py(
            s,
            """
            import errno
            for path in ("/tmp/fill", "/dev/shm/fill"):
                try:
                    with open(path, "wb") as fh:
                        fh.write(b"x" * (16 * 1024 * 1024))
                    print("FILLED", path)
                except OSError as e:
                    print("FULL", path, e.errno == errno.ENOSPC)
            """,
        )
    assert res.returncode == 0, res
    assert res.stdout.split("\n")[:2] == ["FULL /tmp/fill True", "FULL /dev/shm/fill True"]


def test_cannot_write_outside_workdir_via_dotdot(ns_sb: Sandbox) -> None:
    name = f"escape-{random.randrange(10**12)}"
    res = _py(ns_sb, f"open('../{name}', 'w').write('x')")
    assert res.returncode != 0
    assert not (ns_sb.workdir.parent / name).exists()


# ------------------------------------------------- adversarial: resources


def test_fork_bomb_process_limit_holds(any_sb: Sandbox) -> None:
    if os.geteuid() == 0 and any_sb._drop_uid is None:
        pytest.skip("running as root without a dedicated uid: RLIMIT_NPROC is not enforced")
    mark = _marker()
    res = _py(
        any_sb,
        """
        import os, sys, time
        n = 0
        for _ in range(10_000):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            n += 1
        print("forks", n)
        """,
        mark,
    )
    assert res.returncode == 0, res
    forks = int(res.stdout.split()[1])
    assert forks < FAST.nproc
    _assert_no_procs(mark)


def test_classic_fork_bomb_is_killed(timed_sb: Sandbox) -> None:
    if os.geteuid() == 0 and timed_sb._drop_uid is None:
        pytest.skip("running as root without a dedicated uid: RLIMIT_NPROC is not enforced")
    mark = _marker()
    timed_sb.write_file(
        "bomb.py", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    t0 = time.monotonic()
    res = timed_sb.run(["python", "bomb.py", mark], timeout=0.7)
    assert res.timed_out and res.killed_reason == "wall_timeout"
    assert time.monotonic() - t0 < 8
    _assert_no_procs(mark)


def test_memory_bomb(any_sb: Sandbox) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = any_sb.run(["python", "-c", "x = bytearray(4 * 1024**3); print('ALLOCATED')"])
    assert "ALLOCATED" not in res.stdout
    assert res.killed_reason == "memory", res
    assert "MemoryError" in res.stderr
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024  # KiB


def test_infinite_loop_wall_timeout(timed_sb: Sandbox) -> None:
    res = timed_sb.run(["python", "-c", "while True: pass"], timeout=0.5)
    assert res.timed_out
    assert res.killed_reason == "wall_timeout"
    assert res.wall_s < 4


def test_infinite_loop_cpu_limit(timed_sb: Sandbox) -> None:
    with _make(timed_sb.backend, SandboxLimits(cpu_s=1, wall_s=10)) as s:
        res = s.run(["python", "-c", "while True: pass"])
    assert not res.timed_out
    assert res.killed_reason == "cpu_limit", res
    assert res.returncode < 0


def test_sleeping_process_wall_timeout(timed_sb: Sandbox) -> None:
    res = timed_sb.run(["sleep", "100"], timeout=0.3)
    assert res.timed_out and res.killed_reason == "wall_timeout"
    assert res.wall_s < 3


def test_yes_output_is_capped(any_sb: Sandbox) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = any_sb.run(["yes"])
    assert res.killed_reason == "output_limit", res
    assert res.truncated
    assert len(res.stdout.encode()) <= FAST.max_output_bytes
    assert res.stdout.startswith("y\ny\n")
    assert res.wall_s < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024


def test_python_print_loop_output_is_capped(any_sb: Sandbox) -> None:
    res = any_sb.run(["python", "-c", "import sys\nwhile True: sys.stderr.write('e' * 4096)"])
    assert res.killed_reason == "output_limit", res
    assert res.truncated
    assert len(res.stderr) == FAST.max_output_bytes


def test_file_size_limit(any_sb: Sandbox) -> None:
    with _make(any_sb.backend, SandboxLimits(fsize_bytes=1024**2, wall_s=10)) as s:
        res = s.run(["python", "-c", "open('big', 'wb').write(b'x' * 8 * 1024**2)"])
        assert res.returncode != 0
        assert res.killed_reason == "file_size", res
        assert (s.workdir / "big").stat().st_size <= 1024**2


def test_detached_child_dies_on_timeout(timed_sb: Sandbox) -> None:
    mark = _marker()
    res = _py(
        timed_sb,
        f"""
        import os, time
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", "{mark}"])
            os._exit(0)
        os.waitpid(pid, 0)
        print("detached", flush=True)
        time.sleep(1000)
        """,
        timeout=1.5,
    )
    assert res.timed_out and res.killed_reason == "wall_timeout"
    assert "detached" in res.stdout
    _assert_no_procs(mark)


def test_detached_child_dies_when_parent_exits(any_sb: Sandbox) -> None:
    mark = _marker()
    res = _py(
        any_sb,
        f"""
        import os, subprocess
        subprocess.Popen(["sleep", "{mark}"], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print("parent done")
        """,
    )
    assert res.returncode == 0 and res.stdout == "parent done\n"
    assert res.wall_s < 5
    _assert_no_procs(mark)


@pytest.mark.slow
def test_gigabytes_of_output_drained_without_kill() -> None:
    limits = SandboxLimits(max_output_bytes=64 * 1024, kill_on_output_limit=False, wall_s=120, cpu_s=120)
    backend = available_backends()[0]
    with _make(backend, limits) as s:
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        res = s.run(["sh", "-c", "head -c 2000000000 /dev/zero"])
        assert res.returncode == 0 and res.killed_reason is None
        assert res.truncated and len(res.stdout) == 64 * 1024
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024


@pytest.mark.slow
def test_many_sequential_runs_leave_no_processes() -> None:
    backend = available_backends()[0]
    mark = _marker()
    with _make(backend) as s:
        for _ in range(50):
            s.run(["sh", "-c", f"sleep {mark} & echo started"], timeout=2)
    _assert_no_procs(mark)


def test_open_sandboxes_never_share_a_uid_across_processes(monkeypatch, tmp_path):
    """Every process's uid candidates start at (97·pid + count) mod the pool: two processes a pid apart meet after
    97 sandboxes. A shared uid shares ``RLIMIT_NPROC`` (a browser's threads spent a kernel compile's budget: bwrap
    failed with EAGAIN and a correct kernel scored 0, seen in the test run), so a uid is claimed with an exclusive
    ``flock`` held while its sandbox is open. Two simulated processes (pids 1 apart) hold 200 claims each: all
    distinct; a claim another real process holds is skipped; a released uid is free again."""
    import itertools
    import subprocess

    from k3post.envs.sandbox import host

    claims: list[tuple[int, int]] = []
    try:
        for pid in (50_000, 50_001):
            monkeypatch.setattr(host.os, "getpid", lambda pid=pid: pid)
            monkeypatch.setattr(host, "_uid_counter", itertools.count())
            claims += [host._allocate_uid() for _ in range(200)]
        assert len({uid for uid, _ in claims}) == 400
    finally:
        for _, fd in claims:
            host.release_uid(fd)
    # another process holds the first candidate of pid 60,000's first sandbox: it is skipped while held
    first = host.UID_BASE + (60_000 * 97) % host.UID_POOL
    # (the holder has another $TMPDIR: every process on the host must see the same claims)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; from k3post.envs.sandbox.host import UID_LOCKS; "
                               "fd = os.open(UID_LOCKS / sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
                               "print('held', flush=True); sys.stdin.read()", str(first)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(
                                  filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))})
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(host.os, "getpid", lambda: 60_000)
        monkeypatch.setattr(host, "_uid_counter", itertools.count())
        uid, fd = host._allocate_uid()
        host.release_uid(fd)
        assert uid == first + 1
    finally:
        holder.stdin.close()
        holder.wait(10)
    monkeypatch.setattr(host, "_uid_counter", itertools.count())
    uid, fd = host._allocate_uid()
    host.release_uid(fd)
    assert uid == first
