"""The children of the ``coding.kernel`` harness (issue 30): one process per implementation, timed from outside.

Every implementation the verifier times (the reference, the shipped expert, a null kernel that measures the
harness's own overhead, and the agent's ``kernel.py``) runs in **its own child process**, started by
`Sandbox.spawn` (bwrap: pid 1 alone in its own PID namespace, so it sees no other process). The agent's child
runs in the agent's sandbox; the other three in a separate trusted sandbox, so the agent's process never holds
(or can reach) the expert, the reference, the timing state, the parent's memory or any input but the ones it is
called with.

This file is both halves:

* run as a program (``python -I -B -c <this file> TYPECODE FUNC MODULE``, stdlib only, inside the sandbox) it is
  the child: it locks ``RLIMIT_NPROC`` to 0 (no thread, no process from here on), imports ``MODULE`` from its
  working directory, answers ``K3RD`` and then serves calls: a request frame holds the input buffers and the
  integer dims, the reply frame the result's raw bytes (the result must be exactly an ``array.array`` of the
  typecode or exactly a ``list``; anything else, a lazy iterable or a subclass included, is an error) and the
  input buffers as they are after the call (the parent checks they were not modified);
* imported on the host, `KernelChild` drives one child: it writes a request while the child is **stopped**
  (``SIGSTOP``), reads the child's CPU clock, continues it, reads the whole reply, stops it again, waits until it
  is stopped and reads the clock again. The time of a call is the child's own CPU time (all its threads, user +
  system) over that window, measured by the parent: the child cannot touch the clock, the table or the result,
  cannot work between calls (it is stopped) and cannot hand work to another process (it may not create one).
  Everything it does from the moment it may run until it has delivered every byte of the result counts:
  decoding the inputs, the call, materialising and sending the result. Children are pinned to one CPU; a child
  whose affinity differs from its pin after a call (it may change its own without privilege) is an ``affinity`` error.

Frames (little endian): request ``K3IN`` + ``<II`` (number of buffers, number of dims) + ``<Q`` per buffer
(its byte length) + ``<q`` per dim + the buffers' bytes; reply ``K3OK`` + ``<QQ`` (result bytes, echoed input
bytes) + both, or ``K3ER`` + ``<I`` length + a UTF-8 message (``kind: why``); ready ``K3RD``.
"""

from __future__ import annotations

import array
import os
import select
import signal
import struct
import sys
import time

MAGIC_IN, MAGIC_OK, MAGIC_ERR, MAGIC_READY = b"K3IN", b"K3OK", b"K3ER", b"K3RD"


# --------------------------------------------------------------------------- the child (runs in the sandbox)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _error_frame(kind: str, why: str) -> bytes:
    msg = f"{kind}: {why}"[-3000:].encode("utf-8", "replace")
    return MAGIC_ERR + struct.pack("<I", len(msg)) + msg


