"""Authentication and trusted input, against real daemons on loopback: CURVE keys on the control plane and the
data plane, refused binds, sessions tied to keys, shared-memory notices, unclaimed-arrival limits, and what
reaches the compiler."""

import asyncio
import json
import os
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zmq
from jax import export

import mpmd
from actors.sandbox import ALLOWED_CUSTOM_CALLS, custom_call_targets
from actors.signatures import SignatureChecker
from mpmd import keys_cli
from mpmd.compiler.program import Label, Program, Recv
from mpmd.runtime.controller import ActorAuthError
from tests.wire import FakePeer, dealer, raw_request, start_daemon, stop_daemon, wait_until
from transport.auth import AuthKeyError, ClientKeys, KeyPair, check_safe_path, generate_key_files
from transport.protocol import encode

try:
    import _posixshmem
except ImportError:  # pragma: no cover
    _posixshmem = None


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A daemon with a server key, admitting the controller keys 'alice' and 'bob' (files made as a user would)."""
    d = tmp_path_factory.mktemp("keys")
    generate_key_files(d, "server")
    generate_key_files(d / "authorized", "alice")
    generate_key_files(d / "authorized", "bob")
    proc, address = start_daemon("--listen", "tcp://127.0.0.1:0", "--p2p", "none", "--server-key", str(d / "server.key_secret"),
                                 "--authorized-keys", str(d / "authorized"))
    server = d / "server.key"
    yield type("Keyed", (), {"address": address, "proc": proc, "dir": d,
                             "alice": ClientKeys.load(d / "authorized" / "alice.key_secret", server),
                             "bob": ClientKeys.load(d / "authorized" / "bob.key_secret", server)})
    stop_daemon(proc)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One daemon with a data plane and small limits (50 unclaimed arrivals per peer), driven by a controller
    whose keys the test made and handed over a pipe, as a local mesh does."""
    server, client = KeyPair.generate(), KeyPair.generate()
    keys = json.dumps({"server_public": server.public.decode(), "server_secret": server.secret.decode(),
                       "authorized": {client.public.decode(): "controller"}}).encode() + b"\n"
    d = tmp_path_factory.mktemp("single")
    proc, address = start_daemon("--listen", f"ipc://{d}/a.sock", "--p2p", "ipc", "--ipc-dir", str(d), "--keys-stdin",
                                 "--max-unclaimed", "50", "--transfer-timeout", "30", stdin=keys)
    mesh = mpmd.RemoteMesh([address], keys=ClientKeys(client, (server.public,)), transport="none")
    yield mesh
    mesh.close()
    stop_daemon(proc)


