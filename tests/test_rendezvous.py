"""Daemons that a cluster's scheduler starts, found through a rendezvous: `mpmd-actor --slurm`, hand-started
daemons with `--actor-id` (a StatefulSet, a shell loop), file and TCP rendezvous, their keys and their errors.

Real daemon subprocesses, real ZeroMQ with CURVE keys, real files. A real SLURM cannot run here: each daemon is
given the environment srun gives a task (SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_ID, SLURM_LOCALID, SLURM_NODEID,
SLURM_STEP_TASKS_PER_NODE, SLURMD_NODENAME) as the stated substitute. Everything binds loopback.
"""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
import zmq

import mpmd
from actors.cluster import slurm_devices, slurm_task, tasks_per_node
from mpmd import testing
from mpmd.runtime.launch.rendezvous import TcpRendezvous
from tests.wire import start_daemon, stop_daemon
from transport.auth import ClientKeys, KeyPair, generate_key_files
from transport.rendezvous import Arrival, encode_message


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """The job's key pair, made as a user makes it (`mpmd keys generate DIR`)."""
    d = tmp_path_factory.mktemp("keys")
    generate_key_files(d)
    return d


def slurm_env(procid: int, ntasks: int, job: str = "4242") -> dict[str, str]:
    """What srun puts in a task's environment (one node, `ntasks` tasks on it)."""
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0",
            "SLURM_LOCALID": str(procid), "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": str(ntasks),
            "SLURMD_NODENAME": socket.gethostname()}


def spawn(*flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """An `mpmd-actor` subprocess (exits with this test process: --parent-pid); stderr in a file (`proc.log`)."""
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mpmd-rdv-test-{os.getpid()}-{time.monotonic_ns()}.log"), "wb")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    proc = subprocess.Popen([sys.executable, "-m", "actors.daemon", "--parent-pid", str(os.getpid()), "--cpu-devices", "1", *flags],
                            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                            env={**clean, "JAX_PLATFORMS": "cpu", **(env or {})})
    proc.log = log.name
    log.close()
    return proc


