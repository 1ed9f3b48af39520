"""The controller's choice of data-plane route per actor pair (mpmd/runtime/wiring.py), from actors' endpoint info alone."""

import pytest

from mpmd.errors import MpmdError
from mpmd.runtime.wiring import address_for, check_reachable, choose_routes, peer_specs


def ep(host, nccl=False, i=0):
    return {"tcp": f"tcp://{host}:{5000 + i}", "ipc": f"ipc:///tmp/{host}-{i}.sock", "host": host, "shm": True, "nccl": nccl}


def test_auto_uses_shared_memory_on_one_host_and_tcp_across_hosts():
    eps = [ep("a", i=0), ep("a", i=1), ep("b", i=2)]
    routes = choose_routes("auto", eps)
    assert routes[(0, 1)] == routes[(1, 0)] == "shm"
    assert {routes[(0, 2)], routes[(2, 0)], routes[(1, 2)], routes[(2, 1)]} == {"tcp"}
    assert address_for(eps[0], eps[1]) == eps[1]["ipc"] and address_for(eps[0], eps[2]) == eps[2]["tcp"]


def test_auto_uses_nccl_only_when_every_actor_has_it():
    assert set(choose_routes("auto", [ep("a", True, 0), ep("b", True, 1)]).values()) == {"nccl"}
    assert choose_routes("auto", [ep("a", True, 0), ep("a", False, 1)]) == {(0, 1): "shm", (1, 0): "shm"}


def test_explicit_choices_and_their_errors():
    eps = [ep("a", i=0), ep("a", i=1)]
    assert set(choose_routes("tcp", eps).values()) == {"tcp"}
    assert choose_routes("none", eps) == {}
    assert set(choose_routes("shm", [ep("a"), ep("b", i=1)]).values()) == {"tcp"}  # shm needs one host
    with pytest.raises(ValueError, match=r"actors \[1\] have none"):
        choose_routes("nccl", [ep("a", True), ep("a", False, 1)])
    with pytest.raises(ValueError, match="unknown transport 'udp'"):
        choose_routes("udp", eps)
    with pytest.raises(ValueError, match="actor 1 was started without a data plane"):
        choose_routes("auto", [eps[0], None])


def test_nccl_peer_specs_pair_each_direction_with_its_own_unique_id():
    eps = [ep("a", True, 0), ep("b", True, 1)]
    routes = choose_routes("nccl", eps)
    ids = {(0, 1): [1] * 128, (1, 0): [2] * 128}
    specs = peer_specs(routes, eps, ids)
    assert specs[0]["1"]["nccl_out"] == specs[1]["0"]["nccl_in"] == [1] * 128
    assert specs[1]["0"]["nccl_out"] == specs[0]["1"]["nccl_in"] == [2] * 128
    assert specs[0]["1"]["address"] == eps[1]["tcp"]


def test_a_loopback_data_plane_on_another_host_is_refused_naming_p2p_host():
    """A daemon told --listen tcp://0.0.0.0:PORT without --p2p-host advertised tcp://127.0.0.1: its peers on other
    nodes would dial their own machine and every step wait out the transfer timeout (a probe). Such a daemon now
    advertises its node's address; a loopback address across hosts is refused at wiring, on one host it is fine."""
    remote_loop = {"tcp": "tcp://127.0.0.1:5001", "host": "b", "shm": True}
    eps = [ep("a", i=0), remote_loop]
    with pytest.raises(MpmdError, match=r"actor 1's data plane is at tcp://127.0.0.1:5001, a loopback address.*--p2p-host"):
        check_reachable(choose_routes("auto", eps), eps)
    same = [{**ep("a", i=0), "tcp": "tcp://127.0.0.1:5000"}, {**remote_loop, "host": "a"}]
    check_reachable(choose_routes("tcp", same), same)  # (one host: loopback reaches it)
    check_reachable(choose_routes("auto", [ep("a", i=0), ep("b", i=1)]), [ep("a", i=0), ep("b", i=1)])
    for local in ("tcp://[::1]:5001", "tcp://localhost:5001"):
        eps = [ep("a", i=0), {**remote_loop, "tcp": local}]
        with pytest.raises(MpmdError, match="loopback"):
            check_reachable(choose_routes("auto", eps), eps)


def test_the_wiring_tells_each_actor_its_peers_message_limit_from_their_hello():
    """A sender refuses a frame over its peer's --max-message-mb (ZeroMQ would drop it unseen); the wiring tells it
    each peer's limit as that peer's hello said it (the limit its data plane enforces). (Stand-in connections that
    record the request: the wiring's input and output, without daemons.)"""
    import asyncio

    from mpmd.runtime.wiring import wire_data_plane

    class Conn:
        def __init__(self, most):
            self.max_message, self.sent = most, None

        async def request(self, op, fields):
            self.sent = (op, fields)

    conns = [Conn(64 << 20), Conn(1 << 20), Conn(None)]
    endpoints = [{"tcp": f"tcp://10.0.0.{i}:5000", "host": f"h{i}", "shm": False, "nccl": False} for i in range(3)]
    asyncio.run(wire_data_plane(conns, endpoints, "tcp", 30.0))
    op, fields = conns[2].sent
    assert op == "connect_peers" and {j: p["max_message"] for j, p in fields["peers"].items()} == {"0": 64 << 20, "1": 1 << 20}
    assert conns[0].sent[1]["peers"]["2"]["max_message"] is None  # (its hello said none: no check)
