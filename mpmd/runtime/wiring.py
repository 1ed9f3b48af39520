"""Which data-plane route each pair of actors uses, decided once by the controller from the actors' `info`.

    transport="auto"   NCCL when every actor has GPUs (and NCCL), except between two actors on one GPU; otherwise
                       shared memory between actors on one host and TCP between hosts
    transport="tcp"    ZeroMQ frames for every pair (over ipc:// when both actors share a host)
    transport="shm"    shared memory where both actors share a host, TCP otherwise
    transport="nccl"   NCCL for every pair; an error if some actor cannot
    transport="none"   no data plane (single-actor work, or a second controller attached to live actors)
"""

from __future__ import annotations

from typing import Any

TRANSPORTS = ("auto", "tcp", "shm", "nccl", "none")


def choose_routes(transport: str, endpoints: list[dict[str, Any] | None]) -> dict[tuple[int, int], str]:
    """{(sender, receiver): route} for every ordered pair of distinct actors."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {TRANSPORTS}")
    if transport == "none":
        return {}
    for i, ep in enumerate(endpoints):
        if ep is None:
            raise ValueError(f"actor {i} was started without a data plane (--p2p none); start it with --p2p tcp, "
                             "or use transport='none'")
    if transport == "nccl":
        lacking = [i for i, ep in enumerate(endpoints) if not ep.get("nccl")]
        if lacking:
            raise ValueError(f"transport='nccl' needs GPU actors with NCCL (the 'gpu' extra); actors {lacking} have none. "
                             "Use transport='auto' to fall back to shm/tcp")
    all_nccl = all(ep.get("nccl") for ep in endpoints)
    routes = {}
    n = len(endpoints)
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            a, b = endpoints[i], endpoints[j]
            same_host = a.get("host") == b.get("host") and a.get("host") is not None
            gpu = shared_gpu(a, b)
            if transport == "nccl" and gpu is not None and not (a.get("gpu_shared") is True and b.get("gpu_shared") is True):
                raise ValueError(f"transport='nccl': actors {i} and {j} share one GPU ({gpu}), and NCCL refuses two ranks on one "
                                 "GPU. Use transport='shm' (or 'auto'), or give each actor its own GPU (gpu_ids=(0, 1, ...) "
                                 "with RemoteMesh.local); NCCL >= 2.30 allows it with NCCL_MULTI_RANK_GPU_ENABLE=1 in the actors")
            if transport == "nccl" or (transport == "auto" and all_nccl and gpu is None):
                route = "nccl"
            elif transport in ("shm", "auto") and same_host and a.get("shm") and b.get("shm"):
                route = "shm"
            else:
                route = "tcp"
            routes[(i, j)] = route
    return routes


def shared_gpu(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The physical GPU (PCI bus id) two actors' data planes both use, or None: NCCL refuses two ranks on one GPU
    ("Duplicate GPU detected"; RemoteMesh.local(gpu_ids=(0,)) puts every actor on GPU 0; a review)."""
    gpu = a.get("gpu")
    if isinstance(gpu, str) and gpu == b.get("gpu") and a.get("host") is not None and a.get("host") == b.get("host"):
        return gpu
    return None


def check_reachable(routes: dict[tuple[int, int], str], endpoints: list[dict[str, Any]]) -> None:
    """Refuse a tcp route to a loopback data-plane address on another host: its sender would dial its own
    machine, and every step would wait out the transfer timeout (a daemon told --listen tcp://0.0.0.0:PORT and no
    --p2p-host advertised 127.0.0.1; a probe)."""
    import ipaddress

    from mpmd.errors import MpmdError

    for (i, j), route in routes.items():
        a, b = endpoints[i], endpoints[j]
        if route != "tcp" or a.get("host") == b.get("host"):
            continue
        host = str(b.get("tcp", "")).split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            continue
        if loopback:
            raise MpmdError(f"actor {j}'s data plane is at {b.get('tcp')}, a loopback address, but actor {i} runs on another "
                            f"host ({a.get('host')} and {b.get('host')}) and cannot reach it there: start actor {j}'s "
                            "mpmd-actor with --p2p-host ADDRESS (an address of its node that the other nodes reach)")


def address_for(sender: dict[str, Any], receiver: dict[str, Any]) -> str:
    """The receiver's data-plane address as the sender should dial it: ipc on one host, tcp across hosts."""
    if sender.get("host") == receiver.get("host") and receiver.get("ipc"):
        return receiver["ipc"]
    return receiver["tcp"]


def peer_specs(routes: dict[tuple[int, int], str], endpoints: list[dict[str, Any]],
               nccl_ids: dict[tuple[int, int], list[int]]) -> list[dict[str, dict[str, Any]]]:
    """The `connect_peers` payload of every actor: {peer id (str): {address, route[, nccl_out, nccl_in]}}."""
    specs: list[dict[str, dict[str, Any]]] = [{} for _ in endpoints]
    for (i, j), route in routes.items():
        spec: dict[str, Any] = {"address": address_for(endpoints[i], endpoints[j]), "route": route}
        if route == "nccl":
            spec["nccl_out"], spec["nccl_in"] = nccl_ids[(i, j)], nccl_ids[(j, i)]
        specs[i][str(j)] = spec
    return specs


async def wire_data_plane(conns: list[Any], endpoints: list[dict[str, Any] | None], transport: str,
                          transfer_timeout: float) -> dict[tuple[int, int], str]:
    """Choose each pair's route, get NCCL ids from the senders that need them, and tell every actor its peers —
    their endpoints, data-plane public keys and shm names, over the authenticated control plane. `conns` are the
    mesh's actor connections; `endpoints` the `p2p` entry of each actor's `hello`. Returns the routes."""
    import asyncio

    from mpmd.errors import MpmdError

    secured = {i for i, ep in enumerate(endpoints) if ep and ep.get("key")}
    if secured and len(secured) != len(endpoints):
        raise MpmdError(f"actors {sorted(secured)} authenticate their data plane and actors "
                        f"{sorted(set(range(len(endpoints))) - secured)} do not (started with --insecure?): start all "
                        "daemons the same way")
    routes = choose_routes(transport, endpoints)
    check_reachable(routes, endpoints)
    ids: dict[tuple[int, int], list[int]] = {}
    senders = sorted({i for (i, _), r in routes.items() if r == "nccl"})
    if senders:
        outs = {i: sorted(j for (a, j), r in routes.items() if a == i and r == "nccl") for i in senders}
        replies = await asyncio.gather(*(conns[i].request("nccl_ids", {"count": len(outs[i])}) for i in senders))
        for i, msg in zip(senders, replies):
            ids.update({(i, j): uid for j, uid in zip(outs[i], msg.header["ids"])})
    specs = peer_specs(routes, endpoints, ids)
    for spec in specs:  # each actor learns its peers' data-plane keys (and shm names) from us, authenticated
        for j, peer in spec.items():
            ep = endpoints[int(j)]  # (a same-host pair's link is checked against the peer's process id)
            # (and the limit its data plane enforces: its --max-message-mb, which its hello says)
            peer.update(key=ep.get("key"), shm_prefix=ep.get("shm_prefix"), link=ep.get("link"), pid=ep.get("pid"),
                        max_message=conns[int(j)].max_message)
    await asyncio.gather(*(c.request("connect_peers", {"peers": specs[i], "timeout": transfer_timeout})
                           for i, c in enumerate(conns)))
    return routes
