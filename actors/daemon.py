"""`mpmd-actor`: the per-node daemon.

    mpmd keys generate ~/.mpmd/keys                        # once; copy the directory to every node
    mpmd-actor --listen tcp://0.0.0.0:5555 --actor-id 0 \\
        --server-key ~/.mpmd/keys/mpmd.key_secret --authorized-keys ~/.mpmd/keys
    mpmd-actor --listen ipc:///tmp/a0.sock --cpu-devices 4 --insecure   # a local actor, no keys

On start it prints one line ``MPMD_ACTOR_READY <endpoint> <p2p endpoint>`` to stdout (``:0`` binds a free
port, and the line says which). It serves requests until a ``shutdown`` request, SIGTERM, SIGINT or SIGHUP (unless ignored: nohup), or
(with ``--parent-pid``) until that process has exited (a zombie counts as exited). A bad request gets an
error reply within ``--request-timeout`` (a step, or a get or wait of what a step makes, from when the steps
of its session before it ended); it never stops the daemon. ``kill -USR1 <pid>`` writes every
thread's stack to stderr (the controller of a local mesh does this for an actor that stops answering, and
shows the stacks in the error). With ``MPMD_ACTOR_PROFILE=<prefix>`` in its environment, a daemon profiles
its event-loop thread (cProfile) into ``<prefix>.<actor id>`` on exit.

Security: with ``--server-key``/``--authorized-keys`` the control socket is a CURVE server that admits only
the controllers whose public keys are in that directory, and every request is tied to the key that sent it.
Without keys the daemon binds only to loopback or ipc (``--insecure`` lifts that, and trusts whoever can
reach the socket), and serves ``compile`` and what changes or reads what every session shares (``save``,
``restore``, ``profile``, ``shutdown``, the data-plane wiring) only with ``--insecure``. The data plane between actors is
CURVE-authenticated with keys the daemon makes at start (see transport/auth.py) unless ``--insecure``.
"""

from __future__ import annotations

import signal

# Signals while the daemon starts, before `serve` hands them to its event loop: a KeyboardInterrupt raised inside
# jaxlib's native import or its backend's start crashed the daemon (SIGSEGV, SIGABRT: no message; or swallowed in a
# garbage-collector callback, and the daemon went on to print its ready line) — a probe, Ctrl-C 0.9 s after the start;
# one inside numpy's or ml_dtypes' import turned into an ImportError and its traceback, and one in this module's imports
# (0.05-0.5 s after the start) into a KeyboardInterrupt's. There a signal is only noted, and raised once that part is
# over; elsewhere it interrupts at once (`main` says so).
_STARTING: dict[str, Any] = {"native": False, "pending": None}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # (SIGHUP: a shell's logout; kept ignored under nohup)


def _early_signal(signum: int, frame: Any) -> None:
    if _STARTING["native"]:
        _STARTING["pending"] = signum
        return
    raise KeyboardInterrupt


def _stop_signals() -> list[int]:
    """The stop signals this daemon takes: nohup's ignored SIGHUP stays ignored."""
    return [sig for sig in STOP_SIGNALS if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN]


def _take_stop_signals() -> None:
    for sig in _stop_signals():
        signal.signal(sig, _early_signal)


if __name__ == "__main__":  # `python -m actors.daemon` (as RemoteMesh.local starts it): held from here, not after the
    _STARTING["native"] = True  # imports below; `main` raises one noted meanwhile (the `mpmd-actor` script's window
    _take_stop_signals()  # before `main` is this module's import, ~0.1 s)

import argparse
import asyncio
import contextlib
import ctypes
import faulthandler
import fcntl
import functools
import json
import logging
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from actors import cluster
from actors.compile_cache import CompileCacheBound, prune_compile_cache

COMPILE_DIR = re.compile(r"mpmd-compile-\d+-[A-Za-z0-9_]+")  # a daemon's private compile directory (mkdtemp's suffix)
COMPILE_LOCK = ".held"  # locked (flock) by its daemon for as long as it lives


def _private_compile_dir(actor_id: int, parent: str | None) -> tuple[str, int]:
    """A compile directory for this daemon alone, and the descriptor of the lock it holds on it until it exits."""
    path = tempfile.mkdtemp(prefix=f"mpmd-compile-{actor_id}-", dir=parent)
    fd = os.open(os.path.join(path, COMPILE_LOCK), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return path, fd


def _import_loaders(names: list[str]) -> None:
    """Import every --allow-loader function now (after JAX is set up), so that one this daemon cannot import stops it
    at start, naming PYTHONPATH, rather than failing a step after dispatch. The working directory is searched too,
    as `python -m actors.daemon` (what RemoteMesh.local starts) searches it; the `mpmd-actor` script did not (a probe)."""
    import importlib

    from transport.protocol import IMPORTING_LOADER  # (a script that starts a mesh at import is refused meanwhile)

    if names and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    for name in names:
        module, _, attr = name.partition(":")
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)  # what the module prints goes to stderr: stdout's first line is the daemon's ready line
        os.environ[IMPORTING_LOADER] = name
        try:
            imported = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - the user's module: any error it raises at import is the answer
            raise SystemExit(f"mpmd-actor: --allow-loader {name}: cannot import it here ({type(e).__name__}: {e}); put its "
                             f"module on PYTHONPATH (this daemon's working directory {os.getcwd()} is searched too)") from None
        finally:
            os.environ.pop(IMPORTING_LOADER, None)
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        fn = getattr(imported, attr, None)
        if fn is None:
            raise SystemExit(f"mpmd-actor: --allow-loader {name}: module {module} ({getattr(imported, '__file__', '?')}) "
                             f"imported, but has no {attr!r}")
        if not callable(fn):
            raise SystemExit(f"mpmd-actor: --allow-loader {name} is a {type(fn).__name__}, not a function")


def _remove_mesh_files(mesh_dir: str, actor_id: int) -> None:
    """Nobody will read this actor's log or dial its sockets again (its controller is gone): remove what is its own
    in the local mesh's directory, and the directory once empty (the last daemon of the mesh to go removes it)."""
    for name in (f"actor{actor_id}.sock", f"p2p-{actor_id}.sock", f"actor{actor_id}.log"):
        try:
            os.unlink(os.path.join(mesh_dir, name))
        except OSError:
            pass
    try:
        os.rmdir(mesh_dir)
    except OSError:
        pass


