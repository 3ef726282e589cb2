"""`qgemm serve`'s processes: HTTP fronts and an engine per device, started, watched and restarted here.

The fronts (uvicorn with uvloop and httptools, `QGEMM_FRONTS` of them, by default half the cores, up to 16 per engine)
each listen on the port (SO_REUSEPORT: the kernel spreads connections over them); each parses and checks requests,
writes X into its shared-memory arena and asks an engine over a Unix socket.  An engine process owns one device
(each GPU of QGEMM_DEVICES, or each of QGEMM_CPU_DEVICES; QGEMM_ENGINES=one: one engine for all of them), the
weights it holds (one copy whatever the number of fronts) and its batching: one Python process drives one GPU, so
a second GPU adds a second process's CPU.  This process only supervises; every child dies with it (the kernel's
parent-death signal), so a `kill -9` of it leaves nothing serving on the port:

- a front that dies is replaced within a poll (0.1 s) and its shared memory removed; only its in-flight requests
  were lost where the host migrates a closing listener's queue (net.ipv4.tcp_migrate_req = 1: `docker run --sysctl
  net.ipv4.tcp_migrate_req=1`); elsewhere the connections the kernel had just queued on its socket go too (the
  start says which);
- an engine that dies fails the requests waiting on it at once (503, Retry-After: the fronts see its socket close)
  and is started again; /healthz says `degraded` until it answers (weights are uploaded again on first use);
- SIGTERM or SIGINT: the fronts stop taking connections and finish the requests they hold, then the engine stops;
  the shared memory, sockets and metrics files go with them, and the exit status is 0.  A start first removes
  what a `kill -9` of everything left behind.

The processes' state is kept in `state.json` in the run directory, which the fronts read for /healthz.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.serving import arenas, contract
from app.settings import Settings

log = logging.getLogger("qgemm")
POLL_S = 0.1
PING_S = 1.0  # how often the supervisor pings each engine
UNRESPONSIVE_S = 2.0  # a ping unanswered this long: the engine is reported unresponsive (/healthz degraded)
STOP_GRACE_S = 30.0  # how long fronts may take to finish their requests on SIGTERM
SPAWN = multiprocessing.get_context("spawn")


FRONTS_PER_ENGINE = 16


def default_fronts(engines: int = 1) -> int:
    """Half the cores, at most FRONTS_PER_ENGINE per engine process: on a 32-core host with H200s, once an engine
    answered a read's requests for a tensor together (~30 µs of its CPU per request), 16 fronts served one GPU at
    256 clients at 33,900 req/s, p99 13 ms, against 28,600 req/s, p99 52 ms with 8 (docs/serving.md)."""
    return max(1, min(FRONTS_PER_ENGINE * max(engines, 1), (os.cpu_count() or 2) // 2))


def gpu_ordinals(settings: Settings) -> list[int]:
    """The GPUs this server serves on (QGEMM_DEVICES of those CuPy sees), or none where the CPU serves."""
    if settings.backend == "cpu":
        return []
    try:
        from kernels.cuda.backend import cuda_device_count
        from kernels.devices import parse_devices
    except ImportError:  # no CuPy: the CPU serves
        return []
    count = cuda_device_count()
    return parse_devices(settings.devices, count) if count else []


def engine_envs(settings: Settings) -> list[dict[str, str]]:
    """Each engine process's own settings: QGEMM_ENGINES_PER_GPU per GPU of QGEMM_DEVICES where CUDA serves (the
    fronts send each product to the engine with the fewest in flight), else one per CPU device; a single engine for
    all of them with QGEMM_ENGINES=one."""
    if settings.engines == "one":
        return [{}]
    gpus = gpu_ordinals(settings)
    if gpus:
        return [{"QGEMM_DEVICES": str(d)} for d in gpus for _ in range(settings.engines_per_gpu)]
    return [{"QGEMM_CPU_DEVICES": "1", "QGEMM_CPU_DEVICE_FIRST": str(i)} for i in range(settings.cpu_devices)]


def port_lock(port: int) -> socket.socket | None:
    """An abstract Unix socket named for the port, held while this server runs (None: another holds it).  A second
    `qgemm serve` on the port finds it taken; the kernel lets go of it when the holder dies, so nothing stale stays."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(f"\0qgemm-serve-{port}")
    except OSError:
        lock.close()
        return None
    return lock


