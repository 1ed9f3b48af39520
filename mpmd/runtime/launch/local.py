"""How `mpmd-actor` daemons are started: here, as local subprocesses. (A mesh only drives daemons; it does
not care who started them: see `RemoteMesh.connect`.)

    local = start_local(2, LocalOptions(devices_per_actor=1))
    mesh = RemoteMesh(local.endpoints, local.processes, keys=local.keys)

A local mesh is authenticated with no user action: `start_local` makes ephemeral CURVE keys (one pair for the
daemons, one for this controller) and hands them to each daemon over a pipe, so no key touches the disk.
Everything a local mesh creates — sockets, the daemons' logs — lives in one private directory (mode 700)
that `LocalMesh.cleanup` removes; if this process dies without cleaning up (SIGKILL), the daemons notice
(a pidfd on this process), exit and remove it themselves.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from mpmd.errors import ActorStartError
from mpmd.runtime.arguments import check_count, check_seconds
from transport.auth import ClientKeys, KeyPair

log = logging.getLogger(__name__)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # the daemons' --log-level
MAX_LOCAL_DEVICES = 4096  # devices one local actor may be given (a host's GPUs, or forced CPU devices)


@dataclass(frozen=True)
class LocalOptions:
    """How to start local actor daemons.

    `devices_per_actor`: CPU devices (or GPUs with platform="gpu": actor i gets GPUs i*d .. i*d+d-1).
    `cpus_per_actor`: pin actor i to its own `k` cores (cores i*k .. i*k+k-1 of those this process may use)
    and size XLA's CPU thread pool to them; None leaves scheduling to the OS.
    `cache_dir`: JAX's persistent compilation cache for the actors (a restarted job skips XLA compilation):
    True (default) is `default_cache_dir()` (none where other users could write it: `usable_default_cache_dir`),
    False turns it off, a string is that directory.
    `gpu_ids`: with platform="gpu", the GPUs to deal out instead of 0, 1, 2, ...: actor i gets
    gpu_ids[(i*d + k) % len(gpu_ids)] for k < d, so ``(0,)`` puts every actor on GPU 0 (a pipeline through host
    memory on one GPU; set XLA_PYTHON_CLIENT_MEM_FRACTION so that they fit together).
    `insecure`: no keys at all (control and data plane unauthenticated and unencrypted): only to measure
    what authentication costs. `request_timeout`: the daemons' bound on every request (None: their default).
    """

    devices_per_actor: int = 1
    platform: str = "cpu"
    p2p: bool = True
    cache_dir: str | bool = True
    address: str = "ipc"  # "ipc" (Unix sockets) or "tcp" (loopback)
    log_level: str = "WARNING"
    cpus_per_actor: int | None = None
    startup_timeout: float = 120.0
    insecure: bool = False
    request_timeout: float | None = None
    gpu_ids: tuple[int, ...] | None = None
    loaders: tuple[str, ...] = ()  # "module:function" data loaders the daemons may call (mpmd.runtime.loader)

    def __post_init__(self) -> None:
        check_count("devices_per_actor", self.devices_per_actor)
        if self.devices_per_actor > MAX_LOCAL_DEVICES:  # (2**70 passed, and every daemon exited with code 2; a probe)
            raise ValueError(f"devices_per_actor={self.devices_per_actor}: a local actor runs on this host's devices, at most "
                             f"{MAX_LOCAL_DEVICES}")
        if self.platform not in ("cpu", "gpu"):
            raise ValueError(f"platform must be 'cpu' or 'gpu', got {self.platform!r}")
        if self.address not in ("ipc", "tcp"):
            raise ValueError(f"address must be 'ipc' or 'tcp', got {self.address!r}")
        if self.cpus_per_actor is not None:  # ('2' and [1, 1] met a bare comparison TypeError, True was 1; a probe)
            check_count("cpus_per_actor (cores per local actor, or None)", self.cpus_per_actor)
        check_seconds("request_timeout", self.request_timeout, none_ok=True)
        check_seconds("startup_timeout", self.startup_timeout)  # (NaN: "cannot convert float NaN to integer"; 0:
        # "took longer ... start fewer": a probe)
        if not (self.cache_dir is None or isinstance(self.cache_dir, bool) or (isinstance(self.cache_dir, (str, os.PathLike))
                                                                 and os.fspath(self.cache_dir).strip())):
            raise TypeError(f"cache_dir must be True (the default cache), False or None (none) or a directory, got "
                            f"{type(self.cache_dir).__name__} {self.cache_dir!r:.60}")  # (5 was taken; a probe)
        if not isinstance(self.log_level, str) or self.log_level.upper() not in LOG_LEVELS:  # (an int reached the daemon's argument list: "expected str ... not int")
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)} (the daemons' logging level), got {self.log_level!r:.40}")


def check_devices(headers: Sequence[dict[str, Any]], options: LocalOptions) -> None:
    """An `ActorStartError` unless every local daemon (its `info` header) runs on the platform and with the
    number of devices asked for: JAX falls back to the CPU where it finds no GPU, and a host with fewer GPUs
    than asked gives an actor fewer; either would train, silently, on something else than asked."""
    want = "gpu" if options.platform == "gpu" else "cpu"
    for i, h in enumerate(headers):
        platform, n = h.get("platform"), len(h.get("devices") or [None])
        if platform is None or (platform == want and n == options.devices_per_actor):
            continue  # (a daemon that does not say: a test's stand-in)
        if want == "cpu":
            hint = (" — its CPU devices come from XLA_FLAGS' --xla_force_host_platform_device_count, which XLA ignores after "
                    "a word there that is no --flag: check XLA_FLAGS in this environment")
        elif platform != "gpu":
            hint = (" — JAX in this environment sees no GPU for it: install jax with its CUDA plugin (pip install "
                    "'jax[cuda12]') and check the GPUs are visible (nvidia-smi), or run on the CPU (platform='cpu')")
        else:
            hint = (f" — are there {options.devices_per_actor} GPUs per actor here? pass gpu_ids= the GPUs to deal out, "
                    "or fewer devices_per_actor")
        raise ActorStartError(f"local actor {i} runs on {n} {platform} device(s), but RemoteMesh.local asked for "
                              f"devices_per_actor={options.devices_per_actor} on platform={options.platform!r}{hint}")


def default_cache_dir() -> str:
    """$MPMD_CACHE_DIR, else $XDG_CACHE_HOME/mpmd/xla, else ~/.cache/mpmd/xla."""
    if os.environ.get("MPMD_CACHE_DIR"):
        return os.environ["MPMD_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mpmd", "xla")


_UNSAFE_DEFAULT_SAID: set[str] = set()


def usable_default_cache_dir() -> str | None:
    """`default_cache_dir()` (made now, mode 700, where it does not exist), or None (no persistent cache: each daemon
    compiles into a private one) when it, or a directory above it, could be written by other users: a daemon
    refuses such a --cache-dir (it runs what it finds there), and RemoteMesh.local() failed to start on a machine
    whose home directory is group-writable (a probe). Said once per directory, with what to do. One named by
    $MPMD_CACHE_DIR is the user's choice: refused, as a cache_dir given outright is."""
    from transport.auth import AuthKeyError, make_safe_dir

    path = os.path.abspath(os.path.expanduser(default_cache_dir()))
    if os.environ.get("MPMD_CACHE_DIR"):  # (checked here, as the daemons would, to name the variable: their refusal
        try:  # named their --cache-dir, which the user never wrote; a probe)
            return make_safe_dir(path, "the compilation cache MPMD_CACHE_DIR names,", holds="compiled code")
        except AuthKeyError as e:
            raise ValueError(f"{e} (the daemons run the executables they find there)") from None
        except OSError as e:
            raise ValueError(f"cannot make the compilation cache MPMD_CACHE_DIR names, {path}: {e.strerror or e}") from None
    try:
        return make_safe_dir(path, "the default compilation cache", holds="compiled code")
    except (AuthKeyError, OSError) as e:
        if path not in _UNSAFE_DEFAULT_SAID:
            _UNSAFE_DEFAULT_SAID.add(path)
            log.warning("%s. The local actors run without a persistent compilation cache (%s: each start compiles again): "
                        "fix that, or name a safe directory with MPMD_CACHE_DIR or RemoteMesh.local(cache_dir=...)", e, path)
        return None


