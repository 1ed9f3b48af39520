"""Daemons placed, started and supervised by Ray (the `ray` extra: ``pip install 'mpmd[ray]'``). The daemon is
the same `mpmd-actor` process as everywhere else; Ray decides where it runs and watches it.

    ray.init()                                                      # or ray.init(address="auto") on a cluster
    mesh = mpmd.RemoteMesh.ray(num_actors=4, devices_per_actor=8)   # 4 daemons, 8 GPUs each, one per node

* **Placement.** A placement group reserves one bundle per actor — ``{"CPU": cpus_per_actor, "GPU":
  devices_per_actor}`` (GPU only on GPU clusters) updated with `resources_per_actor` — with
  `placement_strategy` ("SPREAD": one per node where possible; "STRICT_SPREAD", "PACK", "STRICT_PACK"). A
  group Ray cannot place within `placement_timeout` fails naming what was asked and what the cluster has.
* **Start.** One Ray actor (`DaemonHost`) per bundle spawns `mpmd-actor` as a subprocess watching the Ray
  actor's process (``--parent-pid``: the daemon exits when Ray kills its actor), reads its ready line and
  reports its endpoint. GPUs are Ray's to assign: the Ray actor asks for ``num_gpus``, Ray sets
  CUDA_VISIBLE_DEVICES in it, the daemon inherits that. CPU actors get ``devices_per_actor`` host devices.
* **Keys.** This controller makes its CURVE key pair in memory and sends each Ray actor only its *public*
  key. Each Ray actor makes its daemon's key pair on its own node and hands it to the daemon over a pipe (as a
  local mesh does), returning only the public half. No secret crosses the network, Ray's object store or a
  disk; Ray's channel carries public keys and addresses, and whoever controls that channel can already run
  code on the cluster through Ray.
* **Supervision.** Ray's view is the mesh's: a Ray actor that died (``ray.kill``, its node lost, its
  daemon's death) surfaces as `ActorDiedError` naming the actor and saying what Ray says.
* **Close.** `mesh.close()` shuts the daemons down, kills the Ray actors and removes the placement group.
"""

from __future__ import annotations

import glob
import inspect
import json
import logging
import math
import numbers
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mpmd.errors import ActorStartError, MpmdError
from mpmd.runtime.arguments import check_count, check_seconds
from mpmd.runtime.launch.local import (
    LOG_LEVELS,
    describe_exit,
    remove_shared_memory,
    said_stopped,
    socket_dir,
    terminate,
    usable_default_cache_dir,
)
from mpmd.runtime.launch.rendezvous import ActorFacts, check_compatible
from transport.auth import ClientKeys, KeyPair
from transport.rendezvous import process_running

log = logging.getLogger(__name__)
STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise MpmdError("RemoteMesh.ray needs Ray: pip install 'mpmd[ray]' (or pip install 'ray>=2.9')") from None
    return ray


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


OWNERS = "owners"  # in a daemon's directory: the pids of its Ray worker and of the daemon