def child_main(argv: list[str]) -> None:
    """Serve calls of ``MODULE.FUNC`` on buffers of typecode ``TC`` (the protocol in the module docstring)."""
    import importlib
    import mmap
    import resource
    import traceback

    tc, func, module, shm_fd = argv
    rfd, wfd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # a print() in the kernel goes to stderr, never into the reply pipe
    shm = memoryview(mmap.mmap(int(shm_fd), 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), func)
        if not callable(fn):
            raise TypeError(f"{module}.{func} is not callable")
    except BaseException:  # noqa: BLE001 - reported to the parent
        _write_all(wfd, _error_frame("import", traceback.format_exc()))
        return
    _write_all(wfd, MAGIC_READY)
    while True:
        try:
            head = _read_exact(rfd, 16)
        except EOFError:
            return
        if head[:4] != MAGIC_IN:
            _write_all(wfd, _error_frame("protocol", "bad request"))
            return
        n_sets, n_args, n_dims = struct.unpack("<III", head[4:])
        sizes = struct.unpack(f"<{n_args}Q", _read_exact(rfd, 8 * n_args))
        dims = list(struct.unpack(f"<{n_dims}q", _read_exact(rfd, 8 * n_dims)))
        one = sum(sizes)
        pos_out, lens = 2 * n_sets * one, []
        try:
            for k in range(n_sets):  # every set is a separate call on fresh buffers
                args, pos = [], k * one
                for n in sizes:
                    a = array.array(tc)
                    a.frombytes(shm[pos:pos + n])
                    args.append(a)
                    pos += n
                out = fn(*args, *dims)
                if type(out) is array.array and out.typecode == tc:
                    data = out
                elif type(out) is list:
                    data = array.array(tc, out)
                else:
                    kind = type(out).__name__ if type(out) is not array.array else f"array.array({out.typecode!r})"
                    raise TypeError(f"the result must be an array.array({tc!r}) or a list, got {kind}")
                pos = (n_sets + k) * one
                for a in args:  # the inputs as they are now, for the parent to compare
                    shm[pos:pos + len(a) * a.itemsize] = memoryview(a).cast("B")
                    pos += len(a) * a.itemsize
                n_out = len(data) * data.itemsize
                if pos_out + n_out > len(shm):
                    raise TypeError(f"the result must be an array.array({tc!r}) or a list of the output's length "
                                    f"(got {len(data)} values)")
                shm[pos_out:pos_out + n_out] = memoryview(data).cast("B")
                pos_out += n_out
                lens.append(n_out)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            if isinstance(exc, TypeError) and "result must be" in str(exc):
                _write_all(wfd, _error_frame("output", str(exc)))
            else:
                _write_all(wfd, _error_frame("runtime", traceback.format_exc()))
            return
        _write_all(wfd, MAGIC_OK + struct.pack(f"<{n_sets}Q", *lens))


# --------------------------------------------------------------------------- the parent (the verifier, on the host)