IPC_PATH_MAX = 107  # bytes of a Unix socket path (sockaddr_un.sun_path less its NUL), where pyzmq does not say


def socket_dir(prefix: str, longest_name: str) -> str:
    """A new private directory (mode 700) for daemon sockets: in the temporary directory, or in /tmp when a socket
    named `longest_name` there would be past the length a Unix socket path may have (a long TMPDIR, e.g. a cluster
    job's scratch: every daemon failed to bind with a path error; a probe)."""
    limit = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or IPC_PATH_MAX
    tmp = tempfile.mkdtemp(prefix=prefix)
    if len(os.path.join(tmp, longest_name).encode()) <= limit:
        return tmp
    os.rmdir(tmp)
    if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK | os.X_OK):
        tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        if len(os.path.join(tmp, longest_name).encode()) <= limit:
            log.info("the temporary directory %s is too long a path for Unix sockets; daemon sockets go to %s",
                     tempfile.gettempdir(), tmp)
            return tmp
        os.rmdir(tmp)
    raise ActorStartError(f"the temporary directory {tempfile.gettempdir()!r} is too long a path for the daemons' Unix sockets "
                          f"(at most {limit} bytes with {longest_name!r}), and /tmp cannot be used instead; set TMPDIR to a "
                          "shorter directory")