def ready(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().decode()
    if not line.startswith("MPMD_ACTOR_READY"):
        raise AssertionError(f"daemon did not start: {line!r}\n{stderr_of(proc)}")
    return line.split()[1]


def stderr_of(proc: subprocess.Popen) -> str:
    with open(proc.log, errors="replace") as f:
        return f.read()


def records(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def trains_like_jit(mesh: mpmd.RemoteMesh) -> None:
    rng = np.random.default_rng(0)
    params = testing.mlp_params(rng, num_stages=2)
    batch = testing.regression_batch(rng, num_microbatches=4, microbatch_size=3, width=16)
    opt = optax.adam(1e-2)
    loss = testing.mse_loss(testing.mlp)
    ref = jax.jit(testing.make_train_step(loss, opt, None))
    dist = mpmd.distributed(testing.make_train_step(loss, opt, mpmd.OneFOneB(2)), mesh=mesh)
    rp, ro, dp, do = params, opt.init(params), params, opt.init(params)
    for _ in range(2):
        rp, ro, rl = ref(rp, ro, batch)
        dp, do, dl = dist(dp, do, batch)
        np.testing.assert_allclose(np.asarray(dl), np.asarray(rl), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(mpmd.fetch(dp)), jax.tree.leaves(rp)):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)


def test_slurm_tasks_form_a_mesh_through_a_file_rendezvous_that_trains_like_jit_and_close_leaves_nothing(tmp_path, keys):
    rdv = tmp_path / "rdv"  # made by the daemons (mode 700), as on a shared home
    procs = [spawn("--slurm", "--rendezvous", str(rdv), "--authorized-keys", str(keys), "--p2p-host", "127.0.0.1",
                   env=slurm_env(i, 2)) for i in range(2)]
    try:
        endpoints = [ready(p) for p in procs]
        assert records(rdv) == ["actor-0.json", "actor-1.json"]
        with mpmd.RemoteMesh.from_rendezvous(rdv, 2, keys=keys, timeout=30) as mesh:
            assert mesh.addresses == endpoints and all(e.startswith("tcp://127.0.0.1:") for e in endpoints)
            assert [mesh.actor(i).info()["actor_id"] for i in range(2)] == [0, 1]  # SLURM_PROCID
            assert mesh.actor(0).info()["authenticated"] is True
            trains_like_jit(mesh)
        for p in procs:  # the mesh shut them down (so the srun step ends), and they withdrew their arrivals
            assert p.wait(15) == 0, stderr_of(p)
        assert records(rdv) == []
    finally:
        for p in procs:
            stop_daemon(p)


def test_a_missing_actor_times_out_naming_it_and_a_second_daemon_with_the_same_id_is_refused(tmp_path, keys):
    rdv = tmp_path / "rdv"
    flags = ("--slurm", "--rendezvous", str(rdv), "--authorized-keys", str(keys), "--p2p-host", "127.0.0.1")
    first = spawn(*flags, env=slurm_env(0, 2))
    try:
        ready(first)
        twin = spawn(*flags, env=slurm_env(0, 2))  # a second task that was given SLURM_PROCID=0 too
        assert twin.wait(60) == 1
        assert twin.stdout.read() == b""  # never ready
        said = stderr_of(twin)
        assert "actor id 0 is already held by a live daemon" in said and f"pid {first.pid}" in said, said
        stop_daemon(twin)
        t = time.monotonic()
        with pytest.raises(mpmd.RendezvousError) as err:
            mpmd.RemoteMesh.from_rendezvous(rdv, 2, keys=keys, timeout=1.5)
        assert time.monotonic() - t < 5
        text = str(err.value)
        assert "only 1 of 2 actors arrived" in text and "missing actor 1 " in text and "arrived: 0 on" in text, text
        with pytest.raises(mpmd.RendezvousError, match=r"one of 2 tasks \(SLURM_NTASKS\).*num_actors=1"):
            mpmd.RemoteMesh.from_rendezvous(rdv, 1, keys=keys, timeout=10)  # at once, not after the timeout
        assert first.poll() is None  # refusing the twin did not disturb the first
    finally:
        stop_daemon(first)
    assert records(rdv) == []  # SIGTERM: the daemon withdrew its arrival


def test_a_killed_daemons_record_is_recognised_and_replaced_by_a_hand_started_daemon_with_the_same_id(tmp_path, keys):
    """Generic rendezvous (no SLURM: --actor-id given, as a StatefulSet or a shell loop starts daemons)."""
    rdv = tmp_path / "rdv"
    flags = ("--rendezvous", str(rdv), "--actor-id", "0", "--authorized-keys", str(keys), "--listen", "tcp://127.0.0.1:0")
    killed = spawn(*flags)
    ready(killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    stop_daemon(killed)
    assert records(rdv) == ["actor-0.json"]  # left behind by the kill
    with pytest.raises(mpmd.RendezvousError, match=r"actor 0: only the record of a daemon that is gone"):
        mpmd.RemoteMesh.from_rendezvous(rdv, 1, keys=keys, timeout=1)
    again = spawn(*flags)
    try:
        ready(again)
        assert "replaced the arrival of a dead daemon for actor 0" in stderr_of(again)
        with mpmd.RemoteMesh.from_rendezvous(rdv, 1, keys=keys, timeout=10, transport="none") as mesh:
            y = mesh.actor(0).run(jax.jit(lambda a: a * 2.0 + 1.0), np.arange(4, dtype=np.float32))
            np.testing.assert_array_equal(y.to_numpy(), np.arange(4) * 2.0 + 1.0)
            assert mesh.actor(0).info()["pid"] == again.pid
        assert again.wait(15) == 0
    finally:
        stop_daemon(again)
    assert records(rdv) == []


def test_a_second_job_on_the_same_rendezvous_shares_the_daemons_and_its_close_does_not_stop_them(tmp_path, keys, caplog):
    """Job B, on job A's rendezvous directory with the same key (the README's one key for every job), connected
    to A's daemons and its close stopped them under A's feet (a probe). Now B is warned, and its close ends only
    its own session: A's mesh goes on, and the daemon stops when A's session, the last, ends. A timeout of NaN
    waited forever."""
    rdv = tmp_path / "rdv"
    proc = spawn("--rendezvous", str(rdv), "--actor-id", "0", "--authorized-keys", str(keys), "--listen", "tcp://127.0.0.1:0")
    try:
        ready(proc)
        double = jax.jit(lambda a: a * 2.0)
        # (A leaves the daemon up when it closes: its session's end, the last, is what stops the daemon B asked to stop)
        with mpmd.RemoteMesh.from_rendezvous(rdv, 1, keys=keys, timeout=10, transport="none", shutdown_on_close=False) as a:
            with caplog.at_level("WARNING", logger="mpmd"):
                b = mpmd.RemoteMesh.from_rendezvous(rdv, 1, keys=keys, timeout=10, transport="none")
            assert "already serve another controller's session" in caplog.text
            np.testing.assert_array_equal(b.actor(0).run(double, np.ones(3, np.float32)).to_numpy(), [2.0, 2.0, 2.0])
            b.close()
            time.sleep(0.5)
            assert proc.poll() is None, stderr_of(proc)
            np.testing.assert_array_equal(a.actor(0).run(double, np.arange(3, dtype=np.float32)).to_numpy(), [0.0, 2.0, 4.0])
        assert proc.wait(15) == 0
    finally:
        stop_daemon(proc)
    for bad in (float("nan"), float("inf"), 0, True):
        with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
            mpmd.RemoteMesh.from_rendezvous(rdv, 1, keys=keys, timeout=bad)
    with pytest.raises(ValueError, match="num_actors must be a whole number >= 1, got True"):
        mpmd.RemoteMesh.from_rendezvous(rdv, True, keys=keys, timeout=1)


@pytest.mark.slow  # (moved out of the default run, 18.5 minutes on this VM on 2026-12-07: .ci/run runs it when time allows)
def test_daemons_of_another_jax_version_or_platform_are_refused_naming_them(tmp_path, keys):
    """A second JAX install cannot run here: a daemon's arrival is edited to say what another install's would."""
    rdv = tmp_path / "rdv"
    procs = [spawn("--rendezvous", str(rdv), "--actor-id", str(i), "--authorized-keys", str(keys), "--listen", "tcp://127.0.0.1:0")
             for i in range(2)]
    try:
        for p in procs:
            ready(p)
        path = rdv / "actor-1.json"
        honest = json.loads(path.read_text())

        def say(**fields):
            path.write_text(json.dumps({**honest, **fields}))

        say(jax_version="0.4.1")
        with pytest.raises(mpmd.IncompatibleActorError, match=rf"actor 1 on .* runs JAX 0\.4\.1.*this controller runs JAX {jax.__version__}"):
            mpmd.RemoteMesh.from_rendezvous(rdv, 2, keys=keys, timeout=10)
        say(platform="gpu")
        with pytest.raises(mpmd.IncompatibleActorError, match=r"different platforms \(cpu: actors \[0\]; gpu: actors \[1\]\)"):
            mpmd.RemoteMesh.from_rendezvous(rdv, 2, keys=keys, timeout=10)
        say()
        with pytest.raises(mpmd.IncompatibleActorError, match=r"actor 0 on .* runs on cpu.*platform='gpu'"):
            mpmd.RemoteMesh.from_rendezvous(rdv, 2, keys=keys, timeout=10, platform="gpu")
        with pytest.raises(mpmd.RendezvousError, match="pass keys=DIR"):
            mpmd.RemoteMesh.from_rendezvous(rdv, 2, timeout=10)
        stranger = ClientKeys(KeyPair.generate(), (KeyPair.generate().public,))  # refused by the daemons at the handshake
        with pytest.raises(mpmd.MpmdError, match="refused this client's key"):
            mpmd.RemoteMesh.from_rendezvous(rdv, 2, keys=stranger, timeout=10)
        assert all(p.poll() is None for p in procs)
    finally:
        for p in procs:
            stop_daemon(p)
    assert records(rdv) == []


def test_hand_started_daemons_find_the_tcp_rendezvous_the_controller_serves_and_strangers_cannot_announce(keys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    where = f"tcp://127.0.0.1:{port}"
    procs = [spawn("--rendezvous", where, "--actor-id", str(i), "--authorized-keys", str(keys), "--listen", "tcp://127.0.0.1:0")
             for i in range(2)]
    try:
        with mpmd.RemoteMesh.from_rendezvous(where, 2, keys=keys, timeout=60) as mesh:
            assert [ready(p) for p in procs] == mesh.addresses  # ready only once the rendezvous took them
            assert mesh.routes == {(0, 1): "shm", (1, 0): "shm"}  # wired as any mesh (one host here)
            for i in range(2):
                y = mesh.actor(i).run(jax.jit(lambda a, i=i: a + i), np.zeros(3, np.float32))
                np.testing.assert_array_equal(y.to_numpy(), np.full(3, i, np.float32))
        assert all(p.wait(15) == 0 for p in procs)
    finally:
        for p in procs:
            stop_daemon(p)
    # A client without the job's key cannot even be heard: its arrival never reaches the rendezvous.
    server = TcpRendezvous("tcp://127.0.0.1:0", keys)
    try:
        fake = Arrival.new(actor_id=0, endpoint="tcp://127.0.0.1:1", key=None, host="x", pid=1, jax_version=jax.__version__,
                           platform="cpu", devices=1)
        other = KeyPair.generate()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 2000)  # a refused handshake leaves no pipe between reconnects: a send may block
        sock.curve_publickey, sock.curve_secretkey = other.public, other.secret
        sock.curve_serverkey = KeyPair.load(keys).public
        sock.connect(server.address)
        try:
            sock.send(encode_message("arrive", arrival=fake.to_dict()))
        except zmq.Again:
            pass  # not even queued: it cannot be heard either way
        with pytest.raises(mpmd.RendezvousError, match=r"only 0 of 1 actors arrived") as e:
            server.gather(1, timeout=1.0)
        assert server.auth.refused >= 1
        # (said: a daemon of another job's key, or with a wrong one, is seen only here; its own log said why)
        assert "connection(s) were refused at the handshake: a daemon whose --rendezvous-key" in str(e.value)
        sock.close()
    finally:
        server.close()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_daemon_flags_that_cannot_work_are_refused_at_once_saying_what_to_do(tmp_path, keys):
    def daemon(*flags, env=None):
        clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        return subprocess.run([sys.executable, "-m", "actors.daemon", *flags], capture_output=True, text=True, timeout=60,
                              env={**clean, "JAX_PLATFORMS": "cpu", **(env or {})}, stdin=subprocess.DEVNULL)

    cases = [
        (("--slurm", "--rendezvous", str(tmp_path)), None, "SLURM_PROCID is not set"),
        (("--slurm", "--actor-id", "1"), slurm_env(0, 1), "drop --actor-id"),
        (("--rendezvous", str(tmp_path), "--authorized-keys", str(keys)), None, "needs this daemon's actor id: --actor-id N"),
        (("--rendezvous", str(tmp_path), "--actor-id", "0"), None, "needs --authorized-keys DIR"),
        (("--listen", "garbage://x", "--insecure"), None, "--listen takes tcp://host:port or ipc://path"),
        (("--cpu-devices", "-3"), None, "--cpu-devices must be 1-4096"),
        (("--parent-pid", "-1", "--insecure"), None, "--parent-pid takes the id of a running process (>= 1), got -1"),
        (("--parent-pid", "0", "--insecure"), None, "--parent-pid takes the id of a running process (>= 1), got 0"),
        (("--cpus", "a,b"), None, "--cpus takes core numbers separated by commas"),
        (("--allow-loader", "not a name"), None, "--allow-loader takes a data loader named 'package.module:function'"),
        # found by a probe: tracebacks, or accepted and then waiting or exiting 0
        (("--max-message-mb", str(10**15)), None, "--max-message-mb must be 1-1048576"),
        (("--mesh-dir", str(tmp_path / "missing")), None, "is not a directory"),
        (("--rendezvous", "tcp://127.0.0.1", "--actor-id", "0", "--insecure"), None, "write tcp://HOST:PORT: the port must be 1-65535, got no port"),
        (("--rendezvous", "tcp://127.0.0.1:99999", "--actor-id", "0", "--insecure"), None, "got '99999'"),
        (("--rendezvous", ""), None, "--rendezvous takes a directory or tcp://HOST:PORT"),
        (("--rendezvous", "http://127.0.0.1:29518", "--actor-id", "0", "--insecure"), None, "tcp://HOST:PORT (lowercase), got 'http:"),
        (("--rendezvous-timeout", "nan"), None, "--rendezvous-timeout must be a positive, finite number"),
        (("--rendezvous-timeout", "-5"), None, "--rendezvous-timeout must be a positive, finite number"),
        (("--listen", "tcp://127.0.0.1", "--insecure"), None, "--listen tcp://127.0.0.1: write tcp://HOST:PORT: the port must be 0-65535"),
        (("--actor-id", str(2**70)), None, "--actor-id must be 0-"),
        (("--parent-pid", str(_dead_pid()), "--insecure"), None, "no such process"),
        (("--slurm",), slurm_env(0, 1) | {"SLURM_NTASKS": "0"}, "SLURM_NTASKS=0"),
        (("--slurm",), slurm_env(0, 1) | {"SLURM_PROCID": "1_0"}, "SLURM_PROCID='1_0' is not a number"),
    ]
    for flags, env, said in cases:
        got = daemon(*flags, env=env)
        assert got.returncode == 2 and said in got.stderr, (flags, got.stderr)
    # Failing once started: one line each, no traceback (a raw RuntimeError / AssertionError / ZMQError before)
    started_cases = [(("--platform", "nosuch"), "JAX found no devices for --platform nosuch"),
                     (("--p2p", "ipc", "--ipc-dir", str(tmp_path / "missing")), "cannot start the data plane (--p2p ipc")]
    if shutil.which("nvidia-smi") is None:  # (JAX's own error for cuda without a GPU or its plugin is a bare AssertionError:
        # a probe; with the plugin installed it is a RuntimeError of its own — either is said in one line)
        started_cases.append((("--platform", "cuda"), "JAX found no devices for --platform cuda: "))
    for flags, said in started_cases:
        got = daemon("--listen", "tcp://127.0.0.1:0", *flags, env={"JAX_PLATFORMS": ""} if "--platform" in flags else None)
        assert got.returncode == 1 and said in got.stderr and "Traceback" not in got.stderr, (flags, got.stderr)
    # A replacement started as its controller died (no --parent-pid to serve) removes its files in the local mesh's
    # directory, and the directory once empty: its killed predecessor's were left there (a probe).
    mesh_dir = tmp_path / "mpmd-mesh"
    mesh_dir.mkdir()
    for name in ("actor1.sock", "p2p-1.sock", "actor1.log"):
        (mesh_dir / name).write_text("")
    got = daemon("--parent-pid", str(_dead_pid()), "--insecure", "--actor-id", "1", "--mesh-dir", str(mesh_dir))
    assert got.returncode == 2 and "no such process" in got.stderr and not mesh_dir.exists(), got.stderr
    # ... and leaving nothing behind: the private compile directory was made before these checks (a probe)
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    got = daemon("--listen", "tcp://127.0.0.1:0", "--p2p", "ipc", "--ipc-dir", str(tmp_path / "missing"), env={"TMPDIR": str(own_tmp)})
    assert got.returncode == 1 and os.listdir(own_tmp) == [], (os.listdir(own_tmp), got.stderr)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o770)
    os.chmod(shared, 0o770)
    with pytest.raises(mpmd.RendezvousError, match=r"writable by other users.*chmod 700"):
        mpmd.RemoteMesh.from_rendezvous(shared, 1, keys=keys, timeout=1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_daemon_stopped_by_a_signal_removes_its_sockets(tmp_path, sig):
    """The data-plane socket (--ipc-dir/p2p-<id>.sock) stayed behind on SIGTERM and SIGINT (a probe); SIGHUP (a shell's
    logout, the README's `for i in 0 1; do mpmd-actor ... & done`) killed the daemon with status 129, leaving its sockets
    and compile directory (a probe): it stops as SIGTERM does (unless ignored: nohup)."""
    proc, _ = start_daemon("--listen", f"ipc://{tmp_path}/a0.sock", "--p2p", "ipc", "--ipc-dir", str(tmp_path), "--insecure")
    try:
        assert sorted(os.listdir(tmp_path)) == ["a0.sock", "p2p-0.sock"]
        proc.send_signal(sig)
        assert proc.wait(20) == 0
        with open(proc.log) as f:  # (and its log says why it stopped: it said nothing; a probe)
            assert f"stopping: {signal.Signals(sig).name} received" in f.read()
    finally:
        stop_daemon(proc)
    assert os.listdir(tmp_path) == []


def test_slurm_gpu_binding_is_kept_per_task_and_shared_gpus_are_split_by_local_task():
    def devices(**env):
        env = {k: str(v) for k, v in env.items()}
        return slurm_devices(env, slurm_task(env))[0]

    base = {"SLURM_NTASKS": 8, "SLURM_NODEID": 1, "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    # --gpus-per-task=1: SLURM bound one GPU to each task; kept as it is
    assert devices(**base, SLURM_PROCID=6, SLURM_LOCALID=2, SLURM_GPUS_PER_TASK=1, CUDA_VISIBLE_DEVICES="2") is None
    # --gres=gpu:4 without binding: every task sees all four; local task 2 takes the third
    assert devices(**base, SLURM_PROCID=6, SLURM_LOCALID=2, CUDA_VISIBLE_DEVICES="0,1,2,3") == "2"
    # two GPUs per task from the step's list, where CUDA_VISIBLE_DEVICES is not set
    assert devices(SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_NODEID=0, SLURM_LOCALID=1, SLURM_STEP_TASKS_PER_NODE="2",
                   SLURM_STEP_GPUS="4,5,6,7") == "6,7"
    # one task per node keeps the node's GPUs (SPMD inside the actor); a CPU node has none
    assert devices(SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_NODEID=0, SLURM_LOCALID=0, SLURM_STEP_TASKS_PER_NODE="1(x2)",
                   CUDA_VISIBLE_DEVICES="0,1,2,3") is None
    assert devices(SLURM_PROCID=0, SLURM_NTASKS=1) is None
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="SLURM_PROCID=3 is not below SLURM_NTASKS=2"):
        slurm_task({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"})


def test_slurm_tasks_of_one_node_without_a_rendezvous_listen_on_ports_of_their_own(monkeypatch, tmp_path):
    """Without --rendezvous, every --slurm task of a node took port 5555: the second exited with 'Address already
    in use' (a multi-node probe). Task SLURM_LOCALID=l listens on 5555 + l."""
    from actors.daemon import parse_args

    for k, v in {"SLURM_NTASKS": "4", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}.items():
        monkeypatch.setenv(k, v)
    ports = []
    for procid, localid in ((2, 0), (3, 1)):
        monkeypatch.setenv("SLURM_PROCID", str(procid))
        monkeypatch.setenv("SLURM_LOCALID", str(localid))
        args = parse_args(["--slurm", "--authorized-keys", str(tmp_path)])
        assert args.actor_id == procid
        ports.append(int(args.listen.rsplit(":", 1)[1]))
    assert ports == [5555, 5556]


SRUN = r"""#!/usr/bin/env python3
# Stand-in for SLURM's srun (no SLURM here): starts --ntasks copies of the command on this node with the
# environment srun gives each task, and waits for them all (as `srun ... &` does in the batch script).
import os, signal, socket, subprocess, sys
args = sys.argv[1:]
ntasks = 1
while args and args[0].startswith("--"):
    flag = args.pop(0)
    if flag.startswith("--ntasks="):
        ntasks = int(flag.split("=", 1)[1])
env = dict(os.environ, JAX_PLATFORMS="cpu", SLURM_NTASKS=str(ntasks), SLURM_STEP_ID="0", SLURM_NODEID="0",
           SLURM_STEP_TASKS_PER_NODE=str(ntasks), SLURMD_NODENAME=socket.gethostname())
procs = [subprocess.Popen(args + ["--cpu-devices", "1"], env=dict(env, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)))
         for i in range(ntasks)]
signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in procs])  # srun forwards signals to its tasks
sys.exit(max(p.wait() for p in procs))
"""


@pytest.mark.slow
def test_the_sbatch_example_runs_as_written_with_srun_standing_in_for_slurm(tmp_path, keys):
    """examples/cluster/slurm_gpt.sbatch, executed by bash with the batch step's environment; `srun` is a stand-in
    (SLURM cannot run here) that starts the tasks on this machine with SLURM's per-task variables."""
    pytest.importorskip("flax.nnx")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN.replace("#!/usr/bin/env python3", f"#!{sys.executable}", 1))
    (bin_dir / "srun").chmod(0o755)
    for tool in ("mpmd-actor", "mpmd"):  # the project's console scripts, as `pip install` puts them on PATH
        (bin_dir / tool).write_text(f"#!{sys.executable}\nimport sys\nfrom {'actors.daemon' if tool == 'mpmd-actor' else 'mpmd.cli'} "
                                    "import main\nsys.exit(main())\n")
        (bin_dir / tool).chmod(0o755)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # this environment's Python
    (bin_dir / "python").chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", HOME=str(home), SLURM_JOB_ID="77", SLURM_NNODES="2", SLURM_SUBMIT_DIR=root,
               PYTHONPATH=root, MPMD_KEYS=str(home / ".mpmd" / "keys"))
    env.pop("XLA_FLAGS", None)
    job = subprocess.Popen(["bash", os.path.join(root, "examples", "cluster", "slurm_gpt.sbatch"), "--steps", "4", "--layers", "2",
                            "--width", "32", "--seq", "32", "--check-steps", "1", "--plot", ""],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        stdout, stderr = job.communicate(timeout=240)
    finally:  # as scancel would: nothing of the job outlives the test
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert job.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "the first 1 steps equal jax.jit's" in stdout, stdout
    assert (home / ".mpmd" / "keys").is_dir()  # made by the script on first use
    assert not (home / ".mpmd" / "rdv" / "77").exists()  # daemons withdrew, the script removed the directory


def test_an_address_where_no_daemon_ever_answered_is_named_so_and_a_port_past_65535_is_refused():
    """Both said 'actor 0 died or stopped answering ... mesh.reconnect(0) talks to it again', of a daemon that never
    was; and mpmd-actor --listen tcp://127.0.0.1:99999 bound port 34463 (found by a probe)."""
    import subprocess
    import sys

    with pytest.raises(mpmd.ActorDiedError, match="no daemon ever answered there.*nothing listens at that address") as e:
        mpmd.RemoteMesh.connect(["tcp://127.0.0.1:1"], transport="none", heartbeat_interval=0.2, heartbeat_timeout=1.0)
    assert "reconnect" not in str(e.value)
    # ... and the daemons that did answer are told goodbye: the session the failed connect opened on them was left
    # open until --session-timeout (a probe: shutdown_on_close of the next mesh then left that daemon running)
    proc, good = start_daemon("--listen", "tcp://127.0.0.1:0", "--p2p", "none", "--insecure")
    try:
        with pytest.raises(mpmd.ActorDiedError, match="no daemon ever answered there"):
            mpmd.RemoteMesh.connect([good, "tcp://127.0.0.1:1"], transport="none", heartbeat_interval=0.2, heartbeat_timeout=1.0)
        with mpmd.RemoteMesh.connect([good], transport="none") as mesh:
            assert mesh.actor(0).stats()["sessions"] == 1  # (this mesh's own alone)
    finally:
        stop_daemon(proc)
    out = subprocess.run([sys.executable, "-m", "actors.daemon", "--listen", "tcp://127.0.0.1:99999", "--insecure"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "the port must be 0-65535" in out.stderr


def test_launch_arguments_that_cannot_work_are_refused_before_any_wait_or_daemon(tmp_path, monkeypatch):
    """Found by a probe: heartbeat_timeout=inf waited for good on an address nothing listens on ("10": a TypeError from
    a comparison); connect(a generator) said "has no len()"; from_rendezvous(dir, mesh_shap=...) waited its whole
    timeout, then said no actor arrived; from_rendezvous("http://h:p") made the directory ./http:/h:p and waited on
    it; RemoteMesh.ray(num_actors=True) made one actor, devices_per_actor=1.5 one device, log_level="LOUD" failed
    only once a daemon had started. Each is refused at once (no Ray is started here: the checks come first)."""
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    for bad in (math.inf, "10", True, -1.0):
        for make in (lambda: mpmd.RemoteMesh.connect(["tcp://127.0.0.1:1"], heartbeat_timeout=bad),
                     lambda: mpmd.RemoteMesh.local(2, heartbeat_timeout=bad)):
            with pytest.raises(ValueError, match="heartbeat_timeout must be a positive, finite number of seconds"):
                make()
    with pytest.raises(ValueError, match="listed more than once"):
        mpmd.RemoteMesh.connect(a for a in ["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"])
    with pytest.raises(TypeError, match="unexpected keyword argument.*mesh_shap.*checked before the wait"):
        mpmd.RemoteMesh.from_rendezvous(str(tmp_path / "rdv"), 2, mesh_shap=(1,))
    with pytest.raises(ValueError, match="platform must be None"):
        mpmd.RemoteMesh.from_rendezvous(str(tmp_path / "rdv"), 2, platform=["gpu"])
    with pytest.raises(ValueError, match=r"a directory every node sees or tcp://HOST:PORT \(lowercase\), got 'http://"):
        mpmd.RemoteMesh.from_rendezvous("http://127.0.0.1:29518", 2)
    assert not (tmp_path / "http:").exists()
    for kwargs, said in [({"num_actors": True}, "num_actors must be a whole number >= 1"),
                         ({"num_actors": "2"}, "num_actors must be a whole number >= 1"),
                         ({"devices_per_actor": 1.5}, "devices_per_actor must be a whole number >= 1"),
                         ({"cpus_per_actor": 0}, "cpus_per_actor must be a positive number"),
                         ({"cpus_per_actor": "1"}, "cpus_per_actor must be a positive number"),
                         ({"resources_per_actor": "CPU"}, "resources_per_actor must map Ray resource names"),
                         ({"log_level": "LOUD"}, "log_level must be one of"),
                         ({"transport": "nccl", "platform": "cpu"}, "transport='nccl' needs GPU actors"),
                         ({"heartbeat_timeout": math.inf}, "heartbeat_timeout must be a positive")]:
        with pytest.raises(ValueError, match=said):
            mpmd.RemoteMesh.ray(**{"num_actors": 2, **kwargs})
    for kwargs, error, said in [({"recover": 5}, TypeError, r"recover= takes a mpmd.Recovery"),
                                ({"transport": "bogus"}, ValueError, "unknown transport 'bogus'"),
                                ({"overlap": "no"}, TypeError, "overlap must be True or False, got str 'no'"),
                                ({"keys": str(tmp_path / "no-such-keys")}, mpmd.RendezvousError, "no-such-keys")]:
        # (each waited the whole timeout for daemons that were not up, then said that none arrived: a probe)
        with pytest.raises(error, match=said):
            mpmd.RemoteMesh.from_rendezvous(str(tmp_path / "rdv"), 2, timeout=60, **kwargs)
        if "keys" not in kwargs:
            with pytest.raises(error, match=said):
                mpmd.RemoteMesh.ray(2, **kwargs)
    with pytest.raises(TypeError, match="runtime_env must be a dict of Ray's runtime environment"):
        mpmd.RemoteMesh.ray(2, runtime_env="x")
    with pytest.raises(ValueError, match="from_rendezvous needs where="):
        mpmd.RemoteMesh.from_rendezvous("", 2, timeout=60)
    assert time.monotonic() - t0 < 30
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()


def test_a_callers_mistake_found_once_the_daemons_answer_leaves_them_running_for_the_corrected_call(tmp_path, keys):
    """mesh_shape=(1, 2) on daemons of one device is found once they answer: the failed call stopped every daemon
    and emptied the rendezvous, so the corrected call waited for daemons that were gone (under SLURM, the srun
    step ended; a probe). Now the failed call ends its own session only."""
    rdv = tmp_path / "rdv"
    procs = [spawn("--rendezvous", str(rdv), "--actor-id", str(i), "--authorized-keys", str(keys)) for i in range(2)]
    try:
        for p in procs:
            ready(p)
        with pytest.raises(mpmd.MpmdError, match=r"mesh_shape \(1, 2\) needs 2"):
            mpmd.RemoteMesh.from_rendezvous(rdv, 2, keys=keys, timeout=30, mesh_shape=(1, 2))
        assert all(p.poll() is None for p in procs) and records(rdv) == ["actor-0.json", "actor-1.json"]
        with mpmd.RemoteMesh.from_rendezvous(rdv, 2, keys=keys, timeout=30) as mesh:
            trains_like_jit(mesh)
        for p in procs:  # the mesh that was made owns them: its close stops them, as before
            assert p.wait(15) == 0, stderr_of(p)
    finally:
        for p in procs:
            stop_daemon(p)


def test_connect_refuses_daemons_listed_out_of_actor_id_order_or_of_another_protocol():
    """connect([actor 1, actor 0]) was accepted and the first step failed with "actor 1 has no route to actor
    1"; a daemon of another protocol version answered with an error reply the controller could not match to
    its request, so hello waited for the heartbeat to give up ("no reply or heartbeat"). Found by a probe."""
    procs = [spawn("--listen", "tcp://127.0.0.1:0", "--insecure", "--actor-id", str(i)) for i in range(2)]
    other = subprocess.Popen([sys.executable, "-c", "import sys, transport.protocol as p; p.PROTOCOL_VERSION = 99; "
                              "from actors.daemon import main; sys.argv[0] = 'mpmd-actor'; main()", "--parent-pid", str(os.getpid()),
                              "--cpu-devices", "1", "--listen", "tcp://127.0.0.1:0", "--insecure"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        a0, a1, a_other = ready(procs[0]), ready(procs[1]), ready(other)
        with pytest.raises(mpmd.IncompatibleActorError, match="position 0 of the address list\\) was started as actor 1"):
            mpmd.RemoteMesh.connect([a1, a0])
        with mpmd.RemoteMesh.connect([a0, a1]) as mesh:
            assert [mesh.actor(i).ping() is not None for i in range(2)] == [True, True]
        with mpmd.RemoteMesh.connect([a1], transport="none") as mesh:  # nothing routes: a daemon looked at alone
            assert mesh.actor(0).ping() is not None
        with pytest.raises(mpmd.MpmdError, match="protocol version 99 is not supported"):
            mpmd.RemoteMesh.connect([a_other], transport="none")
        for bad in ("not-an-address", "tcp://127.0.0.1", "tcp://127.0.0.1:abc", "tcp://127.0.0.1:99999", "tcp://:5555",
                    "tcp://*:5555", "tcp://host:0"):  # (a bare pyzmq error, or 9.5 s waiting for no daemon; a probe)
            t = time.monotonic()
            with pytest.raises(ValueError, match=r"address 1 .* is not a daemon address: write tcp://HOST:PORT \(a port 1-65535\)"):
                mpmd.RemoteMesh.connect([a0, bad])
            assert time.monotonic() - t < 1
        with pytest.raises(ValueError, match="a list of daemon addresses"):
            mpmd.RemoteMesh.connect([])
        with pytest.raises(ValueError, match="listed more than once"):
            mpmd.RemoteMesh.connect([a0, a0])
        for bad in (float("nan"), float("inf"), -1, "5"):  # (NaN passed, then every receive failed naming no cause)
            with pytest.raises(ValueError, match="transfer_timeout must be a positive, finite number"):
                mpmd.RemoteMesh.connect([a0, a1], transfer_timeout=bad)
    finally:
        for p in (*procs, other):
            p.kill()
            p.wait()


def test_a_daemon_restarted_at_its_predecessors_address_takes_its_id_over_and_a_live_holder_elsewhere_keeps_it(tmp_path):
    """claim() probed the holder's endpoint, where the restarted daemon itself already listens (a StatefulSet pod
    restarted with the same fixed --listen address), took the dead predecessor for live and refused: the new
    daemon exited, and again at every restart (found by a probe)."""
    import dataclasses

    from transport.rendezvous import ClaimedError, arrival_path, claim, read_arrival

    with socket.socket() as ours, socket.socket() as elsewhere:
        for s in (ours, elsewhere):
            s.bind(("127.0.0.1", 0))
            s.listen()
        here, there = (f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in (ours, elsewhere))
        old = Arrival(actor_id=0, endpoint=here, key=None, host="pod-0", pid=1, jax_version=jax.__version__, platform="cpu",
                      devices=1, instance="first")
        assert claim(tmp_path, old) is False
        restarted = dataclasses.replace(old, instance="second")  # same address, same pid 1 in a fresh container
        assert claim(tmp_path, restarted) is True
        assert read_arrival(arrival_path(tmp_path, 0)).instance == "second"
        with pytest.raises(ClaimedError):  # another address: the holder answers there, so it is live
            claim(tmp_path, dataclasses.replace(old, endpoint=there, instance="third"))
        with pytest.raises(ClaimedError):  # the same address string on another host (NAT, an ipc path): live too
            claim(tmp_path, dataclasses.replace(old, host="pod-1", instance="fourth"))
        assert read_arrival(arrival_path(tmp_path, 0)).instance == "second"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # (~15 s)
def test_a_daemon_restarted_at_its_fixed_address_with_a_new_key_is_taken_back_by_the_recovery(tmp_path, keys):
    """A StatefulSet pod restarts its daemon at the same --listen address, with a fresh server key. The restart
    exited at once (its claim probed its own socket: see the test above), and the controller's socket, reconnecting
    to the new daemon, met a CURVE handshake failure that it reported as ActorAuthError, which no recovery took
    for a loss (found by a probe). Now the recovery takes the new daemon from the rendezvous; values equal jit."""
    rdv = tmp_path / "rdv"
    ports = [_free_port(), _free_port()]

    def start(i):
        proc = spawn("--rendezvous", str(rdv), "--actor-id", str(i), "--authorized-keys", str(keys),
                     "--listen", f"tcp://127.0.0.1:{ports[i]}", "--p2p-host", "127.0.0.1")
        procs.append(proc)
        ready(proc)

    procs: list[subprocess.Popen] = []
    rng = np.random.default_rng(0)
    params = testing.mlp_params(rng, num_stages=2)
    batches = [testing.regression_batch(rng, num_microbatches=4, microbatch_size=3, width=16) for _ in range(6)]
    opt = optax.adam(1e-2)
    loss = testing.mse_loss(testing.mlp)
    ref = jax.jit(testing.make_train_step(loss, opt, None))
    try:
        start(0)
        start(1)
        with mpmd.RemoteMesh.from_rendezvous(rdv, 2, keys=keys, timeout=30, heartbeat_timeout=3.0, heartbeat_interval=0.5,
                                             recover=mpmd.Recovery(snapshot_every=2, spawn_timeout=30)) as mesh:
            dist = mpmd.distributed(testing.make_train_step(loss, opt, mpmd.OneFOneB(2)), mesh=mesh)
            rp, ro, dp, do = params, opt.init(params), params, opt.init(params)
            losses = []
            for i, b in enumerate(batches):
                rp, ro, rl = ref(rp, ro, b)
                dp, do, dl = dist(dp, do, b)
                losses.append((dl, rl))
                if i == 3:
                    dl.block_until_ready()
                    procs[1].send_signal(signal.SIGKILL)
                    procs[1].wait()
                    start(1)  # at once, at the same address
            for dl, rl in losses:
                np.testing.assert_allclose(np.asarray(dl), np.asarray(rl), rtol=1e-5, atol=1e-6)
            for got, want in zip(jax.tree.leaves(mpmd.fetch(dp)), jax.tree.leaves(rp)):
                np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)
            assert mesh.recoveries == 1
            assert mesh.actor(1).info()["pid"] == procs[-1].pid
    finally:
        for p in procs:
            stop_daemon(p)


def test_daemons_started_by_hand_go_on_after_close_and_exit_with_shutdown_on_close(tmp_path):
    """Daemons at fixed addresses serve the next job after `close` (each session ends); a newcomer found no way to
    stop them but kill (a probe): `RemoteMesh.connect(..., shutdown_on_close=True)` asks them to exit at close, as
    `from_rendezvous` does by default."""
    generate_key_files(str(tmp_path / "keys"))
    flags = ["--server-key", str(tmp_path / "keys" / "mpmd.key_secret"), "--authorized-keys", str(tmp_path / "keys")]
    started = [start_daemon("--listen", "tcp://127.0.0.1:0", "--actor-id", str(i), *flags) for i in range(2)]
    procs, addresses = [p for p, _ in started], [a for _, a in started]
    try:
        rng = np.random.default_rng(0)
        params, opt = testing.mlp_params(rng, num_stages=2), optax.sgd(0.1)
        batch = testing.regression_batch(rng, num_microbatches=2, microbatch_size=3, width=16)
        step = testing.make_train_step(testing.mse_loss(testing.mlp), opt, mpmd.OneFOneB(2))
        want = jax.jit(testing.make_train_step(testing.mse_loss(testing.mlp), opt, None))(params, opt.init(params), batch)[2]
        for shutdown in (False, True):
            with mpmd.RemoteMesh.connect(addresses, keys=str(tmp_path / "keys"), shutdown_on_close=shutdown) as mesh:
                got = mpmd.distributed(step, mesh=mesh)(params, opt.init(params), batch)[2].to_numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            if not shutdown:
                time.sleep(1)
                assert all(p.poll() is None for p in procs)  # (still serving)
        assert [p.wait(30) for p in procs] == [0, 0]
    finally:
        for p in procs:
            stop_daemon(p)


def test_a_lost_rendezvous_daemon_is_said_to_come_back_through_recover_not_reconnect(tmp_path, keys):
    """A probe (2026-12-05): a rendezvous daemon's loss said "if it comes back ... mesh.reconnect(0) talks to it
    again", but one restarted by its supervisor announces a new address and key, which reconnect does not read
    (it timed out, then a key refusal). And a failed reconnect to another address left that address named."""
    rdv = tmp_path / "rdv"
    proc = spawn("--rendezvous", str(rdv), "--actor-id", "0", "--authorized-keys", str(keys), "--listen", "tcp://127.0.0.1:0")
    try:
        ready(proc)
        with mpmd.RemoteMesh.from_rendezvous(rdv, 1, keys=keys, timeout=10, transport="none", heartbeat_interval=0.2,
                                             heartbeat_timeout=1.0) as mesh:
            before = list(mesh.addresses)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            with pytest.raises(mpmd.ActorDiedError) as e:
                for _ in range(100):
                    mesh.actor(0).ping()
                    time.sleep(0.1)
            text = str(e.value)
            assert "at a new address with a new key: a mesh made with recover=mpmd.Recovery()" in text, text
            assert "talks to it again" not in text, text
            with pytest.raises(mpmd.ActorDiedError):
                mesh.reconnect(0, address=f"tcp://127.0.0.1:{_free_port()}", bound=1.0)
            assert mesh.addresses == before
    finally:
        stop_daemon(proc)


def test_a_fifo_under_an_arrivals_name_is_listed_not_read_and_a_daemons_claim_replaces_it(tmp_path, keys):
    """An arrival file is opened without blocking and read only if it is a regular file: a FIFO at actor-1.json held
    `from_rendezvous` past its timeout (killed at 30 s) and a daemon claiming actor-0.json printed no ready line in 60 s
    (a probe). Now the controller's wait times out naming the file and why, and a daemon's claim takes the name over."""
    from transport.rendezvous import claim, read_arrivals

    d = tmp_path / "rdv"
    d.mkdir(mode=0o700)
    os.mkfifo(d / "actor-1.json", 0o600)
    found, bad = read_arrivals(d)
    assert found == {} and "not a regular file" in bad["actor-1.json"]
    t = time.monotonic()
    with pytest.raises(mpmd.RendezvousError, match=r"(?s)actor-1\.json.*not a regular file"):
        mpmd.RemoteMesh.from_rendezvous(d, 2, keys=keys, timeout=2)
    assert time.monotonic() - t < 20
    os.mkfifo(d / "actor-0.json", 0o600)
    mine = Arrival(actor_id=0, endpoint="tcp://127.0.0.1:1", host=socket.gethostname(), pid=os.getpid(), key=None,
                   jax_version=jax.__version__, platform="cpu", devices=1, instance="x" * 16)
    claim(d, mine)
    assert read_arrivals(d)[0][0].instance == mine.instance


def test_a_rendezvous_directory_under_one_others_may_write_is_refused(tmp_path, keys):
    """The directory was checked alone: inside a world-writable (not sticky) directory another user could move it
    away and put a symlink to another job's rendezvous directory there, and this job took that job's daemons (a probe).
    Every directory above it is now checked as ssh checks ~/.ssh, as the key files are; /tmp's sticky bit passes."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (shared / "rdv").mkdir(mode=0o700)
    with pytest.raises(mpmd.RendezvousError, match=r"directory .*shared, above rendezvous directory .* can be written by other users"):
        mpmd.RemoteMesh.from_rendezvous(shared / "rdv", 1, keys=keys, timeout=1)
    os.chmod(shared, 0o755)
    with pytest.raises(mpmd.RendezvousError, match="only 0 of 1 actors arrived"):  # (checked, then waited for)
        mpmd.RemoteMesh.from_rendezvous(shared / "rdv", 1, keys=keys, timeout=1)


def test_a_tcp_rendezvous_takes_the_job_pair_named_by_rendezvous_key_beside_a_second_identitys_key(tmp_path):
    """With a second identity's pair beside the job's in --authorized-keys (the README's separate identities), a TCP
    rendezvous daemon exited "holds 2 public keys" even with --rendezvous-key naming the job's pair, which the README
    offers for it (a probe). The pair named is the rendezvous server's (the controller serves with the job's pair)."""
    import argparse

    from actors.cluster import RegistrationError, _rendezvous_keys

    keys = tmp_path / "keys"
    generate_key_files(keys, "mpmd")
    generate_key_files(keys, "alice")
    args = argparse.Namespace(insecure=False, rendezvous_key=str(keys / "mpmd.key_secret"), authorized_keys=str(keys))
    pair, server = _rendezvous_keys(args)
    assert server == pair.public == KeyPair.load(keys / "mpmd.key_secret").public
    with pytest.raises(RegistrationError, match="holds 2 public keys.*--rendezvous-key FILE"):
        _rendezvous_keys(argparse.Namespace(insecure=False, rendezvous_key=None, authorized_keys=str(keys)))


@pytest.mark.parametrize("over", ["file", "tcp"])
def test_a_daemon_that_cannot_start_tells_the_waiting_controller_why_and_a_replacement_is_still_taken(tmp_path, keys, over,
                                                                                                     monkeypatch):
    """A probe (2026-12-07): a daemon refusing to start (no devices for its --platform, its port taken) left its
    controller waiting its whole rendezvous timeout and then saying only "missing actor 1". The daemon now says why
    at the rendezvous (a failed-<id>.json record, or a `failed` message); the controller stops once no daemon took
    that id within FAILURE_WAIT of the failure, with the daemon's own words — and a daemon that does take it in time
    (a supervisor's restart; a review: stopping at once failed such jobs) is taken, its claim removing the record."""
    import threading

    from mpmd.runtime.launch import rendezvous as launch

    if over == "tcp":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            where = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    else:
        where = str(tmp_path / "rdv")
    flags = ("--rendezvous", where, "--authorized-keys", str(keys), "--listen", "tcp://127.0.0.1:0", "--actor-id", "0")

    def waiting(outcome: dict) -> threading.Thread:
        def wait() -> None:
            t = time.monotonic()
            try:
                with mpmd.RemoteMesh.from_rendezvous(where, 1, keys=keys, timeout=120) as mesh:
                    outcome["actors"] = [mesh.actor(0).info()["actor_id"]]
            except mpmd.RendezvousError as e:
                outcome["error"] = e
            outcome["seconds"] = time.monotonic() - t

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.5)  # (the TCP rendezvous is served by the controller: it binds first)
        return thread

    monkeypatch.setattr(launch, "FAILURE_WAIT", 2.0)
    outcome: dict = {}
    waiter = waiting(outcome)
    bad = spawn(*flags, "--platform", "nosuch", env={"JAX_PLATFORMS": ""})
    try:
        assert bad.wait(60) == 1, stderr_of(bad)
        waiter.join(60)
        assert not waiter.is_alive(), "the controller went on waiting for a daemon that had said it could not start"
        text = str(outcome["error"])
        assert outcome["seconds"] < 60 and "actor 0 could not start" in text and f"pid {bad.pid}" in text, outcome
        assert "JAX found no devices for --platform nosuch" in text and "no daemon took actor 0's place within" in text, text
    finally:
        stop_daemon(bad)
        waiter.join(1)
    # A replacement that comes within FAILURE_WAIT of the failure is taken (the failed one's words go nowhere).
    monkeypatch.setattr(launch, "FAILURE_WAIT", 60.0)
    outcome = {}
    waiter = waiting(outcome)
    bad = spawn(*flags, "--platform", "nosuch", env={"JAX_PLATFORMS": ""})
    good = None
    try:
        assert bad.wait(60) == 1, stderr_of(bad)
        good = spawn(*flags)
        waiter.join(60)
        assert not waiter.is_alive() and outcome.get("actors") == [0], outcome
        if over == "file":
            assert "failed-0.json" not in records(where)  # (the claim removed it)
    finally:
        stop_daemon(bad)
        if good is not None:
            stop_daemon(good)
        waiter.join(1)


def test_an_earlier_jobs_failure_record_is_only_listed_and_a_malformed_one_is_passed_over(tmp_path, monkeypatch):
    """The failure records' rules without daemons: one older than the wait by FAILURE_GRACE (an earlier job's in a
    reused directory) does not stop the wait but is listed when it times out; one of an id a daemon holds, or past
    num_actors, is ignored; a malformed or foreign-shaped record is passed over, never read as a failure, and so is one
    whose time is not a time (NaN, 1e20: the controller's wait raised from time.localtime; a review)."""
    from mpmd.runtime.launch import rendezvous as launch
    from mpmd.runtime.launch.rendezvous import gather
    from transport.rendezvous import FAILURE_SKEW, Failure, RendezvousFormatError, read_failures, record_failure

    rdv = tmp_path / "rdv"
    rdv.mkdir(mode=0o700)
    old = Failure(actor_id=0, host="n1", pid=7, error="port 5555 in use", time=time.time() - FAILURE_SKEW - 60)
    record_failure(rdv, old)
    record_failure(rdv, Failure.new(5, "no GPU"))  # past num_actors
    (rdv / "failed-2.json").write_text('{"actor_id": 2, "error": 3}')
    (rdv / "failed-3.json").write_text(json.dumps({**Failure.new(1, "x").to_dict()}))  # names another id than its file
    (rdv / "failed-4.json").write_text(json.dumps({**Failure.new(4, "x").to_dict(), "time": float("nan")}))
    assert sorted(read_failures(rdv)) == [0, 5]
    for when in (float("nan"), float("inf"), 1e20, -1.0):
        with pytest.raises(RendezvousFormatError, match="failure time must be a time"):
            Failure(actor_id=1, host="h", pid=1, error="e", time=when)
    with pytest.raises(mpmd.RendezvousError) as e:
        gather(rdv, 2, timeout=0.5)
    text = str(e.value)
    assert "only 0 of 2 actors arrived" in text and "an earlier daemon's record (before this wait): actor 0 could not start" in text
    assert "port 5555 in use" in text and "no GPU" not in text, text
    record_failure(rdv, Failure.new(1, "cannot listen on tcp://0.0.0.0:5556"))  # a current one stops the wait soon
    monkeypatch.setattr(launch, "FAILURE_WAIT", 0.5)
    t = time.monotonic()
    with pytest.raises(mpmd.RendezvousError, match=r"actor 1 could not start .*cannot listen on tcp://0.0.0.0:5556"):
        gather(rdv, 2, timeout=30)
    assert time.monotonic() - t < 5