class ChildError(Exception):
    """A child failed: ``kind`` (``import``, ``runtime``, ``output``, ``timeout``, ``protocol``, ``died``) and why."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"{kind}: {why}")
        self.kind, self.why = kind, why


def _cpu_clock(pid: int) -> int:
    """The process CPU clock of ``pid`` (Linux ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``)."""
    return (~pid << 3) | 2


class KernelChild:
    """One child serving ``module.func`` in ``sandbox``; `call` returns its result, echo and CPU nanoseconds.

    ``capacity`` bytes of shared memory (a sealed memfd: its size cannot change, so the child cannot make the
    parent's mapping fault) carry the inputs, the echo and the result; the pipes carry small frames only.
    """

    def __init__(self, sandbox, tc: str, func: str, module: str, *, capacity: int, cpu: int | None = None,
                 start_timeout: float = 60.0) -> None:
        import fcntl
        import mmap

        with open(__file__, encoding="utf-8") as fh:
            source = fh.read()
        fd = os.memfd_create("k3kernel", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(fd, capacity)
            self.proc = sandbox.spawn(["python", "-I", "-B", "-c", source, tc, func, module, str(fd)], pass_fds=(fd,))
        finally:
            os.close(fd)
        self.shm = memoryview(self._map)
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        try:
            head = self._read(4, time.monotonic() + start_timeout)
            if head == MAGIC_ERR:
                raise self._error(time.monotonic() + 5.0)
            if head != MAGIC_READY:
                raise ChildError("protocol", f"the child answered {head!r} instead of ready")
            self.pid = self.proc.pid
            self._clock = _cpu_clock(self.pid)
            self._cpu = cpu
            if cpu is not None:
                os.sched_setaffinity(self.pid, {cpu})
            self._stop()
        except BaseException:
            self.close()
            raise

    # ---- low level

    def _read(self, n: int, deadline: float) -> bytes:
        parts, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                raise ChildError("timeout", "the child did not answer in time")
            chunk = os.read(self._out, min(n - got, 1 << 20))
            if not chunk:
                raise ChildError("died", "the child exited: " + self.proc.stderr_tail(1500))
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _error(self, deadline: float) -> ChildError:
        (n,) = struct.unpack("<I", self._read(4, deadline))
        msg = self._read(min(n, 1 << 16), deadline).decode("utf-8", "replace")
        kind, _, why = msg.partition(": ")
        return ChildError(kind, why)

    def _state(self) -> str:
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as fh:
                return fh.read().rsplit(b")", 1)[1].split()[0].decode()
        except (OSError, IndexError):
            return "X"

    def _stop(self) -> None:
        """SIGSTOP the child and wait until it is stopped (so its CPU clock no longer moves)."""
        try:
            os.kill(self.pid, signal.SIGSTOP)
        except ProcessLookupError:
            raise ChildError("died", "the child exited") from None
        deadline = time.monotonic() + 5.0
        while (state := self._state()) not in ("T", "t"):
            if state in ("X", "Z") or time.monotonic() > deadline:
                raise ChildError("died", f"the child did not stop (state {state})")
            time.sleep(0)

    def cpu_ns(self) -> int:
        """The child's CPU time so far (nanoseconds, all threads, user + system)."""
        try:
            return time.clock_gettime_ns(self._clock)
        except OSError:
            raise ChildError("died", "the child exited") from None

    # ---- one call

    def call(self, sets: list[list[bytes]], dims: list[int], *,
             timeout: float = 30.0) -> tuple[list[bytes], list[bytes], int]:
        """Run the function once per input set (raw buffers, the same sizes in every set) with ``dims``.

        The sets are put in place while the child is stopped; the child is continued, answers once for all of
        them and is stopped again. Returns every set's result bytes, every set's input bytes as the child left
        them, and the child's CPU nanoseconds from the moment it was continued until it was stopped again after
        its whole reply had arrived.
        """
        sizes = [len(a) for a in sets[0]]
        if any([len(a) for a in args] != sizes for args in sets):
            raise ValueError("every input set of one call has the same buffer sizes")
        one = sum(sizes)
        n_in = one * len(sets)
        if 2 * n_in > len(self.shm):
            raise ChildError("protocol", f"inputs of {n_in} bytes do not fit {len(self.shm)} bytes of shared memory")
        pos = 0
        for args in sets:
            for a in args:
                self.shm[pos:pos + len(a)] = a
                pos += len(a)
        # no need to clear the rest: a stale echo or result (another call's, on other inputs) fails the checks
        _write_all(self._in, MAGIC_IN + struct.pack("<III", len(sets), len(sizes), len(dims))
                   + struct.pack(f"<{len(sizes)}Q", *sizes) + struct.pack(f"<{len(dims)}q", *dims))
        deadline = time.monotonic() + timeout
        c0 = self.cpu_ns()
        os.kill(self.pid, signal.SIGCONT)
        try:
            head = self._read(4, deadline)
            if head == MAGIC_ERR:
                raise self._error(deadline)
            if head != MAGIC_OK:
                raise ChildError("protocol", f"the child answered {head!r}")
            lens = struct.unpack(f"<{len(sets)}Q", self._read(8 * len(sets), deadline))
        finally:
            if self.proc.popen.poll() is None:
                try:
                    self._stop()
                except ChildError:
                    pass
        c1 = self.cpu_ns()
        if self._cpu is not None and (cpus := os.sched_getaffinity(self.pid)) != {self._cpu}:
            # a child may widen or move its own affinity (no privilege needed): the CPU it is timed on is no longer
            # the one every role shares, so its times are not comparable; fail closed
            raise ChildError("affinity", f"the child changed its CPU affinity to {sorted(cpus)} (pinned to {self._cpu})")
        if select.select([self._out], [], [], 0)[0]:
            raise ChildError("protocol", "the child wrote more than one reply")
        if 2 * n_in + sum(lens) > len(self.shm):
            raise ChildError("protocol", f"results of {sum(lens)} bytes")
        outs, pos = [], 2 * n_in
        for n in lens:
            outs.append(bytes(self.shm[pos:pos + n]))
            pos += n
        echoes = [bytes(self.shm[n_in + k * one:n_in + (k + 1) * one]) for k in range(len(sets))]
        return outs, echoes, c1 - c0

    def close(self) -> None:
        """Kill the child (and its sandbox namespace) and unmap the shared memory."""
        if hasattr(self, "proc"):
            self.proc.kill()
        if hasattr(self, "shm"):
            self.shm.release()
        if hasattr(self, "_map"):
            self._map.close()


if __name__ == "__main__":
    child_main(sys.argv[1:])