def cpu_sets(num_actors: int, cpus_per_actor: int) -> list[list[int]]:
    """Disjoint core sets, one per actor, from the cores this process may run on."""
    cores = sorted(os.sched_getaffinity(0))
    need = num_actors * cpus_per_actor
    if need > len(cores):
        raise ValueError(f"cpus_per_actor={cpus_per_actor} for {num_actors} actors needs {need} cores, but this process may "
                         f"use only {len(cores)} ({cores}); use fewer actors or cores per actor")
    return [cores[i * cpus_per_actor : (i + 1) * cpus_per_actor] for i in range(num_actors)]


_SIGNALS = {signal.SIGKILL: "was killed by SIGKILL (kill -9, or the kernel's out-of-memory killer: see `dmesg`)",
            signal.SIGSEGV: "crashed with SIGSEGV (a segmentation fault)", signal.SIGABRT: "aborted (SIGABRT)",
            signal.SIGBUS: "crashed with SIGBUS", signal.SIGTERM: "was terminated (SIGTERM)", signal.SIGINT: "was interrupted (SIGINT)",
            signal.SIGILL: "crashed with SIGILL", signal.SIGFPE: "crashed with SIGFPE",
            signal.SIGHUP: "was hung up on (SIGHUP: the terminal or ssh session it ran in closed, or `kill -HUP`)"}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(code: int) -> str:
    if code < 0:
        return _SIGNALS.get(-code, f"was killed by {_signal_name(-code)}")
    if code == 0:  # (the daemon stops cleanly on SIGTERM and SIGINT too: its exit status does not say which)
        return "exited with code 0 (a clean stop: SIGTERM, SIGINT, a shutdown request, or its controller gone)"
    return f"exited with code {code}"