def test_keys_generate_makes_its_directory_755_under_any_umask_and_never_writes_through_a_link(tmp_path, capsys):
    """Under umask 000 the key directory came out 777, which every daemon then refused; `--force` over a
    symbolic link wrote the secret key into the link's target (a probe). Both before either file is written."""
    old = os.umask(0)
    try:
        assert keys_cli.main(["keys", "generate", str(tmp_path / "a" / "k")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == stat.S_IMODE((tmp_path / "a" / "k").stat().st_mode) == 0o755
    check_safe_path(tmp_path / "a" / "k", "key directory")  # what a daemon checks of --authorized-keys
    old = os.umask(0o077)  # a stricter umask's choice stays (a review: it was forced to 755)
    try:
        assert keys_cli.main(["keys", "generate", str(tmp_path / "strict")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "strict").stat().st_mode) == 0o700
    (tmp_path / "victim").write_text("mine")
    links = tmp_path / "links"
    links.mkdir()
    os.symlink(tmp_path / "victim", links / "mpmd.key_secret")
    assert keys_cli.main(["keys", "generate", str(links), "--force"]) == 1
    assert (tmp_path / "victim").read_text() == "mine" and sorted(p.name for p in links.iterdir()) == ["mpmd.key_secret"]
    with pytest.raises(AuthKeyError, match="is a symbolic link .*remove the link"):
        generate_key_files(links, overwrite=True)
    capsys.readouterr()
    assert keys_cli.main(["keys", "generate", "/proc/keys_here"]) == 1  # (a bare "[Errno 2] ..." before; a probe)
    assert "mpmd keys generate: cannot write a key pair in /proc/keys_here: " in capsys.readouterr().err
    (tmp_path / "a.svg").write_text("x")  # a file where the directory goes: said so (a bare "[Errno 17] File exists")
    capsys.readouterr()
    assert keys_cli.main(["keys", "generate", str(tmp_path / "a.svg")]) == 1
    assert "a.svg is a file, not a directory" in capsys.readouterr().err


def test_mpmd_actor_refuses_an_endpoint_that_is_not_utf8_in_one_line():
    """A non-UTF-8 --listen / --ipc-dir / --p2p-host ended in a traceback from zmq's bind (a probe)."""
    bad = "ipc:///tmp/x" + b"\xff".decode("utf-8", "surrogateescape") + ".sock"
    for option in ("--listen", "--ipc-dir", "--p2p-host"):
        r = subprocess.run([sys.executable, "-m", "actors.daemon", option, bad], capture_output=True, text=True, timeout=60,
                           errors="surrogateescape")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"argument {option}:" in r.stderr and "is not valid UTF-8" in r.stderr


def test_keys_generate_writes_a_pair_only_its_owner_can_read_and_loading_checks_it(tmp_path):
    assert keys_cli.main(["keys", "generate", str(tmp_path / "k")]) == 0
    public, secret = tmp_path / "k" / "mpmd.key", tmp_path / "k" / "mpmd.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pair = KeyPair.load(tmp_path / "k")  # a directory with one pair
    assert pair.secret is not None and KeyPair.load(secret) == pair
    assert keys_cli.main(["keys", "generate", str(tmp_path / "k")]) == 1  # never overwrites a pair by accident
    assert KeyPair.load(secret) == pair
    os.chmod(secret, 0o644)
    with pytest.raises(AuthKeyError, match="can be read by other users.*chmod 600"):
        KeyPair.load(secret)
    # The public file as generated (mode 644) given where the pair belongs: it said to chmod 600 it (a probe).
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    with pytest.raises(AuthKeyError, match=rf"only a public key; pass the \*.key_secret file that holds the pair \(here: {secret}\)"):
        KeyPair.load(public)
    # Into a directory other users may write, generate refuses at once (it wrote a pair and printed a daemon
    # command line that the daemon then refused, found by a probe).
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert keys_cli.main(["keys", "generate", str(shared)]) == 1 and not list(shared.iterdir())
    # ... and into a directory it would make inside one (it wrote the pair there, a probe)
    assert keys_cli.main(["keys", "generate", str(shared / "k")]) == 1 and not list(shared.iterdir())
    # an empty directory name is refused, not taken as the working directory (a probe)
    with pytest.raises(SystemExit) as e:
        keys_cli.main(["keys", "generate", ""])
    assert e.value.code == 2
    # `--name` makes another pair beside the first (as `mpmd keys --help` shows): the directory's own pair,
    # mpmd.key_secret, is still what keys=DIR means (it was refused as ambiguous, breaking the documented
    # connect(..., keys=DIR); a probe). Two pairs of which neither is the directory's own name the choice to make
    # (it said to make one with `mpmd keys generate DIR`, which then refused: the pair exists; a probe).
    os.chmod(secret, 0o600)
    assert keys_cli.main(["keys", "generate", str(tmp_path / "k"), "--name", "node3"]) == 0
    assert KeyPair.load(tmp_path / "k") == pair != KeyPair.load(tmp_path / "k" / "node3.key_secret")
    for name in ("alice", "bob"):
        assert keys_cli.main(["keys", "generate", str(tmp_path / "two"), "--name", name]) == 0
    with pytest.raises(AuthKeyError, match=r"2 secret key files .* ambiguous; name the file, e.g. keys='.*alice.key_secret'"):
        KeyPair.load(tmp_path / "two")


def test_the_right_key_works_and_wrong_or_missing_keys_are_refused_without_affecting_the_job(keyed):
    with mpmd.RemoteMesh.connect([keyed.address], keys=keyed.alice, transport="none") as mesh:
        x = mesh.actor(0).put(np.arange(5, dtype=np.float32))
        y = mesh.actor(0).run(jax.jit(lambda a: a * 3.0), x)
        stranger = ClientKeys(KeyPair.generate(), keyed.alice.servers)
        with pytest.raises(ActorAuthError, match="refused this client's key"):
            mpmd.RemoteMesh.connect([keyed.address], keys=stranger, transport="none")
        with pytest.raises(ActorAuthError, match="public key is not the one given"):
            mpmd.RemoteMesh.connect([keyed.address], keys=ClientKeys(keyed.alice.client, (KeyPair.generate().public,)),
                                    transport="none")
        with pytest.raises(ActorAuthError, match="this client has no keys"):
            mpmd.RemoteMesh.connect([keyed.address], transport="none")
        # A raw client without keys asking for the job's buffer, or to shut the daemon down, gets nothing at all.
        for header in ({"op": "get", "id": 1, "session": mesh.session, "buf": x.buffers[0]}, {"op": "shutdown", "id": 2}):
            with pytest.raises(zmq.Again):
                raw_request(keyed.address, header, timeout_ms=300)
            with pytest.raises(zmq.Again):
                raw_request(keyed.address, header, keys=stranger, timeout_ms=300)
        assert keyed.proc.poll() is None
        np.testing.assert_array_equal(y.to_numpy(), np.arange(5, dtype=np.float32) * 3)
        assert mesh.actor(0).info()["authenticated"] is True


def test_a_session_answers_only_the_key_that_opened_it(keyed):
    """The session id is a header field; the key that opened the session is what proves who may use it."""
    with mpmd.RemoteMesh.connect([keyed.address], keys=keyed.alice, transport="none") as mesh:
        x = mesh.actor(0).put(np.full(3, 7.0, np.float32))
        request = {"op": "get", "id": 5, "session": mesh.session, "buf": x.buffers[0]}
        theirs = raw_request(keyed.address, request, keys=keyed.bob)
        assert theirs.op == "error" and "needs an open session" in theirs.header["message"]
        ours = raw_request(keyed.address, request, keys=keyed.alice)
        assert ours.op == "reply" and ours.arrays[0].tolist() == [7.0, 7.0, 7.0]


def test_a_non_loopback_bind_without_keys_refuses_to_start_and_says_so(tmp_path):
    import subprocess
    import sys

    def daemon(*flags):
        return subprocess.run([sys.executable, "-m", "actors.daemon", "--p2p", "none", *flags], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdin=subprocess.DEVNULL)

    refused = daemon("--listen", "tcp://0.0.0.0:0")
    assert refused.returncode != 0 and "MPMD_ACTOR_READY" not in refused.stdout
    assert "refusing to listen on tcp://0.0.0.0:0 without authentication" in refused.stderr and "--insecure" in refused.stderr
    half = daemon("--listen", "tcp://127.0.0.1:0", "--server-key", str(tmp_path / "x.key_secret"))
    assert half.returncode != 0 and "--server-key and --authorized-keys go together" in half.stderr
    proc, address = start_daemon("--listen", "tcp://0.0.0.0:0", "--p2p", "none", "--insecure")  # said on purpose
    try:
        # the ready line names the address others dial, not the wildcard bound (tcp://0.0.0.0:PORT: a probe)
        assert "0.0.0.0" not in address and address.startswith("tcp://"), address
        assert raw_request(address, {"op": "ping", "id": 1}).op == "reply"
    finally:
        stop_daemon(proc)


def test_a_daemon_without_keys_serves_compile_and_the_shared_ops_only_when_started_insecure(tmp_path):
    """Without keys any local user reaches the socket: besides `compile`, what writes files (`save`), lists and reads
    them (`restore`), profiles, rewires or stops the daemon is refused (a probe planted a checkpoint of its bytes in
    the daemon user's home, listed /etc file by file through restore's listing check, and shut the daemon down)."""
    blob = export.export(jax.jit(lambda a: a + 1), platforms=["cpu"])(jax.ShapeDtypeStruct((2,), jnp.float32)).serialize()
    proc, address = start_daemon("--listen", "tcp://127.0.0.1:0", "--p2p", "none")
    try:
        reply = raw_request(address, {"op": "compile", "id": 1}, arrays=[np.frombuffer(blob, np.uint8)])
        assert reply.op == "error" and "serves 'compile' only to an authenticated controller" in reply.header["message"]
        assert not reply.header.get("traceback")  # (a refusal: the daemon's own lines read as a crash; a probe)
        assert raw_request(address, {"op": "hello", "id": 2, "session": 7}).op == "reply"
        for op, fields in [("save", {"path": str(tmp_path / "planted"), "bufs": []}), ("restore", {"path": "/etc"}),
                           ("profile", {}), ("connect_peers", {"peers": {}}), ("shutdown", {})]:
            reply = raw_request(address, {"op": op, "id": 2, "session": 7, **fields})
            assert reply.op == "error" and f"serves {op!r} only to an authenticated controller" in reply.header["message"], (
                op, reply.header)
        assert not (tmp_path / "planted").exists()
        assert proc.poll() is None and raw_request(address, {"op": "ping", "id": 3}).op == "reply"  # (still up)
    finally:
        stop_daemon(proc)


def _listening_tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in list(f)[1:]:
                    cols = line.split()
                    if cols[3] == "0A":  # LISTEN
                        inodes.add(cols[9])
        except OSError:
            pass
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[len("socket:[") : -1])
    return out


def test_a_local_mesh_is_authenticated_its_data_plane_refuses_strangers_and_it_listens_on_no_tcp_port():
    with mpmd.RemoteMesh.local(num_actors=2, transfer_timeout=0.5) as mesh:
        assert all(info.header["authenticated"] for info in mesh.infos)
        p2p = mesh.infos[1].header["p2p"]
        assert p2p["tcp"] is None and p2p["ipc"].startswith("ipc://") and p2p["key"]
        listening = _listening_tcp_inodes()
        for proc in mesh.processes:
            assert not (_socket_inodes(proc.proc.pid) & listening), "an ipc-only local mesh needs no TCP listener"
        with pytest.raises(zmq.Again):  # no keys: the control socket does not answer
            raw_request(mesh.addresses[0], {"op": "ping", "id": 1}, timeout_ms=300)
        # A stranger (no key, or a key nobody gave actor 1) sends a transfer actor 1 waits for from actor 0.
        pid = 900_001
        mesh.run(mesh.executables.load_program(1, Program(1, [], [0], [Recv(0, 0, 3, "float32", (4,), Label("xfer"))]), pid, []))
        forged = encode({"op": "data", "src": 0, "key": [mesh.session, pid, 0, 3]}, [np.ones(4, np.float32)])
        strangers = [dealer(p2p["ipc"]), dealer(p2p["ipc"], ClientKeys(KeyPair.generate(), (p2p["key"].encode(),)))]
        for s in strangers:
            s.send_multipart(forged)
        with pytest.raises(mpmd.RemoteError, match=r"waited 0.5 s for xfer \(tag 3\) from actor 0 and nothing came"):
            mesh.run(mesh.conn(1).request("run_program", {"program": pid, "step": 0, "inputs": [], "outputs": [mesh.new_buffer_id()]}))
        for s in strangers:
            s.close()
        assert mesh.actor(1).stats()["p2p"]["refused_connections"] >= 1
        from tests.test_p2p import run_transfers

        a = np.arange(70_000, dtype=np.float32)  # over 64 KiB: a shared-memory transfer between the real actors
        np.testing.assert_array_equal(run_transfers(mesh, [(0, 1, 0, a)])[0], a)


def test_a_peer_cannot_claim_another_actors_id_nor_name_someone_elses_shared_memory(single):
    mesh = single
    peer = FakePeer(mesh, 0, 7)
    other = FakePeer(mesh, 0, 3)  # (actor 3, connected: a recv from an actor the data plane has no route to is refused at load)
    victim = f"/mpmd-victim-{os.getpid()}"
    fd = _posixshmem.shm_open(victim, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 16)
    os.close(fd)
    try:
        pid = 900_002
        prog = Program(0, [], [0, 1], [Recv(0, 7, 1, "float32", (16,), Label("xfer")), Recv(1, 3, 2, "float32", (4,), Label("xfer"))])
        mesh.run(mesh.executables.load_program(0, prog, pid, []))
        key = [mesh.session, pid, 0]
        peer.send({"op": "data", "src": 3, "key": [*key, 2]}, [np.ones(4, np.float32)])  # claims to be actor 3
        peer.send({"op": "shm", "key": [*key, 1], "seg": 0, "name": victim, "size": 1 << 16, "ino": 0,
                   "arrays": [{"dtype": "float32", "shape": [16]}]})
        for seg in range(4):
            peer.send({"op": "shm_ack", "seg": seg})  # acks for segments nobody sent it: ignored
        with pytest.raises(mpmd.RemoteError, match=f"refused a shared-memory notice from actor 7 naming '{victim}'"):
            mesh.run(mesh.conn(0).request("run_program", {"program": pid, "step": 0, "inputs": [],
                                                          "outputs": [mesh.new_buffer_id(), mesh.new_buffer_id()]}))
        assert os.path.exists(f"/dev/shm{victim}"), "a notice must not make the actor unlink a segment it was not sent"
        stats = mesh.actor(0).stats()["p2p"]
        assert stats["bad_messages"] >= 2 and stats["unclaimed"].get("3") is None
        assert mesh.actor(0).ping() > 0
    finally:
        peer.close()
        other.close()
        _posixshmem.shm_unlink(victim)


def test_unclaimed_arrivals_are_capped_per_peer_refused_to_the_sender_and_expire_with_their_step(single):
    mesh = single
    peer = FakePeer(mesh, 0, 7)
    try:
        pid = 900_003
        for tag in range(60):  # a step that has not started here: kept, up to the limit of 50
            peer.send({"op": "data", "key": [mesh.session, pid, 0, tag]}, [np.full(1024, tag, np.float32)])
        peer.send({"op": "data", "key": [123456789, pid, 0, 0]}, [np.ones(4, np.float32)])  # a session that is not open
        assert wait_until(lambda: mesh.actor(0).stats()["p2p"].get("refused", 0) >= 11, 10)
        stats = mesh.actor(0).stats()["p2p"]
        assert stats["unclaimed"]["7"] == {"arrivals": 50, "bytes": 50 * 4096}
        peer.inbox.setsockopt(zmq.RCVTIMEO, 5000)
        notice = [bytes(f) for f in peer.inbox.recv_multipart()][1:]
        from transport.protocol import decode

        refusal = decode(notice).header
        assert refusal["op"] == "refused" and "the limit is 50 arrivals" in refusal["reason"]
        # The step runs, takes tag 0 and ends: its 49 other arrivals go, and what comes for it later is dropped.
        mesh.run(mesh.executables.load_program(0, Program(0, [], [0], [Recv(0, 7, 0, "float32", (1024,), Label("xfer"))]), pid, []))
        out = mesh.new_buffer_id()
        mesh.run(mesh.conn(0).request("run_program", {"program": pid, "step": 0, "inputs": [], "outputs": [out]}))
        assert mpmd.RemoteArray(mesh, {0: out}, (1024,), np.float32).to_numpy().tolist() == [0.0] * 1024
        peer.send({"op": "data", "key": [mesh.session, pid, 0, 99]}, [np.ones(4, np.float32)])
        assert wait_until(lambda: mesh.actor(0).stats()["p2p"].get("late_dropped", 0) >= 1, 10)
        assert mesh.actor(0).stats()["p2p"]["unclaimed"] == {}
        # A receive posted for a key that was refused fails at once, saying so, instead of waiting 30 s.
        mesh.run(mesh.executables.load_program(0, Program(0, [], [0], [Recv(0, 7, 55, "float32", (1024,), Label("xfer"))]), pid + 1, []))
        for tag in range(51):
            peer.send({"op": "data", "key": [mesh.session, pid + 1, 0, 1000 + tag]}, [np.ones(1, np.float32)])
        peer.send({"op": "data", "key": [mesh.session, pid + 1, 0, 55]}, [np.ones(1024, np.float32)])
        assert wait_until(lambda: mesh.actor(0).stats()["p2p"]["unclaimed"].get("7", {}).get("arrivals") == 50, 10)
        with pytest.raises(mpmd.RemoteError, match="arrived before its receive and was refused"):
            mesh.run(asyncio.wait_for(mesh.conn(0).request(
                "run_program", {"program": pid + 1, "step": 0, "inputs": [], "outputs": [mesh.new_buffer_id()]}), 20))
        assert mesh.actor(0).stats()["p2p"]["unclaimed"] == {}
    finally:
        peer.close()


def _compile(mesh, blob, digest=...):
    import hashlib

    fields = {"digest": hashlib.sha256(blob).hexdigest() if digest is ... else digest}
    return mesh.run(mesh.conn(0).request("compile", fields, [np.frombuffer(blob, np.uint8)]))


def test_compile_checks_the_digest_and_refuses_custom_calls_off_the_allow_list(single):
    mesh = single
    x = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    good = export.export(jax.jit(lambda a: (jnp.linalg.cholesky(a @ a.T + 4 * jnp.eye(4)),)), platforms=["cpu"])(x).serialize()
    with pytest.raises(mpmd.RemoteError, match="digest does not match its bytes"):
        _compile(mesh, good, digest="0" * 64)
    with pytest.raises(mpmd.RemoteError, match="digest does not match its bytes"):
        _compile(mesh, good, digest=None)
    for target in ("xla_ffi_python_cpu_callback", "mpmd_not_a_kernel"):
        call = lambda a, t=target: (jax.ffi.ffi_call(t, jax.ShapeDtypeStruct((4, 4), jnp.float32))(a),)
        evil = export.export(jax.jit(call), platforms=["cpu"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(x).serialize()
        with pytest.raises(mpmd.RemoteError, match=f"calls custom call target '{target}', which this actor does not allow"):
            _compile(mesh, evil)
    # A LAPACK kernel is allowed: it compiles and runs, equal to jax.jit here.
    a = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    out = mesh.actor(0).run(jax.jit(lambda a: jnp.linalg.cholesky(a @ a.T + 4 * jnp.eye(4))), a)
    np.testing.assert_allclose(out.to_numpy(), jnp.linalg.cholesky(a @ a.T + 4 * jnp.eye(4)), rtol=1e-5, atol=1e-6)
    assert mesh.actor(0).ping() > 0


def test_the_custom_calls_of_typical_cpu_and_gpu_programs_are_allowed():
    """Exports what training code commonly uses (linear algebra, FFT, sort, RNG, convolution, scan, remat,
    sharding annotations) for CPU and for CUDA, and checks each custom call it needs is on the allow-list."""
    import jax.scipy.linalg as jsl

    S = jax.ShapeDtypeStruct
    m, v = S((8, 8), jnp.float32), S((8,), jnp.float32)
    programs = {
        "cholesky": (jnp.linalg.cholesky, [m]), "eigh": (jnp.linalg.eigh, [m]), "svd": (jnp.linalg.svd, [m]),
        "qr": (jnp.linalg.qr, [m]), "solve": (jnp.linalg.solve, [m, S((8, 2), jnp.float32)]), "inv": (jnp.linalg.inv, [m]),
        "det": (jnp.linalg.det, [m]), "triangular": (lambda a, b: jsl.solve_triangular(a, b), [m, S((8, 2), jnp.float32)]),
        "tridiagonal": (lambda a, b, c, d: jax.lax.linalg.tridiagonal_solve(a, b, c, d), [v, v, v, S((8, 1), jnp.float32)]),
        "eigh64": (jnp.linalg.eigh, [S((4, 4), jnp.float64)]), "svd_c64": (jnp.linalg.svd, [S((4, 3), jnp.complex64)]),
        "fft": (jnp.fft.fft, [v]), "sort_topk": (lambda a: (jnp.sort(a), jax.lax.top_k(a, 3)), [v]),
        "rng": (lambda k: jax.random.normal(jax.random.wrap_key_data(k), (4,)), [S((2,), jnp.uint32)]),
        "conv": (lambda a, w: jax.lax.conv(a, w, (1, 1), "SAME"), [S((1, 3, 8, 8), jnp.float32), S((4, 3, 3, 3), jnp.float32)]),
        "scan_remat": (jax.grad(jax.checkpoint(lambda a: jnp.sum(jax.lax.cumsum(jnp.sin(a)) ** 2))), [v]),
    }
    cpu_only = {"eig": (jnp.linalg.eig, [m]), "schur": (jsl.schur, [m]), "hessenberg": (jsl.hessenberg, [m])}
    seen = set()
    signatures = SignatureChecker()
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        for platform, progs in (("cpu", {**programs, **cpu_only}), ("cuda", programs)):
            for name, (fn, args) in progs.items():
                text = export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()
                for target in custom_call_targets(text):
                    assert target in ALLOWED_CUSTOM_CALLS, f"{platform} {name} uses {target!r}"
                    seen.add(target)
                signatures.check(text, (platform,))  # and each call has the types its kernel's table expects
    finally:
        jax.config.update("jax_enable_x64", x64)
    assert {"lapack_spotrf_ffi", "lapack_dsyevd_ffi", "cusolver_potrf_ffi", "cusolver_getrf_ffi"} <= seen
    # Sharding annotations under the GSPMD partitioner are custom calls too.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        sharded = jax.jit(lambda a: jax.lax.with_sharding_constraint(a * 2, jax.sharding.NamedSharding(mesh, jax.P("x"))))
        smap = jax.jit(jax.shard_map(lambda a: a + 1, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))
        targets = set()
        for fn in (sharded, smap):
            targets |= set(custom_call_targets(export.export(fn, platforms=["cpu"])(v).mlir_module()))
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)
    assert targets and targets <= ALLOWED_CUSTOM_CALLS, targets


def test_a_program_receiving_an_unknown_dtype_or_a_negative_shape_is_refused_when_loaded_not_when_run(mesh2):
    """A raw client's recv of dtype "object" or shape [-5] was loaded and refused only by the step that ran it (a
    probe); it is refused at load, naming the instruction, and the daemon serves on."""
    from transport.program import ProgramError, decode_instruction

    for dtype, shape in (("object", [4]), ("float32", [-5]), ("<f4", [2, 2])):
        with pytest.raises(ProgramError, match="the dtype must be one of"):
            decode_instruction(["recv", 0, 1, 2, dtype, shape, "xfer"])
        wire = {"id": 900_100, "actor": 0, "inputs": [], "outputs": [0], "instrs": [["recv", 0, 1, 2, dtype, shape, "xfer"]]}
        reply = raw_request(mesh2.addresses[0], {"op": "load_program", "id": 1, "session": mesh2.session, "program": wire},
                            keys=mesh2.keys)
        assert reply.op == "error" and "the dtype must be one of" in reply.header["message"], reply.header
    assert decode_instruction(["recv", 0, 1, 2, "bfloat16", [0, 3], "xfer"]).shape == (0, 3)
    assert mesh2.actor(0).ping() > 0


def _within(seconds, fn):
    """`fn()`'s exception (None if it returned) or 'hung' when it has not ended within `seconds` (a thread)."""
    import threading

    got = {}

    def run():
        try:
            fn()
            got["e"] = None
        except BaseException as e:  # noqa: BLE001 - what it raised is the answer
            got["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return got["e"] if "e" in got else "hung"


def test_a_fifo_named_as_a_key_file_is_refused_at_once_not_waited_on(tmp_path):
    """Opening a FIFO to read waits for a writer: a FIFO named *.key in an authorized-keys directory hung a daemon's
    start for good, and so did one given to ClientKeys.load as a server key (a probe). Refused, naming it."""
    from transport.auth import load_authorized_keys

    d = tmp_path / "keys"
    generate_key_files(d)
    os.mkfifo(d / "evil.key")
    err = _within(10, lambda: load_authorized_keys(d))
    assert isinstance(err, AuthKeyError) and "evil.key is not a key file (not a regular file: a device, a FIFO" in str(err), err
    err = _within(10, lambda: ClientKeys.load(d / "mpmd.key_secret", d / "evil.key"))
    assert isinstance(err, AuthKeyError) and "evil.key is not a key file (not a regular file" in str(err), err


def test_a_file_that_holds_no_key_given_as_the_secret_key_is_said_to_be_no_key_file_not_told_to_chmod(tmp_path):
    """`--server-key /etc/passwd` was told `run chmod 600 /etc/passwd` (its mode is checked first; a probe): a file
    with no key line is not a key file, whatever its mode; a real secret key readable by others still gets the chmod."""
    other = tmp_path / "passwd"
    other.write_text("root:x:0:0:root:/root:/bin/bash\n")
    other.chmod(0o644)
    with pytest.raises(AuthKeyError, match="passwd is not a key file: it holds no public-key or secret-key line") as err:
        KeyPair.load(other)
    assert "chmod" not in str(err.value)
    _, secret = generate_key_files(tmp_path / "k")
    secret.chmod(0o644)
    with pytest.raises(AuthKeyError, match=r"can be read by other users .*chmod 600"):
        KeyPair.load(secret)
