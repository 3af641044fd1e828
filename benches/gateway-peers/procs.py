"""Child processes of the benchmark, and the CPU they use.

Each child runs in its own process group (so a launcher and the server it starts are
stopped and measured together), with stdout and stderr appended to
``<out>/logs/<name>.log`` by a reader thread. Readiness is a line of that output
(matched as it is read: nothing polls), with a deadline; a child that exits first is
reported with the last lines of its log. ``Stack`` stops its children in reverse
order (SIGTERM to the group, SIGKILL after a grace period), also on error and Ctrl-C.

CPU: ``group_cpu_seconds`` sums utime + stime of every live process in a group, from
``/proc/<pid>/stat`` (plus the reaped children's cutime + cstime), so the difference
of two readings is the CPU the group spent between them.
"""

from __future__ import annotations

import collections
import ctypes
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

STOP_GRACE_S = 10.0
"""Seconds a child group has to exit after SIGTERM before it is killed."""

TAIL_LINES = 30
"""Log lines quoted when a child fails."""

CLK_TCK = os.sysconf("SC_CLK_TCK")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` of every child: SIGTERM it when the benchmark dies, even by
    SIGKILL (Linux's PR_SET_PDEATHSIG), so no child outlives the run."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Placement:
    """Which CPUs the request path runs on, apart from the load around it.

    ``serving`` (gateways, routers, nats-server) get ``serving_cpus``; every other
    child (engines, relays, etcd, the client) inherits the benchmark's own affinity,
    which ``pin_self`` sets to the remaining CPUs. So the engines' and the client's
    work takes no CPU from the request path, as on a host where the engines run
    elsewhere, for every gateway alike."""

    def __init__(self, serving_cpus: set[int]):
        allowed = os.sched_getaffinity(0)
        if not serving_cpus < allowed:
            raise ValueError(f"serving CPUs {sorted(serving_cpus)} must be a proper "
                             f"subset of the CPUs allowed here, {sorted(allowed)}")
        self.serving_cpus = serving_cpus
        self.load_cpus = allowed - serving_cpus

    def pin_self(self) -> None:
        """The benchmark (and every child it starts unpinned) on the load CPUs."""
        os.sched_setaffinity(0, self.load_cpus)

    def describe(self) -> str:
        return (f"request path on CPUs {sorted(self.serving_cpus)}, engines and client "
                f"on {sorted(self.load_cpus)}")


class ChildError(RuntimeError):
    """A child exited early or was not ready in time."""


class Child:
    """One started process group with its log and readiness."""

    def __init__(self, name: str, argv: list[str], log: Path, ready: str | None,
                 ready_count: int = 1, env: dict[str, str] | None = None,
                 cpus: set[int] | None = None):
        self.name = name
        self.argv = argv
        self.log_path = log
        self._ready_re = re.compile(ready) if ready else None
        self._ready_left = ready_count
        self._cond = threading.Condition()
        self._ready = ready is None
        self._eof = False
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._log = open(log, "ab")
        self._log.write(f"$ {' '.join(argv)}\n".encode())
        self._log.flush()

        def preexec() -> None:
            die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, env=env,
            preexec_fn=preexec)
        self.pgid = self.proc.pid
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._log.write(raw)
            self._log.flush()
            line = raw.decode("utf-8", "replace").rstrip()
            with self._cond:
                self._tail.append(line)
                if not self._ready and self._ready_re and self._ready_re.search(line):
                    self._ready_left -= 1
                    if self._ready_left <= 0:
                        self._ready = True
                        self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_ready(self, timeout_s: float) -> None:
        """Returns once the ready line was logged (``ready_count`` times).

        Raises ``ChildError`` if the child exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._ready and not self._eof:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChildError(f"{self.name} not ready within {timeout_s:.0f} s"
                                     f"{self._quote()}")
                self._cond.wait(left)
            if not self._ready:
                raise ChildError(f"{self.name} exited before it was ready{self._quote()}")

    def _quote(self) -> str:
        lines = "\n    ".join(self._tail)
        return f"; see {self.log_path}; last lines:\n    {lines}"

    def running(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) used so far by the child's process group."""
        return group_cpu_seconds(self.pgid)

    def peak_rss_bytes(self) -> int:
        """Largest peak RSS (VmHWM) of the group's live processes, in bytes."""
        return max((_status_kib(pid, "VmHWM") * 1024 for pid in _group_pids(self.pgid)),
                   default=0)

    def stop(self) -> None:
        """Stops the group (``stop_group``) and closes the log."""
        stop_group(self.proc)
        self._reader.join(STOP_GRACE_S)
        self._log.close()


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group led by ``proc``, SIGKILL to whatever is left of
    it after ``STOP_GRACE_S`` (a launcher may leave its server behind); reaps ``proc``."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is index 0)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime (+ cutime + cstime) of the live processes of group ``pgid``, s."""
    ticks = 0
    for pid in _group_pids(pgid):
        fields = _stat_fields(pid)
        if fields:
            # After the name: utime, stime, cutime, cstime are fields 11..14.
            ticks += sum(int(f) for f in fields[11:15])
    return ticks / CLK_TCK


class Stack:
    """The children started so far, stopped in reverse order by ``stop_all``."""

    def __init__(self, logs: Path, placement: Placement | None = None):
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self._children: list[Child] = []
        self._placement = placement

    def spawn(self, name: str, argv: list[str], ready: str | None = None,
              ready_timeout_s: float = 60.0, ready_count: int = 1,
              wait: bool = True, serving: bool = False) -> Child:
        """Starts ``argv`` as ``name`` and, given a ready pattern, waits until it was
        logged ``ready_count`` times (unless ``wait`` is false: then the caller calls
        ``Child.wait_ready``, e.g. to start slow servers side by side). A ``serving``
        child (on the request path) runs on the placement's serving CPUs, if any."""
        cpus = self._placement.serving_cpus if serving and self._placement else None
        child = Child(name, argv, self.logs / f"{name}.log", ready, ready_count,
                      cpus=cpus)
        self._children.append(child)
        if ready and wait:
            child.wait_ready(ready_timeout_s)
        return child

    def stop(self, child: Child) -> None:
        child.stop()
        self._children.remove(child)

    def stop_all(self) -> None:
        while self._children:
            self._children.pop().stop()

    def check_alive(self) -> None:
        """Raises ``ChildError`` naming the first child that has exited."""
        for child in self._children:
            if not child.running():
                raise ChildError(f"{child.name} exited (code {child.proc.returncode})"
                                 f"{child._quote()}")


def _probe_socket() -> socket.socket:
    """A socket bound as the servers bind theirs: with SO_REUSEADDR (tokio's and Go's
    listeners set it), so a port whose old connections linger in TIME_WAIT after a
    busy pass still counts as free."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with _probe_socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(n: int, attempts: int = 100) -> int:
    """The first of ``n`` consecutive loopback ports that were free together.

    Blocks are taken below the kernel's ephemeral range, which a busy pass fills with
    client ports in TIME_WAIT (and which outgoing connections draw from)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    floor = 10000
    for _ in range(attempts):
        first = random.randrange(floor, max(floor + 1, low - n))
        held = []
        try:
            for port in range(first, first + n):
                s = _probe_socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise ChildError(f"no block of {n} free loopback ports")