def _sweep_stale_compile_dirs(parent: str) -> None:
    """Remove the private compile directories that this user's daemons killed with SIGKILL left in `parent` (a
    daemon removes its own at exit; one killed cannot): those whose lock no daemon holds. A lock, not a pid: the
    directory may be shared by daemons of other pid spaces (containers, nodes sharing a scratch directory)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if COMPILE_DIR.fullmatch(name) is None:
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            if st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode):
                continue
            fd = os.open(os.path.join(path, COMPILE_LOCK), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # (no lock file: one being made this moment; not ours; gone)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its daemon lives (or locks do not work here: leave it)
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


COMPILE_GRACE = 5.0  # a compile's bound: --compile-timeout for its checks, again for XLA, plus this (a compile process's start)


def _utf8(what: str) -> Callable[[str], str]:
    """An argparse type: the text as given, refused (one line, exit 2) unless it is valid UTF-8 — ZeroMQ endpoints and
    the names sent to peers are UTF-8, and a byte that is not (argv's surrogate escape) ended in a traceback from
    zmq's bind (a probe)."""
    def check(text: str) -> str:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise argparse.ArgumentTypeError(f"{what} {text.encode('utf-8', 'surrogateescape')!r:.120} is not valid UTF-8") from None
        return text
    return check


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpmd-actor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default=None, type=_utf8("the endpoint"),
                   help="control endpoint (tcp://host:port, ipc://path); port 0 picks one (default: tcp://127.0.0.1:5555; "
                        "with --rendezvous, this node's address on a free port; with --slurm alone, this node's address, port 5555 + "
                        "SLURM_LOCALID)")
    p.add_argument("--actor-id", type=int, default=None, help="this actor's index in the mesh (default 0; with --slurm: SLURM_PROCID)")
    p.add_argument("--cpu-devices", type=int, default=None, help="give this actor N host (CPU) devices")
    p.add_argument("--cpus", default=None,
                   help="comma-separated cores to pin this daemon to (XLA's CPU thread pool is sized to them; one core "
                        "also turns off Eigen's multi-threading)")
    p.add_argument("--platform", default=None, help="JAX platform to use (cpu, or cuda — which RemoteMesh.local names platform=\"gpu\"); default: JAX's choice")
    p.add_argument("--devices", default=None, help="comma-separated visible GPU indices (sets CUDA_VISIBLE_DEVICES)")
    p.add_argument("--p2p", default="tcp", choices=["tcp", "ipc", "none"],
                   help="data plane to other actors: 'tcp' opens ZeroMQ endpoints (the controller then picks tcp, shm or "
                        "nccl per peer); 'ipc' only an ipc socket in --ipc-dir (actors on this host only); 'none' no data plane (default: %(default)s)")
    p.add_argument("--ipc-dir", default=None, type=_utf8("the directory"), help="also bind the data plane on an ipc socket in this directory (same-host peers use it)")
    p.add_argument("--transfer-timeout", type=float, default=300.0,
                   help="seconds a receive waits for its peer before the step fails (each controller may set its own) (default: %(default)s)")
    p.add_argument("--p2p-host", default=None, type=_utf8("the host"), help="address peers reach this actor's data plane on (default: the --listen host; for a wildcard "
                                                            "--listen such as tcp://0.0.0.0:PORT, this node's own address)")
    p.add_argument("--cache-dir", default=None, help="JAX persistent compilation cache directory (default: a private temporary one, removed at exit; "
                   "RemoteMesh.local passes ~/.cache/mpmd/xla)")
    p.add_argument("--cache-max-mb", type=float, default=4096, help="at start and every few new executables, remove the compilation cache's "
                   "entries least recently used (and untouched for an hour) while it holds more than this; 0: no bound (default %(default)s)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process has exited")
    p.add_argument("--mesh-dir", default=None,
                   help="the private directory of the local mesh this daemon belongs to: if its --parent-pid exits without "
                        "cleaning up, the daemon removes its own files there (actor<id>.sock, p2p-<id>.sock, actor<id>.log) "
                        "and the directory once it is empty")
    p.add_argument("--max-message-mb", type=int, default=8192, help="the most bytes of arrays one message may carry: ZeroMQ drops a connection that sends a bigger frame, the daemon refuses a message whose frames together are bigger (default: %(default)s)")
    p.add_argument("--server-key", default=None, help="this daemon's CURVE key pair (a *.key_secret file from `mpmd keys generate`)")
    p.add_argument("--authorized-keys", default=None, help="directory of *.key files: the controllers allowed to connect")
    p.add_argument("--admin-key", action="append", default=[], metavar="NAME",
                   help="an operator's key (NAME.key in --authorized-keys) that may rewire or stop this daemon whoever owns "
                        "its job (repeatable); otherwise only the key of the job's first session may")
    p.add_argument("--keys-stdin", action="store_true", help=argparse.SUPPRESS)  # a local mesh hands ephemeral keys over a pipe
    p.add_argument("--insecure", action="store_true",
                   help="run without authentication: accept any client on any address (only on networks you trust)")
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="every request but compile gets its reply within this many seconds (an error reply if need be); a step, "
                        "or a get or wait of what a step makes, counts them from when the steps of its session before it "
                        "ended (default: %(default)s)")
    p.add_argument("--session-timeout", type=float, default=60.0,
                   help="a controller's session (its buffers, programs, steps and its key's claim on the daemon) ends when "
                        "the controller has said nothing for this many seconds: a live one keeps it open on its own, so this "
                        "only frees what a killed or cut-off controller left (default: %(default)s)")
    p.add_argument("--compile-timeout", type=float, default=600.0,
                   help="seconds a compile's checks, and then its XLA compile, may each take (the request: twice this, plus 5 s); "
                        "a compile past it is stopped (its process killed) (default: %(default)s)")
    p.add_argument("--kept-executables", type=int, default=256,
                   help="compiled executables no open session uses that are kept for later jobs (the oldest go first) (default: %(default)s)")
    p.add_argument("--compile-workers", type=int, default=2,
                   help="compiles that may run at once, each in a child process stopped at --compile-timeout (default: %(default)s)")
    p.add_argument("--allow-custom-call", action="append", default=[], metavar="TARGET",
                   help="also allow executables to call this custom-call target (repeatable)")
    p.add_argument("--allow-loader", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="a data-loader function a controller may have this actor call for its batch leaves (repeatable; "
                        "see actors/loader.py)")
    p.add_argument("--max-unclaimed", type=int, default=10_000,
                   help="data-plane arrivals one peer may leave unclaimed here before further ones are refused (default: %(default)s)")
    p.add_argument("--max-unclaimed-mb", type=int, default=32 * 1024, help="the same limit, in MiB (default: %(default)s)")
    p.add_argument("--guest-memory-mb", type=int, default=4096,
                   help="MiB of buffers the sessions of keys that do not own the daemon's job may hold between them "
                        "(their loaded programs are bounded alike); the owner's and operators' sessions are not bounded (default: %(default)s)")
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="(default: %(default)s)")
    cluster.add_arguments(p)
    args = p.parse_args(argv)
    if getattr(args, "rendezvous", None) == "":
        p.error("--rendezvous takes a directory or tcp://HOST:PORT, got ''")
    cluster.resolve(args, p)  # what --slurm and --rendezvous imply (actor id, devices, addresses)
    if args.p2p == "ipc" and not args.ipc_dir:
        p.error("--p2p ipc needs --ipc-dir")
    if args.compile_workers < 1:
        p.error("--compile-workers must be at least 1")
    if args.kept_executables < 0:
        p.error(f"--kept-executables must be 0 or more, got {args.kept_executables}")
    if not 0 <= args.cache_max_mb < math.inf:  # (NaN too)
        p.error(f"--cache-max-mb must be 0 (no bound) or a positive, finite number of MiB, got {args.cache_max_mb}")
    for name in ("request_timeout", "compile_timeout", "transfer_timeout", "session_timeout", "rendezvous_timeout"):
        if not 0 < getattr(args, name) < math.inf:  # (NaN too)
            p.error(f"--{name.replace('_', '-')} must be a positive, finite number of seconds, got {getattr(args, name)}")
    if args.actor_id is not None and not 0 <= args.actor_id < 1 << 20:
        p.error(f"--actor-id must be 0-{(1 << 20) - 1}, got {args.actor_id}")
    if args.parent_pid is not None and args.parent_pid < 1:  # (0 was ignored; -1 "exists" for root: kill(-1, 0))
        p.error(f"--parent-pid takes the id of a running process (>= 1), got {args.parent_pid}")
    if args.parent_pid is not None:
        from transport.rendezvous import process_running

        if args.parent_pid >= 1 << 31 or not process_running(args.parent_pid):
            if args.mesh_dir is not None and args.actor_id is not None:  # (a replacement its controller did not live to see)
                _remove_mesh_files(args.mesh_dir, args.actor_id)
            p.error(f"--parent-pid {args.parent_pid}: no such process (the daemon would stop at once)")
    if args.mesh_dir is not None and not os.path.isdir(args.mesh_dir):
        p.error(f"--mesh-dir {args.mesh_dir} is not a directory")
    if args.cpu_devices is not None and not 1 <= args.cpu_devices <= 4096:
        p.error(f"--cpu-devices must be 1-4096, got {args.cpu_devices}")
    if args.listen is not None and not args.listen.startswith(("tcp://", "ipc://")):
        p.error(f"--listen takes tcp://host:port or ipc://path, got {args.listen!r}")
    for flag, value, free in (("--listen", args.listen, True), ("--rendezvous", getattr(args, "rendezvous", None), False)):
        if value is not None and value.startswith("tcp://"):
            rest = value[len("tcp://"):]
            port = rest.rpartition(":")[2] if ":" in rest else ""
            ok = port.isdigit() and (0 if free else 1) <= int(port) <= 65535 or free and port == "*"
            if not ok or not rest.rpartition(":")[0]:
                p.error(f"{flag} {value}: write tcp://HOST:PORT: the port must be {'0-65535 (0 or *: any free one)' if free else '1-65535'}"
                        f", got {'no port' if not port else repr(port)}")
    for name, most in (("max_message_mb", 1 << 20), ("max_unclaimed", 1 << 31), ("max_unclaimed_mb", 1 << 30),
                       ("guest_memory_mb", 1 << 30)):
        if not 1 <= getattr(args, name) <= most:
            p.error(f"--{name.replace('_', '-')} must be 1-{most}, got {getattr(args, name)}")
    from transport.protocol import LOADER_NAME

    for fn in args.allow_loader:
        if not LOADER_NAME.match(fn):
            p.error(f"--allow-loader takes a data loader named 'package.module:function', got {fn!r}")
        if fn.split(":", 1)[0] == "__main__":
            p.error(f"--allow-loader {fn}: a daemon's __main__ is the daemon itself; name the module the function is in")
    if args.cpus is not None and not re.fullmatch(r"\s*[0-9]+\s*(,\s*[0-9]+\s*)*,?\s*", args.cpus):
        p.error(f"--cpus takes core numbers separated by commas, e.g. 0,1, got {args.cpus!r}")
    return args