def run_base() -> Path:
    """Where run directories go: $XDG_RUNTIME_DIR where it is this user's own, else the temporary directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        try:
            st = os.lstat(runtime)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
                return Path(runtime)
        except OSError:
            pass
    return Path(tempfile.gettempdir())


def run_dir_prefix(port: int) -> str:
    return f"qgemm-{os.getuid()}-{port}-"


def private_run_dir(port: int) -> Path:
    """A new run directory only this user can enter (mkdtemp: mode 0700, a random name nobody can create first).
    What an earlier start on this port left (a kill -9) is removed first: this user's own directories only, no link
    followed."""
    base = run_base()
    for old in base.glob(run_dir_prefix(port) + "*"):
        try:
            st = os.lstat(old)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(old, ignore_errors=True)
    run_dir = Path(tempfile.mkdtemp(prefix=run_dir_prefix(port), dir=base))
    (run_dir / "metrics").mkdir(mode=0o700)
    return run_dir


class Watch:
    """The supervisor's ping of one engine over its socket: a Ping every PING_S, its Reply read without blocking.  An
    engine whose loop does not turn (a hang, SIGSTOP, a product stuck in a driver call) answers nothing."""

    def __init__(self, path: str):
        self.path = path
        self.sock: socket.socket | None = None
        self.sent: float | None = None  # when the unanswered ping left
        self.last_sent = 0.0
        self.buf = b""

    def overdue(self, now: float) -> float:
        """Seconds the engine has left a ping unanswered (0: none outstanding)."""
        return 0.0 if self.sent is None else now - self.sent

    def turn(self, now: float) -> None:
        try:
            if self.sock is None:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.settimeout(0.2)
                self.sock.connect(self.path)
                self.sock.setblocking(False)
            if self.sent is not None:
                try:
                    data = self.sock.recv(1 << 16)
                except BlockingIOError:
                    data = None
                if data == b"":
                    raise ConnectionError("the engine closed the watch")
                if data:
                    self.buf += data
                    if len(self.buf) >= 4 and len(self.buf) >= 4 + int.from_bytes(self.buf[:4], "little"):
                        self.buf, self.sent = b"", None  # answered (the one ping outstanding)
            if self.sent is None and now - self.last_sent >= PING_S:
                body = contract.encode([contract.Ping(1)])
                self.sock.send(len(body).to_bytes(4, "little") + body)
                self.sent = self.last_sent = now
        except OSError:  # not up yet, or gone: the process watch handles that
            self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.sent, self.buf = None, None, b""


@dataclass
class Child:
    role: str  # "front" or "engine"
    index: int
    process: Any = None
    state: str = "starting"
    started: float = 0.0
    restarts: int = 0
    pids: list[int] = field(default_factory=list)
    watch: Watch | None = None  # an engine's ping

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


MIN_ARENA_BYTES = 1 << 20  # the smallest QGEMM_FRONT_ARENA_BYTES: still tens of M = 1 requests at a time


def arena_bytes_for(want: int, fronts: int, free: int) -> int:
    """Each front's arena: QGEMM_FRONT_ARENA_BYTES, or less where /dev/shm is small (a container's --shm-size,
    64 MiB by default in Docker): the arenas take at most half of what is free, the rest left to requests too
    large for them.  ValueError where even MIN_ARENA_BYTES a front does not fit."""
    fit = (free // 2 // max(fronts, 1)) >> 20 << 20
    if want <= fit:
        return want
    if fit < MIN_ARENA_BYTES:
        raise ValueError(f"/dev/shm has {free >> 20} MiB free, too little for {fronts} front(s) of at least "
                         f"{MIN_ARENA_BYTES >> 20} MiB each: give the container more (docker run --shm-size=1g) or "
                         "run fewer fronts (QGEMM_FRONTS)")
    return fit


def listen(host: str, port: int, shared: bool = True) -> socket.socket:
    """A listening socket on the port.  `shared` (SO_REUSEPORT): each of several fronts has its own, the kernel
    spreads new connections over them, and a front that dies takes only its own connections with it.  Else the one
    socket the supervisor holds for a lone front: its backlog outlives the front, so that while a dead front is
    started again new connections wait in the queue instead of being refused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


MIGRATE_REQ = Path("/proc/sys/net/ipv4/tcp_migrate_req")


def queued_connections_migrate() -> bool:
    """Whether the kernel moves the connections queued on a closing SO_REUSEPORT listener to the others of its group
    (Linux 5.14+, net.ipv4.tcp_migrate_req = 1, per network namespace), so that a front that dies loses only its
    in-flight requests.  One listening socket shared by every front would give that anywhere, but uvloop's accept
    loop then takes a burst of connections on one front (64 connections over 8 fronts: 42 on one, against 11 at
    most with SO_REUSEPORT), and the fronts are the service's bound."""
    try:
        return MIGRATE_REQ.read_text().strip() == "1"
    except OSError:
        return False


FrontMain = Callable[[dict[str, str], int, str, str, list[str], socket.socket | None], None]