def sweep_stale_dirs() -> None:
    """Remove the directories of daemons on this node whose Ray worker and daemon are both gone: a Ray actor
    killed (ray.kill, a lost node's restart) takes its daemon with it before either can remove its directory."""
    homes = {tempfile.gettempdir(), "/tmp"}  # (/tmp: where `socket_dir` puts them under a TMPDIR too long for sockets)
    for d in (d for home in sorted(homes) for d in glob.glob(os.path.join(home, "mpmd-ray-*"))):
        try:
            if os.stat(d).st_uid != os.getuid():
                continue
            with open(os.path.join(d, OWNERS)) as f:
                pids = [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue  # (not ours, being made, or from an older version: left alone)
        if pids and not any(process_running(p) for p in pids):
            shutil.rmtree(d, ignore_errors=True)


class DaemonHost:
    """The Ray actor that runs one `mpmd-actor` daemon on its node (made remote by `start`; runs in a Ray worker)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: str | None = None
        self.log_path = ""

    def start(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Spawn the daemon and wait for its ready line; return where it is and its public key."""
        import ray

        actor_id = int(spec["actor_id"])
        host = spec.get("host") or ray.util.get_node_ip_address()
        sweep_stale_dirs()
        self.dir = socket_dir("mpmd-ray-", f"p2p-{actor_id}.sock")  # mode 700: its ipc socket and log
        self.log_path = os.path.join(self.dir, f"actor{actor_id}.log")
        server = KeyPair.generate()  # made here, on the daemon's node; only the public half leaves
        assert server.secret is not None
        env = dict(os.environ)  # with Ray's CUDA_VISIBLE_DEVICES for the GPUs of this actor's bundle
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable, "-m", "actors.daemon", "--listen", _tcp(host, 0), "--actor-id", str(actor_id), "--p2p", "tcp",
               "--p2p-host", host, "--ipc-dir", self.dir, "--mesh-dir", self.dir, "--parent-pid", str(os.getpid()),
               "--log-level", str(spec.get("log_level", "WARNING")), "--keys-stdin"]
        if spec["platform"] == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            cmd += ["--cpu-devices", str(int(spec["devices"]))]
        else:
            env.pop("JAX_PLATFORMS", None)
        cache = spec.get("cache_dir")
        cache = usable_default_cache_dir() if cache is True else cache  # (this node's: its home may be another's)
        if cache:
            cmd += ["--cache-dir", str(cache)]
        cmd += [str(f) for f in spec.get("flags", ())]
        with open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                         start_new_session=True)
        with open(os.path.join(self.dir, OWNERS), "w") as f:  # (for `sweep_stale_dirs` once both are gone)
            f.write(f"{os.getpid()} {self.proc.pid}\n")
        keys = {"server_public": server.public.decode(), "server_secret": server.secret.decode(),
                "authorized": {str(spec["controller_key"]): "controller"}}
        assert self.proc.stdin is not None
        try:  # over the pipe: never on a command line, in Ray's object store or on disk
            self.proc.stdin.write(json.dumps(keys).encode() + b"\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        endpoint = self._wait_ready(time.monotonic() + float(spec.get("startup_timeout", 120.0)))
        return {"endpoint": endpoint, "key": server.public.decode(), "host": socket.gethostname(), "address": host,
                "pid": self.proc.pid, "node": ray.get_runtime_context().get_node_id(),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def _wait_ready(self, deadline: float) -> str:
        import selectors

        assert self.proc is not None and self.proc.stdout is not None
        line, eof = b"", False
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n") and time.monotonic() < deadline and self.proc.poll() is None:
                if sel.select(timeout=min(0.2, max(0.0, deadline - time.monotonic()))):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)
                    if not chunk:
                        eof = True
                        break
                    line += chunk
        text = line.decode(errors="replace").strip()
        if not text.startswith("MPMD_ACTOR_READY"):
            if eof:  # its output ended: it is exiting (reaped in a moment)
                try:
                    self.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            why = describe_exit(self.proc.returncode) if self.proc.poll() is not None else "did not report ready in time"
            tail = self._tail(2000).strip()
            raise RuntimeError(f"its daemon {why}" + (f"; its stderr:\n{tail}" if tail else " (its stderr is empty)"))
        return text.split()[1]

    def _tail(self, n: int) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def wait_exit(self) -> str:
        """Return when the daemon exits: how it did, with its stderr's tail."""
        assert self.proc is not None
        code = self.proc.wait()
        tail = self._tail(800).strip()
        return f"its daemon (pid {self.proc.pid}) {describe_exit(code)}" + (f"; stderr tail:\n{tail}" if tail else "")

    def stacks(self) -> str:
        """Every thread's stack of the daemon (SIGUSR1 makes it write them to its stderr)."""
        if self.proc is None or self.proc.poll() is not None:
            return "(none: its daemon is not running)"
        stopped = said_stopped(self.proc.pid)
        if stopped:
            return stopped
        start = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        os.kill(self.proc.pid, signal.SIGUSR1)
        time.sleep(0.3)
        with open(self.log_path, errors="replace") as f:
            f.seek(start)
            dump = f.read()[-6000:]
        return dump or "(none: it wrote nothing within 0.3 s of SIGUSR1)"

    def stop(self, timeout: float = 3.0) -> None:
        """Stop the daemon (if it still runs) and remove what it left on this node."""
        if self.proc is not None:
            terminate(self.proc, timeout)
            remove_shared_memory(self.proc.pid)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        sweep_stale_dirs()  # (those of siblings killed on this node: left until the next mesh started here; a probe)


class RayGroup:
    """The placement group of one mesh: removed once every Ray actor on it is stopped (or at `release_all`)."""

    def __init__(self, group: Any, name: str) -> None:
        self.group = group
        self.name = name
        self.live: set[int] = set()

    def release(self, actor_id: int) -> None:
        self.live.discard(actor_id)
        if not self.live:
            self.release_all()

    def release_all(self) -> None:
        if self.group is not None and not _ray().is_initialized():  # (ray.shutdown() removed it; Ray must not start again)
            self.group = None
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception as e:  # Ray already gone (ray.shutdown): nothing is left to remove
                log.debug("removing placement group %s: %s", self.name, e)
            self.group = None


class RayDaemon:
    """A daemon of a Ray mesh, as the mesh sees the daemons it owns: whether Ray says it died, its stacks, stop."""

    def __init__(self, actor_id: int, handle: Any, name: str, info: dict[str, Any], group: RayGroup) -> None:
        self.actor_id = actor_id
        self.handle = handle
        self.name = name
        self.info = info
        self.group = group
        self._exit = handle.wait_exit.remote()  # becomes ready when the daemon exits, or fails when Ray's actor dies
        self._dead: str | None = None
        group.live.add(actor_id)

    def dead_reason(self) -> str | None:
        """Why the daemon is gone, from Ray's view; None while Ray reports it running (cheap: asks nothing remote)."""
        if self._dead is None:
            ray = _ray()
            if not ray.is_initialized():  # (ray.wait would start a new local Ray: a step after ray.shutdown() hung, a
                # close started one and left its agents behind; a probe)
                self._dead = (f"Ray was shut down (ray.shutdown(), or the Ray cluster went away) while this mesh was open: "
                              f"its Ray actor {self.name}, and the daemon in it, are gone; close the mesh and make a new one")
                return self._dead
            ready, _ = ray.wait([self._exit], timeout=0)
            if not ready:
                return None
            try:
                self._dead = f"{ray.get(self._exit)} (inside Ray actor {self.name} on {self.info['host']})"
            except ray.exceptions.RayActorError as e:
                self._dead = f"Ray reports that its Ray actor {self.name} on {self.info['host']} died: {_ray_reason(e)}"
            except Exception as e:
                self._dead = f"Ray could not say what became of its Ray actor {self.name}: {e}"
        return self._dead

    def stacks(self) -> str:
        if not _ray().is_initialized():  # (a .remote() call would start a new local Ray)
            return "(none: Ray was shut down)"
        try:
            return _ray().get(self.handle.stacks.remote(), timeout=3)
        except Exception as e:
            return f"(could not get them through Ray: {type(e).__name__}: {str(e)[:300]})"

    def stop(self, timeout: float = 3.0) -> None:
        ray = _ray()
        if not ray.is_initialized():  # (ray.shutdown() came first: its actors are gone; a .remote() call would start a new Ray)
            self.group.live.discard(self.actor_id)
            return
        try:
            ray.get(self.handle.stop.remote(timeout), timeout=timeout + 5)
        except Exception:
            pass  # its Ray actor is dead already: killing it is all that is left
        try:
            ray.kill(self.handle)
        except Exception:
            pass
        self.group.release(self.actor_id)


def _cause(e: BaseException) -> str:
    """What went wrong in a Ray task, without Ray's wrapping: the remote exception's own text (a RayTaskError
    carries it as `cause`), else the last line of its message."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {str(cause).strip()[:1500]}"
    return _ray_reason(e)


def _ray_reason(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


@dataclass
class RayLaunch:
    """What `start` started: endpoints, the daemons' handles and the keys this controller authenticates with."""

    endpoints: list[str]
    daemons: list[RayDaemon]
    keys: ClientKeys
    group: RayGroup
    new_handle: Any = None  # new_handle(i) -> (a Ray actor in bundle i, its name): to start replacements
    specs: list[dict[str, Any]] | None = None

    def respawn(self, actor_id: int, timeout: float) -> tuple[str, RayDaemon, bytes]:
        """Start a replacement for daemon `actor_id`: kill its Ray actor (if Ray has not), start a new one in
        the same placement-group bundle and wait up to `timeout` seconds for its daemon. Returns its endpoint,
        its handle and its daemon's public key (`ActorStartError` when it does not come up)."""
        if self.new_handle is None or self.specs is None:
            raise ActorStartError("this RayLaunch cannot start replacements")
        ray = _ray()
        if not ray.is_initialized():  # (every Ray call below would start a new local Ray, with nothing of this mesh's)
            raise ActorStartError(f"no replacement for actor {actor_id}: Ray was shut down (ray.shutdown(), or the Ray "
                                  "cluster went away) while this mesh was open; close the mesh and make a new one")
        old = self.daemons[actor_id]
        try:  # (its daemon removes its directory when its Ray actor still answers; else the next start on that node does)
            ray.get(old.handle.stop.remote(1.0), timeout=3)
        except Exception:
            pass
        try:
            ray.kill(old.handle)
        except Exception:
            pass
        handle, name = self.new_handle(actor_id)
        try:
            info = ray.get(handle.start.remote({**self.specs[actor_id], "startup_timeout": timeout}), timeout=timeout + 30)
        except Exception as e:
            try:
                ray.kill(handle)
            except Exception:
                pass
            why = _ANSI.sub("", _ray_reason(e) if isinstance(e, ray.exceptions.RayActorError) else _cause(e))
            raise ActorStartError(f"no replacement for Ray actor {old.name} (actor {actor_id}) within {timeout:g} s: {why}") from None
        daemon = RayDaemon(actor_id, handle, name, info, self.group)
        self.daemons[actor_id] = daemon
        self.endpoints[actor_id] = info["endpoint"]
        return info["endpoint"], daemon, info["key"].encode()

    def cleanup(self) -> None:
        for d in self.daemons:
            d.stop()
        self.group.release_all()


def bundle_of(devices_per_actor: int, platform: str, cpus_per_actor: float,
              resources_per_actor: Mapping[str, float] | None) -> dict[str, float]:
    """One actor's placement-group bundle."""
    bundle: dict[str, float] = {"CPU": cpus_per_actor}
    if platform == "gpu":
        bundle["GPU"] = devices_per_actor
    extra = dict(resources_per_actor or {})
    if platform == "gpu" and "GPU" in extra and extra["GPU"] != devices_per_actor:
        raise ValueError(f"resources_per_actor asks for GPU={extra['GPU']} but devices_per_actor={devices_per_actor}: "
                         "an actor's devices are its GPUs; set devices_per_actor instead")
    bundle.update(extra)
    return {k: v for k, v in bundle.items() if v}


def start(num_actors: int, devices_per_actor: int = 1, resources_per_actor: Mapping[str, float] | None = None,
          placement_strategy: str = "SPREAD", *, platform: str = "auto", cpus_per_actor: float = 1,
          host: str | None = None, placement_timeout: float = 60.0, startup_timeout: float = 120.0,
          log_level: str = "WARNING", cache_dir: str | bool = True, runtime_env: Mapping[str, Any] | None = None,
          daemon_flags: Sequence[str] = ()) -> RayLaunch:
    """Reserve a placement group, start a daemon in a Ray actor per bundle, and wait until all are ready; on
    failure nothing is left (Ray actors killed, group removed). See the module docstring."""
    check_count("num_actors", num_actors)
    check_count("devices_per_actor", devices_per_actor)
    if isinstance(cpus_per_actor, bool) or not isinstance(cpus_per_actor, numbers.Real) or not 0 < cpus_per_actor < math.inf:
        raise ValueError(f"cpus_per_actor must be a positive number (Ray's CPU resource per actor), got {cpus_per_actor!r:.40}")
    if resources_per_actor is not None and (not isinstance(resources_per_actor, Mapping) or not all(
            isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool) and v >= 0
            for k, v in resources_per_actor.items())):
        raise ValueError(f"resources_per_actor must map Ray resource names to amounts >= 0 (e.g. {{'TPU': 1}}), got "
                         f"{resources_per_actor!r:.80}")
    if not isinstance(log_level, str) or log_level.upper() not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)} (the daemons' logging level), got {log_level!r:.40}")
    if placement_strategy not in STRATEGIES:
        raise ValueError(f"placement_strategy must be one of {STRATEGIES}, got {placement_strategy!r}")
    if platform not in ("auto", "cpu", "gpu"):
        raise ValueError(f"platform must be 'auto', 'cpu' or 'gpu', got {platform!r}")
    check_seconds("placement_timeout", placement_timeout)
    check_seconds("startup_timeout", startup_timeout)
    ray = _ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        _check_ray_address(os.environ.get("RAY_ADDRESS", ""))
        log.info("ray.init(): connecting to the Ray cluster of RAY_ADDRESS, or starting a local one")
        ray.init()
    if platform == "auto":
        platform = "gpu" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    bundle = bundle_of(devices_per_actor, platform, cpus_per_actor, resources_per_actor)
    token = secrets.token_hex(4)
    group = RayGroup(placement_group([dict(bundle) for _ in range(num_actors)], strategy=placement_strategy,
                                     name=f"mpmd-{token}"), f"mpmd-{token}")
    try:
        ray.get(group.group.ready(), timeout=placement_timeout)
    except BaseException as e:
        group.release_all()
        if isinstance(e, ray.exceptions.GetTimeoutError):
            raise ActorStartError(
                f"Ray could not reserve {num_actors} bundles of {bundle} ({placement_strategy}) within {placement_timeout:g} s: "
                f"the cluster has {_fmt(ray.cluster_resources())} in all, {_fmt(ray.available_resources())} free. Use fewer "
                "actors or smaller bundles (cpus_per_actor, resources_per_actor), a looser placement_strategy ('PACK'), or "
                "add nodes") from None
        raise
    client = KeyPair.generate()
    remote = ray.remote(DaemonHost)
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    handles, names = [], []
    daemons: list[RayDaemon] = []
    generation = [0]

    def new_handle(i: int) -> tuple[Any, str]:
        """A Ray actor in bundle i (a replacement gets a new name: the dead one's may not be free yet)."""
        name = f"mpmd-{token}-actor{i}" + (f"-r{generation[0]}" if generation[0] else "")
        return remote.options(
            name=name, num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), memory=bundle.get("memory"),
            resources=custom or None, max_concurrency=4, max_restarts=0, runtime_env=dict(runtime_env) if runtime_env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group.group, placement_group_bundle_index=i)).remote(), name

    try:
        for i in range(num_actors):
            handle, name = new_handle(i)
            names.append(name)
            handles.append(handle)
        specs = [{"actor_id": i, "host": host, "platform": platform, "devices": devices_per_actor, "log_level": log_level,
                  "cache_dir": cache_dir, "controller_key": client.public.decode(), "startup_timeout": startup_timeout,
                  "flags": list(daemon_flags)} for i in range(num_actors)]
        refs = [h.start.remote(s) for h, s in zip(handles, specs)]
        ray.wait(refs, num_returns=len(refs), timeout=startup_timeout + 30)
        infos, failures = [], []
        for i, ref in enumerate(refs):
            try:
                infos.append(ray.get(ref, timeout=0))
            except ray.exceptions.GetTimeoutError:
                failures.append(f"actor {i} ({names[i]}): not ready within {startup_timeout:g} s (startup_timeout)")
            except Exception as e:
                failures.append(f"actor {i} ({names[i]}): {_ray_reason(e) if isinstance(e, ray.exceptions.RayActorError) else _cause(e)}")
        if failures:
            raise ActorStartError(f"{len(failures)} of {num_actors} Ray actors did not start their daemon:\n  "
                                  + "\n  ".join(_ANSI.sub("", f) for f in failures))
        daemons = [RayDaemon(i, h, n, info, group) for i, (h, n, info) in enumerate(zip(handles, names, infos))]
    except BaseException:
        for h in handles:
            try:
                ray.get(h.stop.remote(), timeout=5)
            except Exception:
                pass
            try:
                ray.kill(h)
            except Exception:
                pass
        group.release_all()
        raise
    log.info("Ray mesh: %s", ", ".join(f"actor {d.actor_id} on {d.info['host']} ({d.info['endpoint']}"
                                      f"{', GPUs ' + d.info['gpus'] if d.info.get('gpus') else ''})" for d in daemons))
    keys = ClientKeys(client, tuple(d.info["key"].encode() for d in daemons))

    def replacement(i: int) -> tuple[Any, str]:
        generation[0] += 1
        return new_handle(i)

    return RayLaunch([d.info["endpoint"] for d in daemons], daemons, keys, group, replacement, specs)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # Ray colours its errors' text: not for an exception message