def configure_environment(args: argparse.Namespace) -> None:
    """Must run before JAX is imported: XLA reads these at start-up."""
    if args.cpus:
        try:
            cores = {int(c) for c in args.cpus.split(",") if c.strip()}
            os.sched_setaffinity(0, cores)
        except (ValueError, OSError) as e:
            raise SystemExit(f"mpmd-actor: cannot pin to cores {args.cpus!r}: {e}") from None
        if len(cores) == 1:  # (only --flags: XLA stops reading XLA_FLAGS at a word that is not one, e.g. a bare
            # "intra_op_parallelism_threads=1", and ignored the device count after it: actors of 1 device, not --cpu-devices)
            flags = os.environ.get("XLA_FLAGS", "")
            os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
    if args.cpu_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.platform:
        os.environ["JAX_PLATFORMS"] = args.platform
    if args.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.devices


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def keep_freed_memory() -> None:
    """glibc maps each allocation above its mmap threshold afresh and unmaps it when it is freed (and trims the
    heap's free top), so the activation and gradient buffers an actor allocates again every step came back as
    new zeroed pages: 1,000-1,300 page faults per step on each actor of the 2-actor 1F1B MLP. Buffers up to 32
    MiB now come from the heap, and up to 1 GiB of freed memory per malloc arena (XLA's, ZeroMQ's and the
    worker threads' each have one) stays there for the next step: a daemon's resident memory stays near its
    peak for its life. Only where glibc is the allocator; MPMD_MALLOC_KEEP=0 leaves glibc's defaults."""
    if os.environ.get("MPMD_MALLOC_KEEP", "1") == "0" or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc (musl, ...): its own allocator's defaults stay
        pass


