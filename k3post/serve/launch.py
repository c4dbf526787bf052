"""Local engine servers: `LocalServers` starts ``k3post serve`` processes for a model folder on loopback,
waits until each answers ``/health``, and stops them (terminate, then kill) when closed.

A server is a worker process of the command (`k3post.workers`: forked from the server that imported the
pipeline once, ~0.5 s of a core to start where a fresh ``python -m k3post serve`` took ~5 s) running the
``k3post serve`` command line, its output in its log file; ``K3POST_WORKER_START=spawn`` starts it as a fresh
interpreter instead, and so does a daemonic caller (a pool worker), which multiprocessing allows no child
process (``python -m k3post serve``, logged). `ServerHandle` gives a worker the ``Popen`` methods the callers use.
As for every worker process, a script that launches servers guards its top level with
``if __name__ == "__main__":`` (multiprocessing runs the main module again in each worker).

``engine.kind = http`` with ``engine.launch = N`` uses it (`k3post.rollout.factory.build_engine`): every
engine a stage builds then runs in N server processes of its own, the policy's (kept in step by weight
pushes) and the frozen models' (the SFT model the experts' budgets and "before" row are measured on, the
MOPD teachers sampled in the evaluation, the GRM judge). One machine, many processes: the layout that
external servers (``engine.urls``) take across machines, runnable and testable on a laptop.

Each server gets a free loopback port (bound and released just before the start; a server that loses the
port to another process exits at once and is restarted on a new one, at most 3 times). Its output goes to
a log file, whose tail is in the error when it exits or stays unhealthy past ``ready_timeout_s``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx

from k3post.threads import PARENT_ENV
from k3post.workers import worker_process

__all__ = ["LocalServers", "ServerProcess"]

log = logging.getLogger(__name__)

_PORT_ATTEMPTS = 3


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerHandle:
    """A server's worker process with the ``subprocess.Popen`` methods its callers use: ``pid``, ``poll``,
    ``returncode``, ``terminate``, ``kill``, ``wait`` (``subprocess.TimeoutExpired`` past ``timeout``)."""

    def __init__(self, process: Any, args: list[str]) -> None:
        self._process, self.args = process, args

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return int(self._process.exitcode)


def _serve(argv: list[str], log_path: str) -> None:
    """In the server's process: ``k3post serve`` with ``argv``, stdout and stderr into ``log_path`` (appended),
    stdin empty; exits with the command's status."""
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(nothing)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)  # a killed server's log holds what it printed
    # `python -m k3post serve ...` in this process: the command line by name, as the spawned servers ran it
    sys.argv = ["k3post", *argv]
    runpy.run_module("k3post", run_name="__main__", alter_sys=True)  # exits with the command's status


@dataclass
class ServerProcess:
    """One running ``k3post serve``: its base URL, process and log file."""

    url: str
    proc: ServerHandle | subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 3000) -> str:
        try:
            text = self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"
        if not text and self.proc.poll() is not None and isinstance(self.proc, ServerHandle):
            return ("(empty: the worker process exited before `k3post serve` ran; its error went to this process's "
                    "stderr. A script that launches servers imports cleanly in a worker only under an "
                    "`if __name__ == \"__main__\":` guard: k3post.workers)")
        return text


