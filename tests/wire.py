"""Raw ZeroMQ peers for tests that talk to real daemons the way a broken peer or an attacker would: raw
control requests (with or without keys), an authenticated stand-in data-plane peer, daemons started by hand."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import zmq

from transport.auth import ClientKeys, KeyPair
from transport.protocol import Message, decode, encode


def dealer(address: str, keys: ClientKeys | None = None, timeout_ms: int = 5000, client: KeyPair | None = None) -> zmq.Socket:
    """A DEALER to `address`; with `keys` a CURVE client (as `client`, when given, instead of keys.client)."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    # A DEALER whose only peer refused its handshake has no pipe between reconnects, and a send then blocks: bound
    # it too, so "no reply" is zmq.Again, never a hang.
    s.setsockopt(zmq.SNDTIMEO, timeout_ms)
    if keys is not None:
        pair = client or keys.client
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pair.public, pair.secret, keys.servers[0]
    s.connect(address)
    return s


def raw_request(address: str, header: dict | Sequence[bytes], keys: ClientKeys | None = None, timeout_ms: int = 5000,
                arrays: Sequence = ()) -> Message:
    """One request on a fresh socket; raises zmq.Again when it cannot be sent or no reply comes within `timeout_ms`."""
    s = dealer(address, keys, timeout_ms)
    try:
        s.send_multipart(encode(header, arrays) if isinstance(header, dict) else list(header))
        msg = decode(s.recv_multipart())
        while msg.op == "coming":  # (a reply of 16 MiB or more is announced first: transport/control.py)
            msg = decode(s.recv_multipart())
        return msg
    finally:
        s.close()


class FakePeer:
    """A data-plane peer that the test registers with one actor through the controller's `connect_peers`, the way
    the controller registers a real actor — so what it sends arrives authenticated as actor `peer_id`. It is a
    stand-in for a real actor whose messages are garbage (a real actor cannot be made to send garbage)."""

    def __init__(self, mesh, actor: int, peer_id: int = 7) -> None:
        self.peer_id = peer_id
        self.pair = KeyPair.generate()
        self.dir = tempfile.mkdtemp(prefix="mpmd-fakepeer-")
        self.inbox = zmq.Context.instance().socket(zmq.ROUTER)  # where the actor's `refused` notices come
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.curve_server, self.inbox.curve_secretkey, self.inbox.curve_publickey = True, self.pair.secret, self.pair.public
        self.inbox.bind(f"ipc://{self.dir}/inbox.sock")
        self.prefix = f"/mpmd-{os.getpid()}-fake{peer_id}-{peer_id}-"
        spec = {"address": f"ipc://{self.dir}/inbox.sock", "route": "tcp", "key": self.pair.public.decode(), "shm_prefix": self.prefix}
        mesh.run(mesh.conn(actor).request("connect_peers", {"peers": {str(peer_id): spec}}))
        target = mesh.infos[actor].header["p2p"]
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.curve_publickey, self.sock.curve_secretkey = self.pair.public, self.pair.secret
        self.sock.curve_serverkey = target["key"].encode()
        self.sock.connect(target["ipc"] or target["tcp"])

    def send(self, header: dict, arrays: Sequence = ()) -> None:
        self.sock.send_multipart(encode({"src": self.peer_id, **header}, arrays))

    def send_raw(self, frames: Sequence[bytes]) -> None:
        self.sock.send_multipart(list(frames))

    def close(self) -> None:
        self.sock.close()
        self.inbox.close()
        for f in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, f))
        os.rmdir(self.dir)


def start_daemon(*flags: str, env: dict | None = None, stdin: bytes | None = None) -> tuple[subprocess.Popen, str]:
    """An `mpmd-actor` subprocess with `flags`; returns it and its control endpoint (once it is ready). Its stderr
    goes to a temporary file (`proc.log`), removed by `stop_daemon`."""
    log = tempfile.NamedTemporaryFile(prefix="mpmd-test-daemon-", suffix=".log", delete=False)
    # --parent-pid: a daemon a failed test leaves behind exits with the test process.
    # One CPU device unless the flags say otherwise (the test process itself has four, see conftest.py).
    devices = [] if "--cpu-devices" in flags else ["--cpu-devices", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "actors.daemon", "--parent-pid", str(os.getpid()), *devices, *flags],
                            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.PIPE,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
    proc.log = log.name
    log.close()
    if stdin is not None:
        proc.stdin.write(stdin)
    proc.stdin.close()
    line = proc.stdout.readline().decode()
    if not line.startswith("MPMD_ACTOR_READY"):
        with open(proc.log, errors="replace") as f:
            err = f.read()[-2000:]
        stop_daemon(proc)
        raise RuntimeError(f"daemon did not start: {line!r}\n{err}")
    return proc, line.split()[1]


def stop_daemon(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout:
        proc.stdout.close()
    try:
        os.unlink(proc.log)
    except (AttributeError, OSError):
        pass


def alive(pid: int) -> bool:
    """Is `pid` a live process (a zombie is not)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