def terminate(proc: subprocess.Popen[bytes], timeout: float = 3.0) -> None:
    """SIGTERM `proc`, SIGKILL it after `timeout` seconds if it still runs; close its stdout."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout:
        proc.stdout.close()


class LocalProcess:
    """An `mpmd-actor` subprocess on this machine, with its stderr kept in a file (in the mesh's directory) for
    error messages."""

    def __init__(self, actor_id: int, address: str, options: LocalOptions, ipc_dir: str | None = None,
                 cpus: list[int] | None = None, keys: dict[str, object] | None = None) -> None:
        self.actor_id = actor_id
        self.platform = options.platform
        if ipc_dir:
            self.log_path = os.path.join(ipc_dir, f"actor{actor_id}.log")
            self.stderr = open(self.log_path, "wb")
        else:
            self.stderr = tempfile.NamedTemporaryFile(prefix=f"mpmd-actor{actor_id}-", suffix=".log", delete=False)
            self.log_path = self.stderr.name
        env = dict(os.environ)  # the user's XLA_FLAGS pass through; --cpu-devices adds the device count after them
        env.setdefault("PYTHONUNBUFFERED", "1")
        p2p = "none" if not options.p2p else ("ipc" if options.address == "ipc" and ipc_dir else "tcp")
        cmd = [sys.executable, "-m", "actors.daemon", "--listen", address, "--actor-id", str(actor_id),
               "--p2p", p2p, "--parent-pid", str(os.getpid()), "--log-level", options.log_level]
        d = options.devices_per_actor
        if options.platform == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            cmd += ["--cpu-devices", str(d)]
        else:  # actor i owns GPUs [i * d, (i + 1) * d) of gpu_ids (default 0, 1, 2, ...)
            env.pop("JAX_PLATFORMS", None)
            ids = options.gpu_ids
            cmd += ["--devices", ",".join(str(ids[(actor_id * d + k) % len(ids)] if ids else actor_id * d + k) for k in range(d))]
        if cpus:
            cmd += ["--cpus", ",".join(map(str, cpus))]
        if ipc_dir:
            cmd += ["--ipc-dir", ipc_dir, "--mesh-dir", ipc_dir]
        cache = usable_default_cache_dir() if options.cache_dir is True else options.cache_dir
        if cache:
            cmd += ["--cache-dir", str(cache)]
        if options.request_timeout is not None:
            cmd += ["--request-timeout", str(options.request_timeout)]
        for fn in options.loaders:
            cmd += ["--allow-loader", fn]
        cmd += ["--keys-stdin"] if keys is not None else ["--insecure"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, stdin=subprocess.PIPE, env=env,
                                     start_new_session=True)
        assert self.proc.stdin is not None
        try:  # the keys go over the pipe: never on a command line (others can read those) or on disk
            if keys is not None:
                self.proc.stdin.write(json.dumps(keys).encode() + b"\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once; wait_ready says why

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def wait_ready(self, deadline: float, stopped_limit: float | None = None) -> str:
        """Wait for the daemon's ready line; return its control endpoint. `stopped_limit`: seconds the process may
        stay stopped (SIGSTOP) before it is given up as a killed one would be (`ActorStartError.killed`: a recovery
        starts another), instead of waiting out `deadline` for a process that cannot start."""
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        line, eof = b"", False
        stopped_since: float | None = None
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                break
            if stopped_limit is not None:  # (not a debugger's stop, "t": one attached to a starting daemon is meant)
                stopped_since = (stopped_since or time.monotonic()) if _process_state(self.proc.pid) == "T" else None
                if stopped_since is not None and time.monotonic() - stopped_since >= stopped_limit:
                    sel.close()
                    err = ActorStartError(f"local actor {self.actor_id} was stopped (SIGSTOP) as it started and stayed "
                                          f"stopped for {stopped_limit:g} s (pid {self.proc.pid}): a stopped process "
                                          f"cannot start, so it is given up and another started")
                    err.killed = True
                    raise err
            if sel.select(timeout=min(left, 0.2)):
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    eof = True
                    break
                line += chunk
        sel.close()
        text = line.decode(errors="replace").strip()
        if not text.startswith("MPMD_ACTOR_READY"):
            if eof:  # its output ended: it is exiting (reaped in a moment)
                try:
                    self.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            exited = self.proc.poll() is not None
            why = describe_exit(self.proc.returncode) if exited else "did not report ready in time"
            tail = self.stderr_tail().strip()
            err = ActorStartError(f"local actor {self.actor_id} {why}" + (f". Its stderr:\n{tail}" if tail else
                                                                          " (its stderr is empty)"))
            err.killed = exited and self.proc.returncode < 0  # (a recovery counts it as one more lost actor; an exit of
            # its own — flags refused, no port — or a timeout would come again: it ends the recovery)
            err.timed_out = not exited
            raise err
        return text.split()[1]

    def dead_reason(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        tail = self.stderr_tail(800).strip()
        return f"its process (pid {self.proc.pid}) {describe_exit(code)}" + (f"; stderr tail:\n{tail}" if tail else "")

    def stacks(self) -> str:
        """Ask the daemon to dump every thread's stack (SIGUSR1, see actors/daemon.py) and return it, or say why not."""
        stopped = said_stopped(self.proc.pid)
        if stopped:
            return stopped
        try:
            start = os.path.getsize(self.log_path)
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(0.3)
            with open(self.log_path, errors="replace") as f:
                before = f.read(start)[-1500:]
                dump = f.read()[-6000:]
        except OSError as e:
            return f"(could not dump its stacks: {e})"
        if not dump.strip():
            return f"(none: it wrote nothing within 0.3 s of SIGUSR1; process state {_process_state(self.proc.pid) or 'unknown'})"
        return dump + (f"\nits log before that:\n{before}" if before.strip() else "")

    def stop(self, timeout: float = 3.0) -> None:
        terminate(self.proc, timeout)
        self.stderr.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass
        remove_shared_memory(self.proc.pid)


def remove_shared_memory(pid: int) -> int:
    """Unlink the shared-memory segments a daemon made (names start with /mpmd-<pid>-) that are still there
    after it is gone (it unlinks its own when it exits normally; not when it is killed)."""
    n, prefix = 0, f"mpmd-{pid}-"
    try:  # (not glob: fnmatch's cache kept two compiled patterns per daemon's pid for the process's life; a probe)
        names = [e.name for e in os.scandir("/dev/shm") if e.name.startswith(prefix)]
    except OSError:  # (no /dev/shm: nothing made there)
        return 0
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
            n += 1
        except OSError:
            pass
    return n


def said_stopped(pid: int) -> str:
    """'(none: its process ... is stopped ...)' when process `pid` (here) is stopped, else '': a stopped process cannot
    write its stacks (asked for them, it wrote nothing, said as if it had nothing to say: a probe on Ray)."""
    if _process_state(pid) in ("T", "t"):
        return (f"(none: its process (pid {pid}) is stopped — SIGSTOP, or a debugger holds it — and a stopped "
                f"process cannot write its stacks; `kill -CONT {pid}` resumes it)")
    return ""


def _process_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


# Seconds a replacement daemon may stay stopped (SIGSTOP) while it starts before a recovery gives it up and starts
# another, as a live actor is given up after heartbeat_timeout (10 s by default) of silence: a stopped replacement held
# a recovery for its whole spawn_timeout (120 s; a probe).
STOPPED_LIMIT = 10.0


@dataclass
class LocalMesh:
    """What `start_local` started: the processes, their control endpoints, the private directory and the keys
    this controller authenticates with (None for an insecure mesh)."""

    processes: list[LocalProcess]
    endpoints: list[str]
    directory: str
    keys: ClientKeys | None
    options: LocalOptions | None = None
    addresses: list[str] | None = None  # what each daemon was told to bind
    cpus: list[list[int] | None] | None = None
    handoff: dict[str, object] | None = None  # the daemons' keys (kept here, in memory only, to start replacements)

    def respawn(self, actor_id: int, timeout: float) -> tuple[str, LocalProcess]:
        """Start a replacement for daemon `actor_id` (stopping the old process if it still runs), with the same
        options and keys, in the same directory; wait up to `timeout` seconds for it. Returns its control
        endpoint and process (`ActorStartError` when it does not come up)."""
        if self.options is None or self.addresses is None or self.cpus is None:
            raise ActorStartError("this LocalMesh was not made by start_local: it cannot start replacements")
        old = self.processes[actor_id]
        if old.proc.poll() is None:
            old.proc.kill()
        old.proc.wait()
        old.stop(0)  # its log and shared memory go
        proc = LocalProcess(actor_id, self.addresses[actor_id], self.options, self.directory, self.cpus[actor_id], self.handoff)
        try:
            endpoint = proc.wait_ready(time.monotonic() + timeout, stopped_limit=min(STOPPED_LIMIT, timeout))
        except BaseException:
            proc.stop(0)
            raise
        self.processes[actor_id] = proc
        self.endpoints[actor_id] = endpoint
        return endpoint, proc

    def cleanup(self) -> None:
        for p in self.processes:
            p.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


DAEMON_BYTES = 300 << 20  # what one idle daemon (Python, JAX, its XLA client) takes: 250-350 MB resident here


def host_memory() -> dict[str, int] | None:
    """/proc/meminfo's MemTotal, MemAvailable and SwapTotal in bytes (None where there is none: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            got = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                   if k in ("MemTotal", "MemAvailable", "SwapTotal")}
    except (OSError, ValueError, IndexError):
        return None
    return got if "MemTotal" in got else None


def start_local(num_actors: int, options: LocalOptions) -> LocalMesh:
    """Start `num_actors` daemons here and wait until each is ready; on failure nothing is left running."""
    num_actors = check_count("num_actors", num_actors)
    memory = host_memory()
    if memory is not None and num_actors * DAEMON_BYTES > memory["MemTotal"] + memory.get("SwapTotal", 0):
        raise ValueError(f"num_actors={num_actors}: each local actor is a daemon process holding JAX (~{DAEMON_BYTES >> 20} MiB "
                         f"before any array), {num_actors * DAEMON_BYTES / 2**30:.1f} GiB in all, and this machine has "
                         f"{(memory['MemTotal'] + memory.get('SwapTotal', 0)) / 2**30:.1f} GiB of memory and swap; start fewer, "
                         "or daemons on other machines (RemoteMesh.connect)")
    if memory is not None and num_actors * DAEMON_BYTES > memory.get("MemAvailable", memory["MemTotal"]):
        log.warning("RemoteMesh.local: %d actors take ~%.1f GiB before any array, and %.1f GiB of memory is available now",
                    num_actors, num_actors * DAEMON_BYTES / 2**30, memory.get("MemAvailable", 0) / 2**30)
    cpus = cpu_sets(num_actors, options.cpus_per_actor) if options.cpus_per_actor else [None] * num_actors
    # (mode 700: other users cannot reach the sockets in it; the longest socket name in it decides its length)
    tmp = socket_dir("mpmd-", max(f"actor{num_actors - 1}.sock", f"p2p-{num_actors - 1}.sock", key=len))
    addrs = [f"ipc://{tmp}/actor{i}.sock" if options.address == "ipc" else "tcp://127.0.0.1:0" for i in range(num_actors)]
    keys = handoff = None
    if not options.insecure:
        server, client = KeyPair.generate(), KeyPair.generate()
        keys = ClientKeys(client, (server.public,))
        assert server.secret is not None
        handoff = {"server_public": server.public.decode(), "server_secret": server.secret.decode(),
                   "authorized": {client.public.decode(): "controller"}}
    procs: list[LocalProcess] = []
    local = LocalMesh(procs, [], tmp, keys, options, addrs, cpus, handoff)
    try:
        deadline = time.monotonic() + options.startup_timeout
        for i, a in enumerate(addrs):
            if time.monotonic() > deadline:
                raise ActorStartError(f"starting {num_actors} local actors took longer than startup_timeout="
                                      f"{options.startup_timeout:g} s ({i} started); start fewer, or pass a longer startup_timeout")
            procs.append(LocalProcess(i, a, options, tmp, cpus[i], handoff))
        local.endpoints = [p.wait_ready(deadline) for p in procs]
        return local
    except KeyboardInterrupt:  # the user is waiting: a daemon still starting holds a stop signal until JAX is imported,
        # and the Ctrl-C came 2-6 s late, after each in turn (a probe); killed, nothing of it is left but its shared
        # memory, removed with it (its compile directory a later daemon sweeps)
        for p in procs:
            p.stop(0)
            remove_shared_memory(p.proc.pid)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:
        local.cleanup()
        raise
