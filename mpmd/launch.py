"""How `mpmd-actor` daemons are started: here, as local subprocesses. (A mesh only drives daemons; it does
not care who started them: see `RemoteMesh.connect`.)

    procs, addresses, tmpdir = start_local(2, LocalOptions(devices_per_actor=1))
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from mpmd.errors import ActorStartError


@dataclass(frozen=True)
class LocalOptions:
    """How to start local actor daemons.

    `devices_per_actor`: CPU devices (or GPUs with platform="gpu": actor i gets GPUs i*d .. i*d+d-1).
    `cpus_per_actor`: pin actor i to its own `k` cores (cores i*k .. i*k+k-1 of those this process may use)
    and size XLA's CPU thread pool to them; None leaves scheduling to the OS.
    `cache_dir`: JAX's persistent compilation cache for the actors (a restarted job skips XLA compilation):
    True (default) is `default_cache_dir()`, False turns it off, a string is that directory.
    """

    devices_per_actor: int = 1
    platform: str = "cpu"
    p2p: bool = True
    cache_dir: str | bool = True
    address: str = "ipc"  # "ipc" (Unix sockets) or "tcp" (loopback)
    log_level: str = "WARNING"
    cpus_per_actor: int | None = None
    startup_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.devices_per_actor < 1:
            raise ValueError(f"devices_per_actor must be >= 1, got {self.devices_per_actor}")
        if self.platform not in ("cpu", "gpu"):
            raise ValueError(f"platform must be 'cpu' or 'gpu', got {self.platform!r}")
        if self.address not in ("ipc", "tcp"):
            raise ValueError(f"address must be 'ipc' or 'tcp', got {self.address!r}")
        if self.cpus_per_actor is not None and self.cpus_per_actor < 1:
            raise ValueError(f"cpus_per_actor must be >= 1 (or None), got {self.cpus_per_actor}")


def default_cache_dir() -> str:
    """$MPMD_CACHE_DIR, else $XDG_CACHE_HOME/mpmd/xla, else ~/.cache/mpmd/xla."""
    if os.environ.get("MPMD_CACHE_DIR"):
        return os.environ["MPMD_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mpmd", "xla")


def cpu_sets(num_actors: int, cpus_per_actor: int) -> list[list[int]]:
    """Disjoint core sets, one per actor, from the cores this process may run on."""
    cores = sorted(os.sched_getaffinity(0))
    need = num_actors * cpus_per_actor
    if need > len(cores):
        raise ValueError(f"cpus_per_actor={cpus_per_actor} for {num_actors} actors needs {need} cores, but this process may "
                         f"use only {len(cores)} ({cores}); use fewer actors or cores per actor")
    return [cores[i * cpus_per_actor : (i + 1) * cpus_per_actor] for i in range(num_actors)]


class LocalProcess:
    """An `mpmd-actor` subprocess on this machine, with its stderr kept in a file for error messages."""

    def __init__(self, actor_id: int, address: str, options: LocalOptions, ipc_dir: str | None = None,
                 cpus: list[int] | None = None) -> None:
        self.actor_id = actor_id
        self.stderr = tempfile.NamedTemporaryFile(prefix=f"mpmd-actor{actor_id}-", suffix=".log", delete=False)
        env = dict(os.environ)  # the user's XLA_FLAGS pass through; --cpu-devices adds the device count after them
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable, "-m", "actors.daemon", "--listen", address, "--actor-id", str(actor_id),
               "--p2p", "tcp" if options.p2p else "none", "--parent-pid", str(os.getpid()), "--log-level", options.log_level]
        d = options.devices_per_actor
        if options.platform == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            cmd += ["--cpu-devices", str(d)]
        else:  # actor i owns GPUs [i * d, (i + 1) * d)
            env.pop("JAX_PLATFORMS", None)
            cmd += ["--devices", ",".join(str(actor_id * d + k) for k in range(d))]
        if cpus:
            cmd += ["--cpus", ",".join(map(str, cpus))]
        if ipc_dir:
            cmd += ["--ipc-dir", ipc_dir]
        cache = default_cache_dir() if options.cache_dir is True else options.cache_dir
        if cache:
            cmd += ["--cache-dir", str(cache)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            with open(self.stderr.name, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def wait_ready(self, deadline: float) -> str:
        """Wait for the daemon's ready line; return its control endpoint."""
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                break
            if sel.select(timeout=min(left, 0.2)):
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
        sel.close()
        text = line.decode(errors="replace").strip()
        if not text.startswith("MPMD_ACTOR_READY"):
            why = f"exited with code {self.proc.returncode}" if self.proc.poll() is not None else "did not report ready in time"
            raise ActorStartError(f"local actor {self.actor_id} {why}. Its stderr:\n{self.stderr_tail()}")
        return text.split()[1]

    def dead_reason(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        return f"its process exited with code {code}; stderr tail:\n{self.stderr_tail(800)}"

    def stacks(self) -> str:
        """Ask the daemon to dump every thread's stack (SIGUSR1, see actors/daemon.py) and return it."""
        try:
            start = os.path.getsize(self.stderr.name)
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(0.3)
            with open(self.stderr.name, errors="replace") as f:
                before = f.read(start)[-1500:]
                return f.read()[-6000:] + (f"\nits log before that:\n{before}" if before.strip() else "")
        except OSError as e:
            return f"(could not dump its stacks: {e})"

    def stop(self, timeout: float = 3.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.stderr.close()
        try:
            os.unlink(self.stderr.name)
        except OSError:
            pass


def start_local(num_actors: int, options: LocalOptions) -> tuple[list[LocalProcess], list[str], str]:
    """Start `num_actors` daemons here and wait until each is ready. Returns (processes, control endpoints,
    the temporary directory holding their sockets); on failure nothing is left running."""
    if num_actors < 1:
        raise ValueError(f"num_actors must be >= 1, got {num_actors}")
    cpus = cpu_sets(num_actors, options.cpus_per_actor) if options.cpus_per_actor else [None] * num_actors
    tmp = tempfile.mkdtemp(prefix="mpmd-")
    addrs = [f"ipc://{tmp}/actor{i}.sock" if options.address == "ipc" else "tcp://127.0.0.1:0" for i in range(num_actors)]
    procs: list[LocalProcess] = []
    try:
        for i, a in enumerate(addrs):
            procs.append(LocalProcess(i, a, options, tmp, cpus[i]))
        deadline = time.monotonic() + options.startup_timeout
        endpoints = [p.wait_ready(deadline) for p in procs]
        return procs, endpoints, tmp
    except BaseException:
        for p in procs:
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