def load_security(args: argparse.Namespace) -> tuple[object | None, dict[bytes, str]]:
    """(server key pair, {authorized public key: name}), or (None, {}) without keys; exits with a clear
    message on a bad combination, and refuses a non-loopback bind without keys unless --insecure."""
    from transport.auth import AuthKeyError, KeyPair, is_loopback, load_authorized_keys

    def fail(why: str) -> None:
        raise SystemExit(f"mpmd-actor: {why}")

    if args.keys_stdin:
        try:
            spec = json.loads(sys.stdin.readline())
            pair = KeyPair(spec["server_public"].encode(), spec["server_secret"].encode())
            authorized = {k.encode(): v for k, v in spec["authorized"].items()}
            args.owner_keys = frozenset(authorized.values())  # a local mesh's daemons are owned by its key
            return pair, authorized
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            fail(f"--keys-stdin: expected one JSON line with server_public, server_secret and authorized ({e})")
    if args.rendezvous and args.authorized_keys and not args.server_key and not args.insecure:
        try:  # the control socket's pair is made here, in memory; its public half is announced at the rendezvous
            return KeyPair.generate(), load_authorized_keys(args.authorized_keys)
        except AuthKeyError as e:
            fail(str(e))
    if bool(args.server_key) != bool(args.authorized_keys):
        fail("--server-key and --authorized-keys go together: the daemon's own key pair, and the directory of the "
             "controllers' public keys it admits (`mpmd keys generate DIR` makes both)")
    if args.server_key:
        if args.insecure:
            fail("--insecure and --server-key contradict each other; drop one")
        try:
            pair, authorized = KeyPair.load(args.server_key), load_authorized_keys(args.authorized_keys)
        except AuthKeyError as e:
            fail(str(e))
        unknown = sorted(set(args.admin_key) - set(authorized.values()))
        if unknown:
            fail(f"--admin-key {', '.join(unknown)}: no such key in --authorized-keys {args.authorized_keys} (it holds "
                 f"{sorted(authorized.values())}); an operator's public key goes there as NAME.key")
        return pair, authorized
    if args.admin_key:
        fail("--admin-key names a key in --authorized-keys; a daemon without keys has no operators (every client is alike)")
    if not args.insecure and not is_loopback(args.listen):  # (the data plane is authenticated with its own keys anyway)
        fail(f"refusing to listen on {args.listen} without authentication: anyone who can reach it could read and "
                 "overwrite this job's arrays and run code here. Give the daemon keys (`mpmd keys generate DIR`, then "
                 "--server-key DIR/mpmd.key_secret --authorized-keys DIR), or listen on loopback/ipc, or pass --insecure "
                 "if every machine that can reach this address is trusted")
    return None, {}


@contextlib.contextmanager
def _native_start() -> Iterator[None]:
    _STARTING["native"] = True
    try:
        yield
    finally:
        _STARTING["native"] = False
    if _STARTING["pending"] is not None:
        raise KeyboardInterrupt


