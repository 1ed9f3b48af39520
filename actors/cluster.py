"""How a daemon started by a cluster's scheduler finds its place: SLURM's environment (``--slurm``) and the
rendezvous (``--rendezvous DIR`` or ``tcp://HOST:PORT``) where it announces itself to the controller.

    srun mpmd-actor --slurm --rendezvous ~/.mpmd/rdv/$SLURM_JOB_ID --authorized-keys ~/.mpmd/keys
    mpmd-actor --rendezvous tcp://controller:29500 --actor-id ${HOSTNAME##*-} --authorized-keys "$d"   # a StatefulSet: see examples/cluster

``--slurm`` takes the actor id from ``SLURM_PROCID``, the GPUs from SLURM's binding (`slurm_devices`), and binds
the node's address (`node_address`) on a free port. With ``--rendezvous`` and ``--authorized-keys DIR`` but no
``--server-key``, the daemon makes its control socket's key pair in memory when it starts and announces the
public half with its endpoint, so no daemon secret is ever written anywhere and no key is copied per node;
the controller authenticates with the pair whose public key is in DIR. The record format, the file layout
and the TCP messages are in transport/rendezvous.py.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("mpmd.actor")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The daemon's cluster flags."""
    p.add_argument("--slurm", action="store_true",
                   help="started by srun: the actor id is SLURM_PROCID, the GPUs are those SLURM bound to this task, the "
                        "control and data plane bind this node's address (default port: a free one with --rendezvous)")
    p.add_argument("--rendezvous", default=None, metavar="DIR|tcp://HOST:PORT",
                   help="announce this daemon's endpoint and public key there once it is ready: a directory every node sees "
                        "(mode 700, owned by you), or the TCP rendezvous the controller serves "
                        "(RemoteMesh.from_rendezvous); the controller then needs no address list")
    p.add_argument("--rendezvous-timeout", type=float, default=300.0,
                   help="seconds to wait for the TCP rendezvous to take this daemon's arrival before exiting")
    p.add_argument("--rendezvous-key", default=None, metavar="FILE",
                   help="TCP rendezvous: the key pair (*.key_secret) this daemon proves itself with (default: the one "
                        "pair in --authorized-keys DIR, i.e. the job's key from `mpmd keys generate DIR`)")


@dataclass(frozen=True)
class SlurmTask:
    """What SLURM's environment says about this task."""

    procid: int
    ntasks: int | None
    job_id: str | None
    localid: int | None
    local_tasks: int | None
    node_name: str | None


