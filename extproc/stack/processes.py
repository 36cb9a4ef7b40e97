"""Child processes that die with their parent and stop in order.

``prefix-router up`` and the integration tests start Envoy, routers and simulators the
same way, through this module, so the tests exercise what users run. Its ``wait_until``
(and ``wait_until_async``) is the one way they, the benchmarks and the tests wait for a
condition instead of sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

from extproc.errors import RouterError
from extproc.stack import http_client


class StackError(RouterError):
    """A process of the local stack failed to start or to become ready."""


T = TypeVar("T")


def _dying_with_parent(argv: list[str]) -> list[str]:
    """Wrap ``argv`` so the kernel kills it if its parent dies, and a crashed
    `prefix-router up` leaves nothing behind. util-linux's setpriv does the prctl in the
    child; a preexec_fn would run Python between fork and exec, which is unsafe in a
    process with threads (gRPC's) and was seen to crash the child."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "SIGKILL", "--", *argv] if setpriv else argv


class ManagedProcess:
    def __init__(
        self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        log = self.log_path.open("ab")
        try:
            self.popen = subprocess.Popen(
                _dying_with_parent(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                # Own process group: a terminal's Ctrl-C reaches only the supervisor,
                # which then stops the children in order.
                start_new_session=True,
            )
        finally:
            log.close()
        return self

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit code.

        Whatever the process started in its own session (vLLM's engine and resource
        tracker, say) is killed with it, so nothing outlives a stop.
        """
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._kill_session()
        return self.popen.returncode

    def _kill_session(self) -> None:
        # start_new_session made the child a process-group leader: the group's id is its pid.
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)
        if self.popen is not None:
            self._kill_session()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# How often wait_until polls: a condition's time is known to within this much.
POLL_INTERVAL_S = 0.05
# The errors wait_until counts as "not yet" by default: a server still starting refuses
# connections (OSError), and the stack's HTTP reads raise httpx.HTTPError for that, for a
# server that answers but not yet with 2xx, or one not yet speaking HTTP.
NOT_YET: tuple[type[BaseException], ...] = (OSError, httpx.HTTPError)


class WaitTimeout(StackError, AssertionError):
    """A condition ``wait_until`` polled did not hold in time. A StackError to the
    runtime (`prefix-router up` reports it), an AssertionError to a test (a failed
    expectation)."""


class _Wait:
    """What one wait has seen: its deadline, the last falsy value, the last ignored error.

    The error is kept as text: the exception would hold its traceback, and with it the
    polling frame (a cycle) and whatever the predicate had open (an HTTP error's socket)."""

    def __init__(self, timeout_s: float, what: str, process: ManagedProcess | None) -> None:
        self.timeout_s = timeout_s
        self.what = what
        self.process = process
        self.deadline = time.monotonic() + timeout_s
        self.last: object = None
        self.error: str | None = None

    def check_process(self) -> None:
        """StackError at once when the process the condition depends on has exited."""
        process = self.process
        if process is not None and process.popen is not None and not process.running:
            raise StackError(
                f"{process.name} exited with {process.popen.returncode} while waiting for "
                f"{self.what}:\n{process.log_tail()}"
            )

    def failed(self, caught: BaseException) -> None:
        """The predicate raised an error it may raise while the condition is not yet true."""
        self.error = f"{type(caught).__name__}: {caught}"

    def missed(self, value: object) -> None:
        """The predicate answered, falsy."""
        self.last, self.error = value, None

    def raise_if_expired(self) -> None:
        if time.monotonic() >= self.deadline:
            raise self.timed_out()

    def timed_out(self) -> WaitTimeout:
        message = (
            f"timed out after {self.timeout_s:g} s waiting for {self.what} "
            f"(last value: {self.last!r})"
        )
        if self.error is not None:
            message += f"; last error: {self.error}"
        if self.process is not None:
            message += f":\n{self.process.log_tail()}"
        return WaitTimeout(message)


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str = "the condition",
    process: ManagedProcess | None = None,
    *,
    interval_s: float = POLL_INTERVAL_S,
    ignoring: tuple[type[BaseException], ...] = NOT_YET,
) -> T:
    """Poll ``predicate`` every ``interval_s`` until it returns a truthy value, and return
    that value: the one way the stack, the benchmarks and the tests wait for something
    instead of sleeping a fixed time.

    Errors of the types in ``ignoring`` count as "not yet" (by default ``NOT_YET``, OSError
    and httpx.HTTPError: a server still starting); any other propagates. After
    ``timeout_s``, WaitTimeout naming ``what``, the last value and the last ignored error.
    With ``process``, a StackError with its log's tail as soon as it exits, and its tail
    in a timeout's message too."""
    wait = _Wait(timeout_s, what, process)
    while True:
        wait.check_process()
        try:
            value = predicate()
        except ignoring as caught:
            wait.failed(caught)
        else:
            if value:
                return value
            wait.missed(value)
        wait.raise_if_expired()
        time.sleep(interval_s)


async def wait_until_async(
    predicate: Callable[[], T] | Callable[[], Awaitable[T]],
    timeout_s: float,
    what: str = "the condition",
    process: ManagedProcess | None = None,
    *,
    interval_s: float = POLL_INTERVAL_S,
    ignoring: tuple[type[BaseException], ...] = NOT_YET,
) -> T:
    """``wait_until`` for a caller on an event loop: it sleeps with ``asyncio.sleep``, so
    the loop's tasks run between polls, and awaits ``predicate``'s result when that is
    awaitable (a coroutine function's)."""
    wait = _Wait(timeout_s, what, process)
    while True:
        wait.check_process()
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
        except ignoring as caught:
            wait.failed(caught)
        else:
            if value:
                return value
            wait.missed(value)
        wait.raise_if_expired()
        await asyncio.sleep(interval_s)


def tcp_open(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=0.5):
        return True


def http_ok(url: str) -> bool:
    """True when ``url`` answers 2xx within 1 s; raises ``httpx.HTTPError`` otherwise (to
    ``wait_until``, "not yet")."""
    return http_client.get(url, timeout_s=1).is_success


# Ports we choose lie below the kernel's ephemeral range. A client polling a port in
# that range before its server binds can be handed the same port as its own source and
# connect to itself (TCP simultaneous open): it then reads its own request back, and
# the server cannot bind. Ports below the range are never a client's source.
_LOWEST_PORT = 15000
# Should the kernel's range start low, still choose among this many ports.
_MIN_SPAN = 1000


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


# Ports this process has handed out. A port is free when checked and bound only later by
# the process it is given to, so a second request in between could be handed the same
# one (a benchmark asks several times before it starts anything); never hand one out twice.
_HANDED_OUT: set[int] = set()


def _remember(ports: Iterable[int]) -> None:
    if len(_HANDED_OUT) > 4 * _MIN_SPAN:  # a long session: forget the oldest generation
        _HANDED_OUT.clear()
    _HANDED_OUT.update(ports)


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host``, below the ephemeral range; all are held
    open together while checked, so none repeats."""
    return free_ports_on(count, (host,))


def free_ports_on(count: int, hosts: Sequence[str], attempts: int = 400) -> list[int]:
    """``count`` distinct ports each free on every one of ``hosts``."""
    rng = random.Random()
    top = max(_LOWEST_PORT + _MIN_SPAN, _ephemeral_low())
    chosen: list[int] = []
    with contextlib.ExitStack() as held:
        for _ in range(attempts):
            if len(chosen) == count:
                return chosen
            port = rng.randrange(_LOWEST_PORT, top)
            if port in chosen or port in _HANDED_OUT:
                continue
            try:
                for host in hosts:
                    sock = held.enter_context(socket.socket())
                    sock.bind((host, port))
            except OSError:
                continue
            chosen.append(port)
            if len(chosen) == count:
                _remember(chosen)
                return chosen
    raise OSError(f"no {count} free ports on {', '.join(hosts)} after {attempts} tries")


def port_is_free(host: str, port: int) -> bool:
    """Whether ``port`` on ``host`` can be bound now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port_run(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """The first of ``count`` consecutive free ports below the ephemeral range
    (``router --workers`` listens on a run); all are held open together while checked."""
    rng = random.Random()
    top = max(_LOWEST_PORT + _MIN_SPAN, _ephemeral_low())
    for _ in range(attempts):
        base = rng.randrange(_LOWEST_PORT, top - count)
        if _HANDED_OUT.intersection(range(base, base + count)):
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind((host, port))
            _remember(range(base, base + count))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise OSError(f"no run of {count} free ports on {host} after {attempts} tries")