class Supervisor:
    def __init__(self, settings: Settings, fronts: int, front_main: FrontMain | None = None):
        """`front_main(env, index, run_dir, instance, engine_sockets, listener)`: a front process's main
        (app/front_main.py: the HTTP app, which stands on this package, is handed in rather than imported)."""
        self.settings = settings
        self.front_main = front_main
        self.instance = str(settings.port)
        self.run_dir = Path()  # made by `run`, once the port is ours
        self.engine_envs = engine_envs(settings)
        self.engine_sockets: list[str] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("QGEMM_")} | settings.as_env()
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.children = [Child("engine", i) for i in range(len(self.engine_envs))] + \
            [Child("front", i) for i in range(fronts)]
        self.stopping = False
        self.listener: socket.socket | None = None  # a lone front's listening socket, held here across its restarts
        self.lock: socket.socket | None = None  # the port's, held from `run` to the process's end

    # -- leftovers and state -----------------------------------------------------------------------
    def clean_leftovers(self) -> None:
        removed = arenas.clean(self.instance)  # segments of processes that are gone (a kill -9 of everything)
        if removed:
            log.info("removed %d shared-memory segment(s) a killed qgemm left behind", len(removed))
        self.run_dir = private_run_dir(self.settings.port)
        self.engine_sockets = [str(self.run_dir / f"engine-{i}.sock") for i in range(len(self.engine_envs))]

    def write_state(self) -> None:
        """state.json for the fronts' /healthz; a run directory that vanished (a /tmp cleaner) is made again."""
        state = json.dumps({"pid": os.getpid(), "processes": [{"role": c.role, "index": c.index, "pid": c.pid,
                                                                "state": c.state} for c in self.children]})
        for attempt in (0, 1):
            try:
                fd = os.open(self.run_dir / ".state.json.part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                             0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(state)
                os.replace(self.run_dir / ".state.json.part", self.run_dir / "state.json")
                return
            except FileNotFoundError:
                if attempt:
                    raise
                log.warning("the run directory %s vanished: made again", self.run_dir)
                (self.run_dir / "metrics").mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(self.run_dir, 0o700)

    # -- processes ---------------------------------------------------------------------------------
    def start(self, child: Child) -> None:
        if child.role == "engine":
            from app.serving import engine

            process = SPAWN.Process(target=engine.run, args=(self.env | self.engine_envs[child.index],
                                                             self.engine_sockets[child.index]),
                                    name=f"qgemm-engine-{child.index}", daemon=False)
        else:
            process = SPAWN.Process(target=self.front_main, name=f"qgemm-front-{child.index}", daemon=False,
                                    args=(self.env, child.index, str(self.run_dir), self.instance,
                                          self.engine_sockets, self.listener))
        process.start()
        child.process, child.started = process, time.monotonic()
        child.state = "starting" if child.restarts == 0 else "restarting"
        child.pids.append(process.pid)

    def check(self) -> bool:
        """Replace the children that died; mark those that are up; True if the state changed."""
        changed = False
        for child in self.children:
            process = child.process
            if process is not None and not process.is_alive():
                log.warning("%s %d (pid %d) exited with %s; starting it again", child.role, child.index, process.pid,
                            process.exitcode)
                self.after_death(child)
                if child.watch is not None:
                    child.watch.close()
                    child.watch = None
                child.restarts += 1
                child.state = "restarting"
                changed = True
                if time.monotonic() - child.started < 1.0:  # dying at once: do not spin
                    time.sleep(min(5.0, 0.2 * child.restarts))
                self.start(child)
            elif child.state in ("starting", "restarting") and self.is_up(child):
                child.state = "ok"
                changed = True
                log.info("%s %d ready (pid %d)", child.role, child.index, child.pid)
            elif child.role == "engine" and child.state in ("ok", "unresponsive"):
                changed |= self.watch(child)
            if child.role == "engine" and child.state == "ok" and not os.path.exists(
                    self.engine_sockets[child.index]):  # its socket went with the run directory: no front reaches it
                log.warning("engine %d's socket is gone: starting it again", child.index)
                process.terminate()
                child.state = "restarting"
                changed = True
        return changed

    def watch(self, child: Child) -> bool:
        """Ping an engine that is up: unresponsive past UNRESPONSIVE_S, killed (and so started again, its waiting
        requests answered 503 at once) past QGEMM_ENGINE_DEADLINE_S.  True if its state changed."""
        if child.watch is None:
            child.watch = Watch(self.engine_sockets[child.index])
        now = time.monotonic()
        child.watch.turn(now)
        late = child.watch.overdue(now)
        if late > self.settings.engine_deadline_s:
            log.error("engine %d (pid %d) has not answered for %.0f s (QGEMM_ENGINE_DEADLINE_S): killing it",
                      child.index, child.pid, late)
            child.process.kill()
            child.watch.close()
            child.state = "restarting"
            return True
        state = "unresponsive" if late > UNRESPONSIVE_S else "ok"
        if state != child.state:
            log.warning("engine %d is %s", child.index, state if state == "ok" else f"unresponsive ({late:.0f} s)")
            child.state = state
            return True
        return False

    def is_up(self, child: Child) -> bool:
        if child.role == "engine":
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(0.2)
                    s.connect(self.engine_sockets[child.index])
                return True
            except OSError:
                return False
        return child.process.is_alive() and os.path.exists(self.run_dir / f"front-{child.pid}.ready")

    def after_death(self, child: Child) -> None:
        if child.role == "front":
            arenas.clean(self.instance, child.pid)
            try:
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(child.pid, str(self.run_dir / "metrics"))
            except Exception:  # its gauges only: counters stay summed
                pass

    # -- the whole -----------------------------------------------------------------------------------
    def run(self) -> int:
        self.lock = port_lock(self.settings.port)
        if self.lock is None:
            log.error("port %d is served by another qgemm serve already: stop it first, or choose another --port",
                      self.settings.port)
            return 2
        fronts = len(self.children) - len(self.engine_envs)
        try:  # the port is ours to share (a process listening there without SO_REUSEPORT refuses this)
            if fronts == 1:  # a lone front: the socket is held here, and passed to it at each of its starts
                self.listener = listen(self.settings.host, self.settings.port, shared=False)
            else:
                listen(self.settings.host, self.settings.port).close()
        except OSError as exc:
            log.error("cannot listen on %s:%d: %s", self.settings.host, self.settings.port, exc)
            return 2
        self.clean_leftovers()
        free = arenas.shm_free()
        try:
            arena = arena_bytes_for(self.settings.front_arena_bytes, fronts, free)
        except ValueError as exc:
            log.error("%s", exc)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return 2
        if arena != self.settings.front_arena_bytes:
            log.warning("/dev/shm has %d MiB free: each front's arena is %d MiB instead of QGEMM_FRONT_ARENA_BYTES' "
                        "%d MiB (larger requests get segments of their own while there is room; docker run "
                        "--shm-size=1g gives room)", free >> 20, arena >> 20,
                        self.settings.front_arena_bytes >> 20)
            self.env["QGEMM_FRONT_ARENA_BYTES"] = str(arena)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        from app.announce import announce_urls, announce_version

        announce_version()
        log.info("%d HTTP front process(es) and %d engine process(es) (this one supervises them)",
                 len(self.children) - len(self.engine_envs), len(self.engine_envs))
        if fronts > 1 and not queued_connections_migrate():
            log.info("net.ipv4.tcp_migrate_req is not 1 here: a front that dies also resets the connections queued "
                     "on its socket, not only its in-flight requests (docker run --sysctl net.ipv4.tcp_migrate_req=1)")
        for child in self.children:
            self.start(child)
        announce_urls(self.settings)
        self.write_state()
        while not self.stopping:
            try:
                if self.check() or not os.path.exists(self.run_dir / "state.json"):  # (a /tmp cleaner took it)
                    self.write_state()
            except Exception:  # the watch goes on whatever one turn of it met
                log.exception("supervisor: a turn of the watch failed")
            time.sleep(POLL_S)
        return self.shutdown()

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def shutdown(self) -> int:
        """0 once everything stopped by itself; 1 where a process had to be killed."""
        forced = False
        log.info("stopping: the fronts finish their requests, then the engine stops")
        for c in self.children:  # a hung engine would hold the fronts' requests to their grace's end: killed first
            late = c.watch.overdue(time.monotonic()) if c.watch is not None else 0.0
            if c.role == "engine" and late > UNRESPONSIVE_S and c.process.is_alive():
                log.error("engine %d does not answer: killing it (its requests are answered 503)", c.index)
                c.process.kill()
                forced = True
        fronts = [c for c in self.children if c.role == "front"]
        for child in self.children:
            child.state = "stopping"
        self.write_state()
        for c in fronts:
            if c.process.is_alive():
                c.process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for c in fronts:
            c.process.join(max(0.1, deadline - time.monotonic()))
            if c.process.is_alive():
                c.process.kill()
                forced = True
                c.process.join()
        for c in self.children:
            if c.role == "engine" and c.process.is_alive():
                c.process.terminate()
                c.process.join(10)
                if c.process.is_alive():
                    c.process.kill()
                    forced = True
                    c.process.join()
        for c in self.children:
            for pid in c.pids:
                arenas.clean(self.instance, pid)
        if self.listener is not None:
            self.listener.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("stopped")
        if forced:
            log.warning("stopped, after killing what did not stop in time")
        return 1 if forced else 0


def serve(settings: Settings, front_main: FrontMain) -> int:
    fronts = settings.fronts if settings.fronts is not None else default_fronts(len(engine_envs(settings)))
    return Supervisor(settings, fronts, front_main).run()