def slurm_task(environ: Mapping[str, str]) -> SlurmTask:
    """This task's place in its SLURM step; ValueError (saying what is missing) outside srun."""

    def number(name: str) -> int | None:
        value = environ.get(name)
        if value is None or value == "":
            return None
        if not value.isdigit():  # (int() also takes "1_0", " 3", "+2")
            raise ValueError(f"--slurm: {name}={value!r} is not a number")
        return int(value)

    procid = number("SLURM_PROCID")
    if procid is None:
        raise ValueError("--slurm: SLURM_PROCID is not set, so this is not a task of an srun step; start the daemons with "
                         "`srun mpmd-actor --slurm ...`, or give each its id with --actor-id N instead of --slurm")
    ntasks = number("SLURM_NTASKS")
    if ntasks is None:
        ntasks = number("SLURM_NPROCS")
    if ntasks == 0:
        raise ValueError("--slurm: SLURM_NTASKS=0: an srun step has at least one task")
    if ntasks is not None and not 0 <= procid < ntasks:
        raise ValueError(f"--slurm: SLURM_PROCID={procid} is not below SLURM_NTASKS={ntasks}")
    node = number("SLURM_NODEID")
    per_node = tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or "")
    local_tasks = per_node[node] if node is not None and node < len(per_node) else number("SLURM_NTASKS_PER_NODE")
    return SlurmTask(procid, ntasks, environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"), number("SLURM_LOCALID"),
                     local_tasks, environ.get("SLURMD_NODENAME"))


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed per-node task counts: ``"2(x3),1"`` is [2, 2, 2, 1]."""
    out: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return []
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def slurm_devices(environ: Mapping[str, str], task: SlurmTask) -> tuple[str | None, str]:
    """The GPUs this task should use, as a CUDA_VISIBLE_DEVICES value (None: leave the environment as it is),
    and why. SLURM binds GPUs per task when asked (``--gpus-per-task``, ``--gpu-bind``): then every task sees
    only its own and this keeps them. When the tasks of a node all see the node's GPUs (``--gres=gpu:N`` with
    several tasks per node and no binding), task SLURM_LOCALID takes its share: GPUs [l*k, (l+1)*k) of those
    listed, k = SLURM_GPUS_PER_TASK or the count divided by the node's tasks."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    source = "CUDA_VISIBLE_DEVICES"
    if not listed:
        for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
            if environ.get(name):
                listed, source = environ[name], name
                break
    if not listed:
        return None, "SLURM bound no GPUs to this task (JAX's default devices)"
    gpus = [g.strip() for g in listed.split(",") if g.strip()]
    per_task = None
    m = re.search(r"(\d+)$", environ.get("SLURM_GPUS_PER_TASK", ""))
    if m:
        per_task = int(m.group(1))
    local, mine = task.local_tasks or 1, task.localid or 0
    if local <= 1 or len(gpus) == per_task:
        keep = None if source == "CUDA_VISIBLE_DEVICES" else ",".join(gpus)
        return keep, f"GPUs {','.join(gpus)} ({source}: SLURM's binding of this task)"
    k = per_task or (len(gpus) // local if len(gpus) % local == 0 else 0)
    if k and (mine + 1) * k <= len(gpus):
        share = gpus[mine * k : (mine + 1) * k]
        return ",".join(share), (f"GPUs {','.join(share)}: local task {mine} of {local}'s share of {source}={listed} "
                                 f"({k} per task)")
    log.warning("%s=%s lists %d GPUs for %d tasks on this node: they are not split evenly, so this task keeps all of them "
                "(bind GPUs per task: srun --gpus-per-task=N)", source, listed, len(gpus), local)
    return (None if source == "CUDA_VISIBLE_DEVICES" else ",".join(gpus)), f"GPUs {','.join(gpus)} (shared with this node's other tasks)"


def node_address(environ: Mapping[str, str] = os.environ, toward: str | None = None) -> str:
    """The address other nodes reach this one on: the route's source address toward `toward` (the
    controller's host, for a TCP rendezvous), else the first non-loopback IPv4 address of this node's name
    (SLURMD_NODENAME, else the hostname), else the source address of the default route, else loopback."""
    if toward:
        found = _route_source(toward)
        if found:
            return found
    for name in filter(None, (environ.get("SLURMD_NODENAME"), socket.gethostname())):
        try:
            infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        for info in infos:
            addr = str(info[4][0])
            if not ipaddress.ip_address(addr).is_loopback:
                return addr
    found = _route_source("192.0.2.1")  # TEST-NET: only the routing table is asked, no packet is sent
    if found and not ipaddress.ip_address(found).is_loopback:
        return found
    log.warning("found no non-loopback address for this node; binding 127.0.0.1 (give --p2p-host ADDRESS)")
    return "127.0.0.1"


def _route_source(host: str) -> str | None:
    """The source address this node would use to reach `host` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            addr = str(s.getsockname()[0])
    except OSError:
        return None
    return None if addr == "0.0.0.0" else addr


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _host_of(endpoint: str) -> str:
    return endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]") if endpoint.startswith("tcp://") else ""


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ) -> None:
    """Fill in what --slurm and --rendezvous imply (actor id, devices, addresses) and refuse contradictions,
    before anything is bound; `parser.error` says what is wrong."""
    args.slurm_task = None
    toward = _host_of(args.rendezvous) if args.rendezvous and args.rendezvous.startswith("tcp://") else None
    if args.slurm:
        if args.actor_id is not None:
            parser.error("--slurm takes the actor id from SLURM_PROCID; drop --actor-id (or drop --slurm)")
        try:
            task = slurm_task(environ)
        except ValueError as e:
            parser.error(str(e))
        args.slurm_task, args.actor_id = task, task.procid
        if args.devices is None:
            args.devices, why = slurm_devices(environ, task)
            args.slurm_devices = why
    if args.rendezvous:
        from transport.rendezvous import other_scheme

        if other_scheme(args.rendezvous):
            parser.error(f"--rendezvous: {other_scheme(args.rendezvous)}")
        if args.actor_id is None:
            parser.error("--rendezvous needs this daemon's actor id: --actor-id N (in a StatefulSet: the pod's ordinal, "
                         "${HOSTNAME##*-}; in an Indexed Job: $JOB_COMPLETION_INDEX), or --slurm under srun")
        if not (args.authorized_keys or args.server_key or args.insecure or args.keys_stdin):
            parser.error("--rendezvous needs --authorized-keys DIR (the controllers allowed to drive this daemon: the "
                         "directory `mpmd keys generate DIR` made), or --insecure on a network you trust")
        if args.rendezvous.startswith("tcp://") and not args.insecure:
            if not (args.rendezvous_key or args.authorized_keys):
                parser.error("a TCP rendezvous needs --rendezvous-key FILE (or --authorized-keys DIR holding the job's pair)")
    if args.listen is None:
        if args.slurm or args.rendezvous:
            host = args.p2p_host or node_address(environ, toward)
            args.p2p_host = host
            # (without a rendezvous the controller is told the addresses: port 5555 + the task's place on its node, so
            # that two tasks of one node do not both take 5555: the second failed with 'Address already in use'; a probe)
            local = args.slurm_task.localid if args.slurm_task is not None and args.slurm_task.localid is not None else 0
            args.listen = _tcp(host, 0 if args.rendezvous else 5555 + local)
        else:
            args.listen = "tcp://127.0.0.1:5555"
    elif (args.slurm or args.rendezvous) and args.p2p_host is None and _host_of(args.listen) in WILDCARDS:
        args.p2p_host = node_address(environ, toward)
    if args.actor_id is None:
        args.actor_id = 0
    if args.actor_id < 0:
        parser.error(f"--actor-id must be >= 0, got {args.actor_id}")


WILDCARDS = ("*", "0.0.0.0", "::", "[::]")  # bind hosts meaning every interface: others dial this node's address


def bindable(address: str) -> str:
    """`address` if this machine can bind it (a hostname resolving to a stale, NAT or container-alias address cannot),
    else 127.0.0.1 with a warning (the controller then refuses it for peers on other hosts, naming --p2p-host)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return address
    except OSError as e:
        logging.getLogger("mpmd.actor").warning("this node's address %s cannot be bound here (%s): 127.0.0.1 is used "
                                                "instead; give --p2p-host ADDRESS for peers on other nodes", address, e)
        return "127.0.0.1"


def advertised(endpoint: str, host: str | None) -> str:
    """`endpoint` as others dial it (the ready line, the rendezvous arrival): a wildcard bind (0.0.0.0, *, ::) names
    `host`, else this node's address where it can be bound here."""
    if _host_of(endpoint) in WILDCARDS:
        return _tcp(host or bindable(node_address()), int(endpoint.rsplit(":", 1)[1]))
    return endpoint


class Publication:
    """This daemon's arrival at its rendezvous; `withdraw` removes it (file rendezvous) when the daemon exits."""

    def __init__(self, arrival: Any, directory: Path | None) -> None:
        self.arrival = arrival
        self.directory = directory

    def withdraw(self) -> None:
        if self.directory is not None:
            from transport.rendezvous import withdraw

            withdraw(self.directory, self.arrival)


async def publish(args: argparse.Namespace, endpoint: str, p2p_endpoint: str | None, server_pair: Any,
                  stop: asyncio.Event) -> Publication | None:
    """Announce this daemon at `args.rendezvous`; None (after logging why) if it was refused or timed out."""
    import jax

    from transport.rendezvous import (
        Arrival,
        ClaimedError,
        RendezvousDirectoryError,
        RendezvousFormatError,
        check_directory,
        claim,
        is_tcp,
    )

    task = args.slurm_task
    arrival = Arrival.new(actor_id=args.actor_id, endpoint=advertised(endpoint, args.p2p_host),
                          key=server_pair.public.decode() if server_pair is not None else None, host=socket.gethostname(),
                          pid=os.getpid(), jax_version=jax.__version__, platform=jax.devices()[0].platform,
                          devices=len(jax.devices()), p2p=p2p_endpoint, world_size=task.ntasks if task else None,
                          job=task.job_id if task else None)
    where = args.rendezvous
    try:
        if is_tcp(where):
            await register(where, arrival, args, stop)
            directory = None
        else:
            directory = check_directory(where, create=True)
            if await asyncio.to_thread(claim, directory, arrival):
                log.warning("replaced the arrival of a dead daemon for actor %d in %s", args.actor_id, directory)
    except (ClaimedError, RendezvousDirectoryError, RendezvousFormatError, RegistrationError, OSError) as e:
        log.error("mpmd-actor: actor %d could not announce itself at the rendezvous %s: %s", args.actor_id, where, e)
        return None
    log.info("actor %d announced at %s as %s%s", args.actor_id, where, arrival.endpoint,
             f"; {args.slurm_devices}" if getattr(args, "slurm_devices", None) else "")
    return Publication(arrival, directory)


class RegistrationError(RuntimeError):
    """The TCP rendezvous refused this daemon, or did not answer in time."""


def _rendezvous_keys(args: argparse.Namespace) -> tuple[Any, bytes] | None:
    """(this daemon's client pair, the rendezvous server's public key) for a TCP rendezvous; None if insecure."""
    from transport.auth import AuthKeyError, KeyPair, load_authorized_keys

    if args.insecure:
        return None
    try:
        pair = KeyPair.load(args.rendezvous_key or args.authorized_keys)
        # The controller serves the rendezvous with the job's pair, the one given here: with --rendezvous-key that pair's
        # public half is the server's, whatever else --authorized-keys admits (a second identity's key there refused the
        # rendezvous although the README offers the flag for it; a probe).
        servers = list(load_authorized_keys(args.authorized_keys)) if args.authorized_keys and not args.rendezvous_key else [pair.public]
    except AuthKeyError as e:
        raise RegistrationError(f"{e} (a TCP rendezvous needs the job's key pair: --rendezvous-key FILE, or "
                                "--authorized-keys DIR holding exactly one *.key_secret)") from None
    if len(servers) != 1:
        raise RegistrationError(f"--authorized-keys {args.authorized_keys} holds {len(servers)} public keys; a TCP rendezvous "
                                "is served with one (the controller's): name the job's pair with --rendezvous-key FILE "
                                "(its *.key_secret), keep one key there, or use a file rendezvous")
    return pair, servers[0]


async def register(address: str, arrival: Any, args: argparse.Namespace, stop: asyncio.Event) -> None:
    """Send `arrival` to the controller's TCP rendezvous and wait for its answer (within --rendezvous-timeout)."""
    from transport.rendezvous import encode_message

    msg = await _exchange(address, encode_message("arrive", arrival=arrival.to_dict()), args, stop, args.rendezvous_timeout)
    if msg["op"] != "welcome":
        raise RegistrationError(str(msg.get("error", msg))[:2000])


async def report_failure(args: argparse.Namespace, error: str) -> None:
    """Tell the rendezvous that this daemon could not start, and why (see transport/rendezvous.py), so that its
    controller stops waiting for it; best effort, within a few seconds (the daemon exits either way)."""
    from transport.rendezvous import (
        Failure,
        RendezvousDirectoryError,
        check_directory,
        encode_message,
        is_tcp,
        record_failure,
    )

    failure = Failure.new(args.actor_id, error)
    try:
        if is_tcp(args.rendezvous):
            await _exchange(args.rendezvous, encode_message("failed", failure=failure.to_dict()), args, asyncio.Event(),
                            min(5.0, args.rendezvous_timeout))
        else:
            await asyncio.to_thread(record_failure, check_directory(args.rendezvous, create=True), failure)
    except (RegistrationError, RendezvousDirectoryError, OSError) as e:
        log.warning("could not tell the rendezvous %s that this daemon could not start: %s", args.rendezvous, e)


async def _exchange(address: str, frame: bytes, args: argparse.Namespace, stop: asyncio.Event, timeout: float) -> dict[str, Any]:
    """One message to the TCP rendezvous at `address` and its answer (within `timeout` s), over CURVE with the job's key."""
    import zmq
    import zmq.asyncio
    from zmq.utils.monitor import parse_monitor_message

    from transport.auth import configure_client
    from transport.control import allow_ipv6
    from transport.rendezvous import RendezvousFormatError, decode_message

    keys = _rendezvous_keys(args)
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        configure_client(sock, *keys)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                      | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        allow_ipv6(sock, address)
        sock.connect(address)
        await sock.send(frame)
        reply = asyncio.ensure_future(sock.recv())
        refused = asyncio.ensure_future(monitor.recv_multipart())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait({reply, refused, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (reply, refused, stopped):
                f.cancel()
        if reply in done:
            try:
                return decode_message(reply.result())
            except RendezvousFormatError as e:
                raise RegistrationError(f"the rendezvous answered something unreadable: {e}") from None
        if refused in done:
            event = parse_monitor_message(refused.result())["event"]
            raise RegistrationError(f"the rendezvous at {address} and this daemon do not hold the same key (ZeroMQ "
                                    f"{zmq.Event(event).name}): start the controller with keys= the directory this daemon's "
                                    "--authorized-keys names")
        if stopped in done:
            raise RegistrationError("stopped while waiting for the rendezvous")
        raise RegistrationError(f"no answer from the rendezvous at {address} within {timeout:g} s "
                                "(--rendezvous-timeout): is the controller running RemoteMesh.from_rendezvous there, and "
                                "can this node reach it?")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