def _check_ray_address(address: str, timeout: float = 5.0) -> None:
    """`ray.init()` waits without end for a cluster that is not there: try RAY_ADDRESS's host:port first."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\]/]+?)\]?:(\d+)/?", address.strip())
    if m is None:
        return  # "", "auto", "local": Ray's own lookup
    try:
        socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout).close()
    except OSError as e:
        raise ActorStartError(f"RAY_ADDRESS={address!r} names no reachable Ray cluster ({e}): start it (`ray start --head`), "
                              "fix or unset RAY_ADDRESS, or call ray.init(...) yourself before RemoteMesh.ray") from None


def _fmt(resources: Mapping[str, float]) -> str:
    shown = {k: v for k, v in resources.items()  # (not Ray's own: a node's, the placement groups' CPU_group_<id>: a probe)
             if not k.startswith("node:") and k != "object_store_memory" and "_group_" not in k}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def connect(cls: Any, num_actors: int, devices_per_actor: int = 1, resources_per_actor: Mapping[str, float] | None = None,
            placement_strategy: str = "SPREAD", *, platform: str = "auto", cpus_per_actor: float = 1, host: str | None = None,
            placement_timeout: float = 60.0, startup_timeout: float = 120.0, log_level: str = "WARNING",
            cache_dir: str | bool = True, runtime_env: Mapping[str, Any] | None = None, recover: Any = None,
            daemon_flags: Sequence[str] = (), **kwargs: Any) -> Any:
    """`RemoteMesh.ray`: start (see there), connect, check that every daemon runs this controller's JAX on one platform.
    With `recover` (a `mpmd.Recovery`), a lost daemon is replaced by a new Ray actor in the same bundle."""
    taken = {"addresses", "processes", "keys"}  # (what the launch passes itself)
    params = inspect.signature(cls).parameters
    unknown = sorted(n for n in kwargs if n in taken or n not in params)
    if unknown:
        raise TypeError(f"RemoteMesh.ray got unexpected keyword argument(s) {', '.join(unknown)} (checked before any daemon "
                        f"starts); besides its launch options it takes RemoteMesh's: {', '.join(n for n in params if n not in taken)}")
    if runtime_env is not None and not isinstance(runtime_env, Mapping):  # (a bare ValueError from dict(): a probe)
        raise TypeError(f"runtime_env must be a dict of Ray's runtime environment (e.g. {{'pip': [...], 'env_vars': {{...}}}}), "
                        f"got {type(runtime_env).__name__} {runtime_env!r:.40}")
    if kwargs.get("transport") == "nccl" and platform == "cpu":  # (refused by the daemons only after they started)
        raise ValueError("transport='nccl' needs GPU actors: pass platform='gpu' (or 'auto' on a cluster with GPUs)")
    launch = start(num_actors, devices_per_actor, resources_per_actor, placement_strategy, platform=platform,
                   cpus_per_actor=cpus_per_actor, host=host, placement_timeout=placement_timeout,
                   startup_timeout=startup_timeout, log_level=log_level, cache_dir=cache_dir, runtime_env=runtime_env,
                   daemon_flags=daemon_flags)
    try:
        mesh = cls(launch.endpoints, launch.daemons, keys=launch.keys, **kwargs)
    except BaseException:
        launch.cleanup()
        raise
    try:
        check_compatible([ActorFacts(d.actor_id, f"{d.info['host']} (Ray actor {d.name})", info.header["jax_version"],
                                     info.header["platform"]) for d, info in zip(launch.daemons, mesh.infos)],
                         None if platform == "auto" else platform)
        if recover is not None:
            from mpmd.runtime.recovery import enable_recovery

            enable_recovery(mesh, recover, launch.respawn)
    except BaseException:
        mesh.close()
        raise
    return mesh


__all__ = ["DaemonHost", "RayDaemon", "RayGroup", "RayLaunch", "bundle_of", "connect", "start"]