async def serve(args: argparse.Namespace, server_pair: object | None, authorized: dict[bytes, str]) -> None:
    with _native_start():
        import jax
        import zmq
        import zmq.asyncio

        # Exported executables carry explicit dtypes, so 64-bit support only stops put() from narrowing
        # float64/int64 arrays; it changes nothing the controller lowered.
        jax.config.update("jax_enable_x64", True)
        if os.environ.get("MPMD_CPU_INLINE") == "1":  # (opt-in: see actors.stream.INLINE_CLIENT)
            from actors import stream

            jax.config.update("jax_cpu_enable_async_dispatch", False)
            stream.INLINE_CLIENT = True

        from actors import collector
        from actors.handlers import GOVERNING, Actor
        from actors.interpreter import failed_task
        from actors.request import HeldByLoader, RequestError, StepAborted, StillComputing, WaitedInVain, format_exception
        from actors.sandbox import ALLOWED_CUSTOM_CALLS, BlobChecker, CheckerPool
        from transport.auth import Authenticator, KeyPair, configure_server, user_id
        from transport.control import COMING_BYTES, COMING_LEAD, bind_failure, bind_router, tcp_endpoint
        from transport.p2p import DataPlane
        from transport.p2p.base import ArrivalLimits
        from transport.protocol import QUEUED_BEHIND_STEPS, ProtocolError, decode, encode, error_reply, message_id
        from transport.ratelimit import RateLimitedLog

    log = logging.getLogger("mpmd.actor")
    warn = RateLimitedLog(log)
    secure = server_pair is not None
    trusted_only = GOVERNING | {"compile"}  # (without keys, refused unless --insecure: any local user reaches the socket)
    if not secure and not args.insecure:
        log.warning("serving %s without authentication: any local user can reach it; %s and loader calls are refused "
                    "(give the daemon --server-key/--authorized-keys, or --insecure)", args.listen, ", ".join(sorted(trusted_only)))
    try:  # (an unknown --platform, or cuda on a machine without a GPU, fails here: say it in one line)
        with _native_start():  # (the backend's start: native too)
            jax.devices()
    except Exception as e:
        platform = args.platform or os.environ.get("JAX_PLATFORMS") or "(default)"
        # (JAX 0.10 says a bare AssertionError for cuda on a machine without its plugin or a GPU: no text to quote)
        why = (f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e).strip() else
               f"JAX could start no {platform} backend (is that device here, and its jaxlib plugin installed — for "
               f"cuda `pip install 'jax[cuda12]'`? `python -c 'import jax; print(jax.devices())'` with JAX_PLATFORMS={platform} shows JAX's own error)")
        raise SystemExit(f"mpmd-actor: JAX found no devices for --platform {platform}: {why}") from None
    _import_loaders(args.allow_loader)
    ctx = zmq.asyncio.Context.instance()
    auth = None
    if secure:
        auth = Authenticator(ctx, f"actor {args.actor_id} control socket", authorized)
        auth.start()
    max_bytes = args.max_message_mb * 1024 * 1024
    try:
        sock, endpoint = bind_router(ctx, args.listen, max_bytes, configure=(lambda s: configure_server(s, server_pair)) if secure else None)
    except zmq.ZMQError as e:
        raise SystemExit(f"mpmd-actor: cannot listen on {args.listen}: {bind_failure(args.listen, e)}") from None
    p2p = None
    if args.p2p != "none":
        host = args.p2p_host or (args.listen.split("://", 1)[1].rsplit(":", 1)[0] if args.listen.startswith("tcp://") else "127.0.0.1")
        if host in cluster.WILDCARDS:  # every interface: peers on other nodes dial this node's own address
            host = cluster.bindable(cluster.node_address())
        device = jax.devices()[0]
        from actors.buffers import release_host_memory

        try:
            p2p = DataPlane(args.actor_id, host, args.ipc_dir, nccl_device=device if device.platform == "gpu" else None,
                            release_hook=release_host_memory, keys=None if args.insecure else KeyPair.generate(),
                            tcp=args.p2p == "tcp", max_message_bytes=max_bytes,
                            limits=ArrivalLimits(args.max_unclaimed, args.max_unclaimed_mb * 1024 * 1024))
            await p2p.start()
        except (zmq.ZMQError, OSError) as e:
            sock.close(0)
            if auth is not None:
                auth.stop()
            why = bind_failure(tcp_endpoint(host, 0), e) if isinstance(e, zmq.ZMQError) else str(e)
            raise SystemExit(f"mpmd-actor: cannot start the data plane (--p2p {args.p2p}"
                             f"{f', --ipc-dir {args.ipc_dir}' if args.ipc_dir else ''}, host {host}): {why}") from None
    from actors.sandbox import warm_lowering

    # JAX's one-time lowering work, beside the rest of the start and the controller's first trace (see warm_lowering);
    # started once the daemon can no longer fail to start: an exit while the thread is inside JAX's C++ code aborted
    # the process (SIGABRT) after its message, which a launcher read as a crash (a review)
    threading.Thread(target=warm_lowering, name="mpmd-warm-lowering", daemon=True).start()
    # Compiles run in child processes (actors/sandbox.py) that write the executable into this compilation cache,
    # and the daemon loads it from there: --cache-dir, or a private directory that goes when the daemon does
    # (made once the daemon can no longer fail to start: an early exit left it behind).
    if args.cache_dir:
        compile_dir = args.cache_dir
        if args.cache_max_mb > 0:
            pruned = prune_compile_cache(compile_dir, int(args.cache_max_mb * 1024 * 1024))
            if pruned:
                log.info("removed %.1f MiB of least recently used entries from --cache-dir %s (--cache-max-mb %g)",
                         pruned / 2**20, compile_dir, args.cache_max_mb)
    else:
        _sweep_stale_compile_dirs(args.mesh_dir or tempfile.gettempdir())
        compile_dir, _held = _private_compile_dir(args.actor_id, args.mesh_dir)  # (the lock goes with the process)
    jax.config.update("jax_compilation_cache_dir", compile_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    checker = CheckerPool([BlobChecker(ALLOWED_CUSTOM_CALLS | frozenset(args.allow_custom_call), timeout=args.compile_timeout,
                                       devices=len(jax.devices())) for _ in range(args.compile_workers)])
    checker.compile_dir = compile_dir
    checker.checkers[0].adopt(getattr(args, "early_checker", None))
    args.early_checker = None  # (the checker's now: `_main` stops it only if the daemon ends before this line)
    actor = Actor(args.actor_id, p2p, transfer_timeout=args.transfer_timeout, checker=checker,
                  compile_timeout=args.compile_timeout, loaders=args.allow_loader)
    actor.cache.kept_unused = args.kept_executables
    if args.cache_max_mb > 0:  # (pruned at start only, a daemon serving job after job grew it without bound; a review)
        actor.cache.on_compiled = CompileCacheBound(compile_dir, int(args.cache_max_mb * 1024 * 1024)).wrote
    from actors.handlers import Ownership

    actor.ownership = Ownership(secure, getattr(args, "owner_keys", frozenset()), frozenset(args.admin_key))
    actor.guest_bytes = args.guest_memory_mb * 1024 * 1024
    actor.limits = {"request_timeout": args.request_timeout, "session_timeout": args.session_timeout, "compile_timeout": 2 * args.compile_timeout + COMPILE_GRACE,
                    "authenticated": secure, "insecure": args.insecure, "max_message_bytes": max_bytes}
    if p2p is not None:
        p2p.admit = lambda key: actor.admits_transfer(key)
        p2p.timeout_of = actor.transfers.timeout_of
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a fatal signal (SIGBUS, SIGSEGV) says where, in the log
    stop = asyncio.Event()
    actor.request_stop = stop.set  # (a shutdown put off until the daemon's last session ends)
    orphaned = asyncio.Event()
    loop = asyncio.get_running_loop()
    def stop_on(sig: int) -> None:  # (the log said nothing of why the daemon stopped; a probe)
        log.warning("stopping: %s received", signal.Signals(sig).name)
        stop.set()

    for sig in _stop_signals():
        loop.add_signal_handler(sig, stop_on, sig)

    async def reply(identity: bytes, frames: list) -> None:
        try:  # (never waits: a connection that leaves CONTROL_QUEUE replies unread loses the next ones, not the daemon)
            await sock.send_multipart([identity, *frames], copy=False, flags=zmq.DONTWAIT)
        except zmq.ZMQError as e:  # the controller went away (ROUTER_MANDATORY: host unreachable) or reads nothing
            if e.errno == zmq.EHOSTUNREACH:  # (gone: also what a normal close does to a reply still on its way, which
                log.info("could not reply to %r: %s (its controller is gone)", identity, e)  # a warning made look wrong)
            else:
                warn.warning("reply", "could not reply to %r: %s", identity, e)

    abandoned = Abandoned(args.actor_id)

    async def answer(msg, peer: str | None) -> tuple[dict, list]:
        """Run one request's handler within the request bound; a handler that is still busy then is cancelled
        (failing what it reserved) and the request gets an error instead."""
        bound, flag = ((2 * args.compile_timeout + COMPILE_GRACE, "--compile-timeout") if msg.op == "compile"
                       else (args.request_timeout, "--request-timeout"))
        deadline = asyncio.timeout(bound)
        before = actor.steps_running(msg.header.get("session")) if msg.op in QUEUED_BEHIND_STEPS else []
        clock = None
        try:
            async with deadline:
                if before:  # its time counts once the steps dispatched before it ended (see QUEUED_BEHIND_STEPS)
                    deadline.reschedule(None)
                    clock = loop.create_task(_start_clock(deadline, before, bound))
                try:
                    return await actor.handle(msg, peer)
                finally:
                    if clock is not None:
                        clock.cancel()
        except BaseException as e:
            if deadline.expired():
                loading = getattr(e, "loading", None) if msg.op == "run_program" else None
                still = abandoned.still_computing()
                computing = ""
                if not loading and not still and msg.op in ("run_program", "run", "get", "wait"):  # (what waits for computation)
                    if abandoned.cut_off(msg, actor.stream.marker()):
                        computing = (f"; actor {args.actor_id} was computing then (a Run dispatched here had not ended): XLA "
                                     "cannot stop a computation once it runs, so what runs here after it waits for it — give "
                                     "such steps a longer --request-timeout (RemoteMesh.local(request_timeout=...))")
                # (which actor computes, not only that one waited: the other actors' timeouts echo it; a probe saw five
                # steps blamed on actor 0's wait for actor 1, never naming actor 1)
                waits_for_runs = msg.op in ("run_program", "run", "get", "wait")  # (a put or compile is not held by a Run)
                kind = HeldByLoader if loading else StillComputing if (still and waits_for_runs or computing) else WaitedInVain
                raise kind(f"'{msg.op}' did not finish within {bound:g} s (mpmd-actor {flag}), so it was cancelled; "
                           f"{_waiting_on(msg, loading)}{still}{computing}") from None
            if isinstance(e, asyncio.CancelledError) and not asyncio.current_task().cancelling():
                # Not the daemon stopping: something the handler awaited went away.
                raise StepAborted(f"'{msg.op}' was cancelled: a buffer it waited for was deleted or its step aborted") from None
            raise

    async def handle(identity, frames: list) -> None:
        req_id = None
        peer = user_id(identity) if secure else None
        try:
            try:
                msg = decode(frames)
            except Exception:
                req_id = message_id(frames)  # a refused message's error reply still answers it, when it can be read
                raise
            req_id = msg.header.get("id")
            # (a loader call reads the job's data, wherever the daemon's user may read: a probe's keyless stranger had a
            # Program return its own loaded input)
            calls_loader = not (secure or args.insecure) and msg.op == "run_program" and bool(msg.header.get("loads"))
            if not (secure or args.insecure) and (msg.op in trusted_only or calls_loader):
                what = "a run_program that calls a loader" if calls_loader else repr(msg.op)
                raise RequestError(f"this daemon serves {what} only to an authenticated controller: start it with "
                                   "--server-key/--authorized-keys (RemoteMesh.local does that by itself), or with "
                                   "--insecure to trust whoever can reach its socket")
            if msg.op == "shutdown":
                # the job's owner, or an operator, in a session of its own; while other sessions are open only that
                # session closes (the reply says stopped: false)
                stopping = actor.authorize_shutdown(msg, peer)
                await reply(identity.bytes, encode({"op": "reply", "id": req_id, "ok": True, "stopped": stopping}))
                if stopping:
                    stop.set()
                return
            header, arrays = await answer(msg, peer)
            size = sum(int(a.nbytes) for a in arrays)
            if size >= COMING_BYTES:  # its bytes will hold the connection: say so first (transport/control.py)
                await reply(identity.bytes, encode({"op": "coming", "id": req_id, "nbytes": size}))
                # ... and let ZeroMQ's I/O thread write that notice alone. It fills a batch of output from every
                # message queued, encrypting each (CURVE) as it takes it: a notice queued together with a 1.5 GiB
                # reply left only once all of it was encrypted, 10-30 s on a loaded machine, and the controller
                # took the silence for a dead actor (a probe; 1 fetch in 3 with a 2.5 s heartbeat_timeout).
                await asyncio.sleep(COMING_LEAD)
            await reply(identity.bytes, encode({"op": "reply", "id": req_id, "ok": True, **header}, arrays))
        except asyncio.CancelledError:
            return  # the daemon is stopping
        except Exception as e:  # every failure becomes an error reply; the daemon keeps serving
            actor.errors += 1
            kind = "protocol" if isinstance(e, ProtocolError) else "request"
            warn.info(kind, "request %s failed: %s", req_id, str(e)[:300])
            try:
                task = failed_task(e)  # the Run that raised it, if one did
                # (a request refused as given says all in its message: its traceback is the daemon's own lines, which
                # read as a crash under the refusal: a probe)
                tb = "" if isinstance(e, RequestError) else format_exception(e)
                await reply(identity.bytes, encode(error_reply(req_id, e, tb, actor_id=args.actor_id,
                                                               **({"task": task} if task is not None else {}))))
            except Exception:  # an unencodable id or message: say it plainly
                await reply(identity.bytes, encode({"op": "error", "id": None, "error": "ProtocolError", "message": str(e)[:1000]}))

    tasks: set[asyncio.Task[None]] = set()
    in_flight: dict[bytes, int] = {}  # connection -> its requests being served

    def served(t: asyncio.Task[None], who: bytes) -> None:
        tasks.discard(t)
        n = in_flight.pop(who) - 1
        if n:
            in_flight[who] = n

    async def receive() -> None:
        while True:
            identity, *frames = await sock.recv_multipart(copy=False)
            who = identity.bytes
            total = sum(len(f) for f in frames[1:])  # the arrays (the header frame is bounded as a frame)
            if total > max_bytes:  # ZeroMQ drops a connection for one frame over the limit, not for many frames under it
                actor.errors += 1
                warn.info("too-big", "connection %r sent %d bytes of arrays in %d frames; refused", who, total, len(frames))
                req_id = message_id(frames)
                del frames  # (before the reply: the message's memory is let go at once)
                await reply(who, encode(error_reply(req_id, RequestError(
                    f"a request with {total} bytes of arrays is over actor {args.actor_id}'s --max-message-mb "
                    f"({max_bytes // 2**20} MiB): split it, or start the daemon with a larger --max-message-mb"), "",
                    actor_id=args.actor_id)))
                await asyncio.sleep(0)
                continue
            if in_flight.get(who, 0) >= MAX_IN_FLIGHT:  # a flood: answered at once, not queued behind the others' work
                actor.errors += 1
                warn.info("busy", "connection %r has %d requests in flight; refusing more", who, MAX_IN_FLIGHT)
                await reply(who, encode(error_reply(message_id(frames), RequestError(
                    f"{MAX_IN_FLIGHT} requests of this connection are still being served by actor {args.actor_id}; wait "
                    "for their replies before sending more"), "", actor_id=args.actor_id)))
                await asyncio.sleep(0)  # (neither the recv nor the reply suspends: the others' tasks get their turn)
                continue
            in_flight[who] = in_flight.get(who, 0) + 1
            t = loop.create_task(handle(identity, frames))
            tasks.add(t)
            t.add_done_callback(functools.partial(served, who=who))
            # A recv that finds a message waiting does not suspend: without this, a connection that keeps the
            # socket full (a flood) would hold the loop here, and no request's task would run, anyone's.
            await asyncio.sleep(0)

    async def expire_sessions() -> None:
        # A controller that was killed or cut off never says 'bye': its session would hold its buffers and its
        # key's claim on the daemon for good (16 killed controllers of one key locked that key out).
        while True:
            await asyncio.sleep(min(5.0, args.session_timeout / 4))
            for sid, owner, idle in actor.expire_sessions(args.session_timeout):
                log.warning("session %x of key %r: its controller said nothing for %.0f s (--session-timeout %g): closed, "
                            "with its buffers and programs", sid, owner, idle, args.session_timeout)

    async def poke() -> None:
        # Backstop against a lost wakeup: ZeroMQ signals its file descriptor edge-triggered; asking for the
        # socket's events makes pyzmq handle whatever is waiting.
        while True:
            await asyncio.sleep(0.25)
            sock.get(zmq.EVENTS)

    watcher = watch_parent(loop, args.parent_pid, orphaned, log) if args.parent_pid else None
    publication = None
    if args.rendezvous:  # announced once bound, before the ready line; refused or timed out: exit 1, said in the log
        args.announcing = True  # (from here a failure is the rendezvous's to tell, not `_main`'s report_failure)
        publication = await cluster.publish(args, endpoint, _p2p_address(p2p), server_pair, stop)
        if publication is None:
            args.exit_status = 1
            stop.set()
    collector.freeze()  # what the daemon keeps for its life, out of the collector's walks (actors/collector.py)
    if not stop.is_set():
        try:
            print(f"MPMD_ACTOR_READY {cluster.advertised(endpoint, args.p2p_host)} {_p2p_address(p2p)}", flush=True)
        except (BrokenPipeError, OSError):  # nobody reads it: the controller that started us is gone (cleaned up below)
            orphaned.set()
        # The ready line is stdout's only line: what is printed later (a loader's print) goes to the log. The launcher
        # stops reading the pipe after that line, so 64 KiB of prints blocked the loader's thread for good (a probe).
        try:
            sys.stdout.flush()
        except (BrokenPipeError, OSError):
            pass
        os.dup2(2, 1)
    receiver = loop.create_task(receive())
    poker = loop.create_task(poke())
    expirer = loop.create_task(expire_sessions())
    loop.create_task(_quietly(checker.start()))  # the checker imports JAX meanwhile, so the first compile need not wait
    orphan_wait = loop.create_task(orphaned.wait())
    await asyncio.wait({loop.create_task(stop.wait()), orphan_wait}, return_when=asyncio.FIRST_COMPLETED)
    receiver.cancel()
    poker.cancel()
    expirer.cancel()
    if publication is not None:
        publication.withdraw()
    if watcher is not None:
        watcher()
    for t in list(tasks):
        t.cancel()
    await asyncio.sleep(0)
    if orphaned.is_set():  # the controller that started us died (kill -9): the input segments it wrote that were never
        for ses in list(actor.sessions.values()):  # read are nobody's to unlink but ours (a probe found them for good)
            ses.inputs.sweep()
    for ses in list(actor.sessions.values()):  # (get segments written for a reply that never came, or was never read)
        ses.inputs.unlink_outputs(list(ses.inputs.written))
    checker.close()
    if not args.cache_dir:
        shutil.rmtree(compile_dir, ignore_errors=True)
    if p2p is not None:
        p2p.close()
        if args.ipc_dir:  # (its data-plane socket: nobody dials it again)
            try:
                os.unlink(os.path.join(args.ipc_dir, f"p2p-{args.actor_id}.sock"))
            except OSError:
                pass
    # A reply still queued (the shutdown's, above all) leaves before the process does: the close lingers and
    # `flush_replies` at exit waits for it, a second at most (with linger 0 the reply to `shutdown` was lost in 2
    # of 8 tries on a loaded machine: the client saw the daemon go without an answer).
    sock.close(linger=REPLY_LINGER_MS)
    if auth is not None:
        auth.stop()
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://") :])
        except OSError:
            pass
    if orphaned.is_set() and args.mesh_dir:
        _remove_mesh_files(args.mesh_dir, args.actor_id)


async def _start_clock(deadline: asyncio.Timeout, before: list[asyncio.Task], bound: float) -> None:
    """Start a queued request's bound once `before` (its session's steps running at its arrival) ended: each of them
    is bounded the same way, so the wait is too — at most `bound` per step before it, at worst."""
    await asyncio.wait(before, timeout=bound * len(before))
    deadline.reschedule(asyncio.get_running_loop().time() + bound)


class Abandoned:
    """The last computation a request bound cut off: XLA cannot stop one that runs, so an actor's Runs after it (this
    job's next steps, another job's) wait for it, and their own bounds ran out blaming themselves (a probe: a step
    cut off after 2 s computed for 2 more minutes while every later step and job failed "still running"). A later
    request that runs out while it still computes says so. (CPU actors: their Runs are ordered on a token to follow;
    a GPU actor's are not, and its errors say nothing more.)"""

    def __init__(self, actor_id: int) -> None:
        self.actor_id = actor_id
        self.token: object | None = None  # the order token of the last call dispatched when it was cut off (or the
        # future of a call off the loop still being dispatched: its token once it is)
        self.what = ""

    @staticmethod
    def _token_of(token: object | None) -> object | None:
        """The order token to follow: a call off the loop (its thread's future) once dispatched has its call's token
        (the future's result also holds the call's outputs, not to be kept alive here), else `token` itself."""
        if not isinstance(token, asyncio.Future) or not token.done():
            return token
        if token.cancelled() or token.exception() is not None:
            return None
        return token.result()[0]

    def _dispatched(self, fut: asyncio.Future) -> None:
        if self.token is fut:
            self.token = self._token_of(fut)

    @staticmethod
    def _computing(token: object | None) -> bool:
        """Whether the call whose order token this is still computes (None: calls not ordered on a token)."""
        if isinstance(token, asyncio.Future):  # (a call off the loop still being dispatched from its thread)
            return not token.done()
        try:
            return token is not None and not token.is_ready()
        except Exception:  # noqa: BLE001 - (a token whose computation failed is done)
            return False

    def cut_off(self, msg, token: object | None) -> bool:
        """`msg`'s request ran out while `token` (the last call dispatched) marks what still computes; whether it does."""
        token = self._token_of(token)
        if not self._computing(token):  # (nothing computing: nothing to follow)
            return False
        self.token = token
        if isinstance(token, asyncio.Future):
            token.add_done_callback(self._dispatched)
        what = f"program {msg.header.get('program')} step {msg.header.get('step')}" if msg.op == "run_program" else f"'{msg.op}'"
        self.what = (f"what was dispatched to it before {time.strftime('%H:%M:%S')}, when a request on it ran out ({what}, "
                     f"session {msg.header.get('session')!s:.20})")
        return True

    def still_computing(self) -> str:
        """What to add to a request's timeout error: '' unless the cut-off computation still runs."""
        if not self._computing(self.token):
            self.token = None
            return ""
        return (f"; this actor (actor {self.actor_id}) is still computing {self.what}: XLA cannot stop "
                "a computation once it runs, so what runs on this actor after it waits for it — wait for it to end, give "
                "such steps a longer mpmd-actor --request-timeout (RemoteMesh.local(request_timeout=...)), or restart the "
                "daemon")


def _waiting_on(msg, loading: str | None = None) -> str:
    if msg.op == "run_program" and loading:
        return (f"program {msg.header.get('program')} step {msg.header.get('step')} was waiting for its data loader: "
                f"{loading} had not returned (a loader that blocks holds the step; give it a timeout of its own)")
    bufs = msg.header.get("bufs") or ([msg.header["buf"]] if "buf" in msg.header else [])
    if msg.op in ("get", "wait") and isinstance(bufs, list) and bufs:
        return f"buffer(s) {bufs[:8]} were still being produced (is the step that makes them stuck?)"
    if msg.op == "run_program":
        return f"program {msg.header.get('program')} step {msg.header.get('step')} was still running; its outputs are failed"
    return "nothing it reserved is left reserved"


def _p2p_address(p2p) -> str:
    if p2p is None:
        return "-"
    ep = p2p.endpoint()
    return ep["tcp"] or ep["ipc"]


async def _quietly(coro) -> None:
    try:
        await coro
    except Exception as e:  # the checker restarts at the first compile; say why it did not start now
        logging.getLogger("mpmd.actor").warning("the compile checker did not start: %s", e)


def watch_parent(loop: asyncio.AbstractEventLoop, pid: int, gone: asyncio.Event, log: logging.Logger):
    """Set `gone` when process `pid` exits — also when it is left a zombie (a pidfd becomes readable at exit,
    where `kill(pid, 0)` would still succeed). Returns a function that stops watching."""

    def exited(why: str) -> None:
        log.warning("parent process %d %s; shutting down", pid, why)
        gone.set()

    from transport.rendezvous import process_running

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        loop.call_soon(exited, "is gone")
        return lambda: None
    except (AttributeError, OSError):  # no pidfd (old kernel, not Linux): poll the process state
        async def poll() -> None:
            while process_running(pid):
                await asyncio.sleep(0.5)
            exited("is gone")

        task = loop.create_task(poll())
        return task.cancel

    def on_readable() -> None:
        loop.remove_reader(fd)
        exited("has exited")

    loop.add_reader(fd, on_readable)

    def cancel() -> None:
        try:
            loop.remove_reader(fd)
        except (ValueError, OSError):
            pass
        os.close(fd)

    return cancel


def raise_open_files_limit() -> None:
    """Let the daemon hold as many connections as the system allows it (the soft limit up to the hard one): every
    connection to its sockets, a stranger's too until ZeroMQ drops it, is a file descriptor, and at the usual soft
    limit of 1024 a stranger's idle connections kept new controllers out."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20), hard))
    except (ImportError, ValueError, OSError) as e:
        logging.getLogger("mpmd.actor").debug("open-files limit left as it is: %s", e)


REPLY_LINGER_MS = 1000
# Requests one connection may have in flight at once (a controller dispatching steps far ahead stays well under:
# one request per actor per step); past it a request is refused at once, so that one key's flood (an admitted
# key that never reads its replies sent 6.5 million in 30 s) cannot queue without bound ahead of the others.
MAX_IN_FLIGHT = 4096


def flush_replies(wait_s: float = 2.0) -> None:
    """Let ZeroMQ send what closed sockets still hold (up to their linger) before the process exits: the
    context's term does that. Bounded by `wait_s`, in case a socket still open keeps term from returning."""
    import threading

    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    t = threading.Thread(target=ctx.term, name="mpmd-flush-replies", daemon=True)
    t.start()
    t.join(wait_s)


def main(argv: list[str] | None = None) -> None:
    _STARTING["native"] = True  # (held from here, as from the module's top under `python -m`: see _STARTING)
    _take_stop_signals()
    try:
        with _native_start():  # the native modules every start imports (the rest, JAX's, `serve` imports so)
            import msgpack  # noqa: F401
            import numpy  # noqa: F401
            import zmq  # noqa: F401
        _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while it starts (the signal handlers come later): no traceback
        sys.stderr.write("mpmd-actor: interrupted while starting\n")
        sys.stderr.flush()
        os._exit(130)
    except SystemExit as e:  # a refusal to start: its message and status, then out at once, as the normal end does (an
        # interpreter shutdown with JAX's threads still running can abort the process after the message)
        code = e.code
        if isinstance(code, str):
            sys.stderr.write(code + "\n")
        _flush_and_exit(code if isinstance(code, int) else (0 if code is None else 1))


def _flush_and_exit(status: int) -> None:
    """Out at once, with `status`, what is printed flushed: even if XLA is still running a computation nobody will read
    (the controller is gone or asked us to stop), which a normal interpreter exit would wait for, or abort in."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # (its reader is gone: a pipe the controller closed)
            pass
    os._exit(status)


def _checked_cache_dir(path: str) -> str:
    """--cache-dir, made (mode 700) where it does not exist yet, once it and every directory above it could have been
    written only by this user or root; exits saying why not. (Checking only a directory that already existed let
    one be made inside a world-writable one, whose other users could then swap in compiled code of their own.)"""
    from transport.auth import AuthKeyError, make_safe_dir

    given = os.path.expanduser(path)
    if os.path.lexists(given) and not os.path.isdir(given):
        raise SystemExit(f"mpmd-actor: --cache-dir {path} is not a directory; name a directory (made if missing) for "
                         "the compiled executables")
    try:
        make_safe_dir(given, "--cache-dir", holds="compiled code")
    except AuthKeyError as e:
        raise SystemExit(f"mpmd-actor: {e} (the daemon runs the executables it finds there)") from None
    except OSError as e:
        raise SystemExit(f"mpmd-actor: cannot make --cache-dir {path}: {e.strerror or e}") from None
    try:  # (an unwritable one was taken silently: every compile's entry failed to be written, which only the log said,
        # and the compile child's executables could not reach the daemon through it; a probe)
        fd, probe = tempfile.mkstemp(prefix=".mpmd-write-check-", dir=given)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SystemExit(f"mpmd-actor: --cache-dir {path} cannot be written ({e.strerror or e}): the compile child writes "
                         "each executable there for the daemon to load; name a directory this user can write (a read-only "
                         "cache made elsewhere: copy it to one; or leave --cache-dir out for a private one)") from None
    return given


def _main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    server_pair, authorized = load_security(args)
    if args.cache_dir:  # the daemon loads compiled machine code from it
        args.cache_dir = _checked_cache_dir(args.cache_dir)
    configure_environment(args)
    from actors.sandbox import spawn_early

    # The compile child's JAX import beside the daemon's own, where its device count is known before JAX is: a
    # CPU actor (a GPU actor's child is started when the daemon has counted its GPUs)
    args.early_checker = spawn_early(args.cpu_devices or 1) if os.environ.get("JAX_PLATFORMS") == "cpu" else None
    keep_freed_memory()
    raise_open_files_limit()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format=f"[actor {args.actor_id}] %(levelname)s %(name)s: %(message)s")
    # A path prefix: cProfile the event loop thread into <prefix>.<id>; MPMD_ACTOR_PROFILE_CPU=1 times it in the
    # thread's CPU time instead of wall time (which counts time the thread waited for the core as its own).
    profile_to = os.environ.get("MPMD_ACTOR_PROFILE")
    if profile_to:
        import cProfile
        import time

        profiler = cProfile.Profile(time.thread_time) if os.environ.get("MPMD_ACTOR_PROFILE_CPU") == "1" else cProfile.Profile()
        profiler.enable()
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    # Not asyncio.run: at the end it would join the worker threads, and one may be waiting for a computation
    # nobody will read (a `get` that timed out).
    try:
        try:
            loop.run_until_complete(serve(args, server_pair, authorized))
        except (SystemExit, Exception) as e:  # could not start: its controller, waiting at the rendezvous, is told why
            if getattr(args, "rendezvous", None) and not getattr(args, "announcing", False):
                why = e.code if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
                if isinstance(why, str):
                    loop.run_until_complete(cluster.report_failure(args, why.removeprefix("mpmd-actor: ")))
            raise
    finally:  # a daemon that ends before its checker took the early child (a bind failure, no devices) stops it (it
        # was left to exit at its stdin's end, in its own session: out of reach of a kill of the daemon's group; a review)
        early = getattr(args, "early_checker", None)
        if early is not None and early.proc.poll() is None:
            early.proc.kill()
            early.proc.wait()
    flush_replies()
    if profile_to:
        profiler.disable()
        profiler.dump_stats(f"{profile_to}.{args.actor_id}")
    _flush_and_exit(getattr(args, "exit_status", 0))


if __name__ == "__main__":
    main()