class LocalServers:
    """``n`` ``k3post serve`` processes for ``model_dir`` (module doc); a context manager.

    Args:
        model_dir: a model folder with its XTML tokenizer (``save_model`` output).
        n: number of server processes.
        max_batch_size, max_model_len: each server's engine slots and positions per sequence.
        qat: run the servers' experts MX fake-quantized (``k3post serve --qat``, the default scheme).
        threads: torch CPU threads per server (None: torch's default).
        log_dir: where the servers' logs go (default: a temporary folder, removed with the servers
            unless one failed).
        host: loopback by default; the servers are reachable only from this machine.
        ready_timeout_s: longest wait for a server's ``/health``.
        remove_on_close: a folder removed when the servers stop (or fail to start), e.g. the temporary
            model folder they were started from.
    """

    def __init__(
        self,
        model_dir: str | Path,
        n: int = 1,
        *,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        qat: bool = False,
        threads: int | None = None,
        log_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        ready_timeout_s: float = 180.0,
        remove_on_close: str | Path | None = None,
        record_routes: bool = False,
        exact: bool = False,
    ) -> None:
        self.remove_on_close = Path(remove_on_close) if remove_on_close is not None else None
        self.servers: list[ServerProcess] = []
        # a run that ends without closing (an exception, an interpreter exit) still stops its servers
        weakref.finalize(self, _stop, self.servers)
        self.model_dir = Path(model_dir)
        self._own_logs = False
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            self.close()
            raise ValueError(f"LocalServers: n must be an int >= 1, got {n!r}")
        if not (self.model_dir / "config.json").is_file():
            self.close()
            raise ValueError(f"{self.model_dir}: not a model folder (no config.json)")
        self.host = host
        self.ready_timeout_s = float(ready_timeout_s)
        self._own_logs = log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix="k3post-servers-")) if log_dir is None else Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._args = ["--max-batch-size", str(max_batch_size), "--qat" if qat else "--no-qat", "--log-level", "warning"]
        if max_model_len is not None:
            self._args += ["--max-model-len", str(max_model_len)]
        if threads is not None:
            self._args += ["--threads", str(threads)]
        if record_routes:
            self._args += ["--record-routes"]
        if exact:
            self._args += ["--exact"]
        try:
            for i in range(n):
                self._start(i)
        except BaseException:
            self.close()
            raise
        log.info("started %d engine server(s) for %s: %s", n, self.model_dir, ", ".join(self.urls))

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def _spawn(self, i: int) -> ServerProcess:
        port = _free_port(self.host)
        logf = self.log_dir / f"server{i}.log"
        # the servers import the same k3post as this process (a source checkout on PYTHONPATH included) and exit
        # when this process is killed (k3post.threads.exit_with_parent)
        here = str(Path(__file__).resolve().parents[2])
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
               PARENT_ENV: str(os.getpid())}
        argv = ["serve", str(self.model_dir), "--host", self.host, "--port", str(port), *self._args]
        if multiprocessing.current_process().daemon:
            # a daemonic process (a multiprocessing pool's worker: the experts' domain workers) may start no
            # process of multiprocessing's: the server is a fresh interpreter (~5 s of a core more to start)
            log.info("engine server %d: a fresh `python -m k3post serve` (this process is a pool worker, which "
                     "cannot start workers of its own)", i)
            with logf.open("wb") as out:
                popen = subprocess.Popen([sys.executable, "-m", "k3post", *argv], env={**os.environ, **env}, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            return ServerProcess(f"http://{self.host}:{port}", popen, logf)
        logf.write_bytes(b"")
        # daemon: a command that exits without closing its servers stops them (multiprocessing terminates
        # daemonic children at exit instead of waiting for them)
        proc = worker_process(_serve, (argv, str(logf)), env=env, daemon=True, name=f"k3post serve {i}")
        proc.start()
        return ServerProcess(f"http://{self.host}:{port}", ServerHandle(proc, ["k3post", *argv]), logf)

    def _start(self, i: int) -> None:
        for attempt in range(_PORT_ATTEMPTS):
            s = self._spawn(i)
            self.servers.append(s)  # stopped by close() whatever happens next
            err = self._wait_ready(s)
            if err is None:
                return
            self.servers.remove(s)
            if "address already in use" in s.tail().lower() and attempt + 1 < _PORT_ATTEMPTS:
                log.warning("engine server %d lost its port %s; restarting on another", i, s.url)
                continue
            self._own_logs = False  # keep the logs of a failed start
            raise RuntimeError(f"engine server for {self.model_dir} ({s.url}) {err}; log {s.log}:\n{s.tail()}")
        raise AssertionError("unreachable")

    def _wait_ready(self, s: ServerProcess) -> str | None:
        """None once ``/health`` answers 200; else why not (the process is stopped)."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if s.proc.poll() is not None:
                return f"exited with code {s.proc.returncode} before it was ready"
            try:
                if httpx.get(s.url + "/health", timeout=2).status_code == 200:
                    return None
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        _stop([s])
        return f"was not ready after {self.ready_timeout_s:.0f} s"

    def close(self) -> None:
        """Stop every server (terminate, then kill after 15 s); remove the logs unless a start failed, and
        ``remove_on_close``."""
        _stop(self.servers)
        self.servers.clear()
        if self._own_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if self.remove_on_close is not None:
            shutil.rmtree(self.remove_on_close, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(servers: list[ServerProcess]) -> None:
    for s in servers:
        if s.proc.poll() is None:
            s.proc.terminate()
    for s in servers:
        try:
            s.proc.wait(15)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait()
