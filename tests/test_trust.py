"""Trust between identities and in what a daemon reads, against real daemons: one admitted key cannot rewire,
stop or crowd out another key's job; key files are trusted only when no other user could have written them;
an abandoned compile frees its cores at once; a custom call's types must fit its kernel; refused data-plane
arrivals cost memory only for their headers."""

import os

import jax
import numpy as np
import optax
import pytest

import mpmd
from mpmd.testing import make_train_step, mlp, mlp_params, mse_loss, regression_batch
from tests.wire import raw_request, start_daemon, stop_daemon
from transport.auth import ClientKeys, KeyPair, generate_key_files


# ---- 1. one identity cannot touch another's job ------------------------------------------------------
@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Two daemons with a data plane, admitting the keys alice, bob and carol, and 'ops' as their operator."""
    d = tmp_path_factory.mktemp("shared")
    generate_key_files(d, "server")
    for name in ("alice", "bob", "carol", "ops"):
        generate_key_files(d / "authorized", name)
    procs, addresses = [], []
    for i in range(2):
        proc, address = start_daemon("--listen", "tcp://127.0.0.1:0", "--actor-id", str(i), "--server-key", str(d / "server.key_secret"),
                                     "--authorized-keys", str(d / "authorized"), "--admin-key", "ops")
        procs.append(proc)
        addresses.append(address)
    keys = {n: ClientKeys.load(d / "authorized" / f"{n}.key_secret", d / "server.key") for n in ("alice", "bob", "carol", "ops")}
    yield type("Shared", (), {"procs": procs, "addresses": addresses, "keys": keys, "dir": d})
    for p in procs:
        stop_daemon(p)


def _train(mesh):
    rng = np.random.default_rng(0)
    params = mlp_params(rng, num_stages=2, width=8)
    batch = regression_batch(rng, num_microbatches=4, microbatch_size=2, width=8)
    optimizer = optax.sgd(0.1)
    want = jax.jit(make_train_step(mse_loss(mlp), optimizer, None))(params, optimizer.init(params), batch)
    step = mpmd.distributed(make_train_step(mse_loss(mlp), optimizer, mpmd.OneFOneB(num_stages=2)), mesh=mesh)
    return step, (params, optimizer.init(params), batch), want


def _check(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g.to_numpy() if hasattr(g, "to_numpy") else g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_a_second_key_cannot_rewire_stop_or_crowd_out_the_job_of_the_key_that_owns_the_daemons(shared):
    with mpmd.RemoteMesh.connect(shared.addresses, keys=shared.keys["alice"]) as alice:
        step, args, want = _train(alice)
        _check(step(*args), want)
        bob = mpmd.RemoteMesh.connect(shared.addresses, keys=shared.keys["bob"], transport="none")
        try:
            # Bob names his own data-plane endpoint and key as alice's actor 1 (what would make him man in the middle).
            evil = {"1": {"address": "tcp://127.0.0.1:1", "route": "tcp", "key": KeyPair.generate().public.decode(),
                          "shm_prefix": "/x-"}}
            for header in ({"op": "connect_peers", "id": 1, "peers": evil},  # no session at all
                           {"op": "connect_peers", "id": 2, "session": bob.session, "peers": evil},
                           {"op": "connect_peers", "id": 3, "session": alice.session, "peers": evil},  # alice's session id
                           {"op": "nccl_ids", "id": 4, "session": bob.session, "count": 1},
                           {"op": "shutdown", "id": 5},
                           {"op": "shutdown", "id": 6, "session": bob.session},
                           {"op": "profile", "id": 7, "session": bob.session, "action": "start"},
                           {"op": "info", "id": 8},
                           {"op": "stats", "id": 9, "session": alice.session}):
                for address in shared.addresses:
                    reply = raw_request(address, header, keys=shared.keys["bob"])
                    assert reply.op == "error", (header, reply.header)
                    msg = reply.header["message"]
                    assert "needs an open session" in msg or ("only the key that owns the daemon's job" in msg and "'alice'" in msg), msg
            assert all(p.poll() is None for p in shared.procs)
            # Bob's own session works for his own buffers and single-actor runs, and sees nothing of alice's.
            x = bob.actor(0).put(np.arange(3, dtype=np.float32))
            np.testing.assert_array_equal(bob.actor(0).run(jax.jit(lambda a: a + 1), x).to_numpy(), [1, 2, 3])
            stats = bob.actor(0).stats()
            assert stats["p2p"] is None and "requests" not in stats
            alice_exe = next(iter(alice.executables.compiled[0].values()))
            reply = raw_request(shared.addresses[0], {"op": "run", "id": 10, "session": bob.session, "exe": alice_exe,
                                                      "inputs": [x.buffers[0]], "outputs": [999]}, keys=shared.keys["bob"])
            assert reply.op == "error" and "no executable" in reply.header["message"]
            # ... and cannot open every session: 16 per key, while others (alice, carol) still get theirs.
            extra = []
            with pytest.raises(mpmd.MpmdError, match="sessions on actor 0 \\(the limit per key\\)"):
                for _ in range(20):
                    extra.append(mpmd.RemoteMesh.connect(shared.addresses[:1], keys=shared.keys["bob"], transport="none"))
            assert len(extra) == 15
            with mpmd.RemoteMesh.connect(shared.addresses[:1], keys=shared.keys["carol"], transport="none") as carol:
                assert carol.actor(0).ping() > 0
            for m in extra:
                m.close()
        finally:
            bob.close()
        # Alice's job is untouched: the same step again, results equal to jax.jit's.
        _check(step(*args), want)
        # The same key attaching a second controller (as RemoteMesh.connect(mesh.addresses, keys=mesh.keys)) works.
        with mpmd.RemoteMesh.connect(alice.addresses, keys=alice.keys, transport="none") as again:
            assert again.actor(1).stats()["p2p"] is not None


def test_the_operator_key_may_stop_a_daemon_another_key_owns(shared, tmp_path):
    d = shared.dir
    proc, address = start_daemon("--listen", "tcp://127.0.0.1:0", "--p2p", "none", "--server-key", str(d / "server.key_secret"),
                                 "--authorized-keys", str(d / "authorized"), "--admin-key", "ops")
    try:
        with mpmd.RemoteMesh.connect([address], keys=shared.keys["alice"], transport="none"):
            ops = mpmd.RemoteMesh.connect([address], keys=shared.keys["ops"], transport="none")
            reply = raw_request(address, {"op": "shutdown", "id": 1, "session": ops.session}, keys=shared.keys["ops"])
            assert reply.op == "reply"
            proc.wait(timeout=30)
            ops.close()
    finally:
        stop_daemon(proc)


def test_an_admin_key_that_is_not_authorized_stops_the_daemon_at_start(shared):
    import subprocess
    import sys

    d = shared.dir
    out = subprocess.run([sys.executable, "-m", "actors.daemon", "--listen", "tcp://127.0.0.1:0", "--p2p", "none", "--server-key",
                          str(d / "server.key_secret"), "--authorized-keys", str(d / "authorized"), "--admin-key", "mallory"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode != 0 and "--admin-key mallory: no such key" in out.stderr


# ---- 5. a custom call's types must fit its kernel ------------------------------------------------------
def _spotrf_blob(n_in: int, n_out: int, alias: bool = False) -> bytes:
    """A blob whose one op is LAPACK's Cholesky kernel on an n_in x n_in operand with an n_out x n_out result
    (what an attacker writes by hand; JAX never would unless n_in == n_out)."""
    import dataclasses

    import jax.numpy as jnp
    from jax import export
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    exp = export.export(jax.jit(lambda x: x), platforms=["cpu"])(jax.ShapeDtypeStruct((n_in, n_in), jnp.float32))
    aliases = (", output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [0], operand_index = 0, "
               "operand_tuple_indices = []>]") if alias else ""
    text = f"""module @jit_f attributes {{mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32}} {{
  func.func public @main(%arg0: tensor<{n_in}x{n_in}xf32>) -> (tensor<{n_out}x{n_out}xf32>) {{
    %0:2 = stablehlo.custom_call @lapack_spotrf_ffi(%arg0) {{mhlo.backend_config = {{uplo = 76 : ui8}}, mhlo.frontend_attributes = {{num_batch_dims = "0"}}, operand_layouts = [dense<[0, 1]> : tensor<2xindex>]{aliases}, result_layouts = [dense<[0, 1]> : tensor<2xindex>, dense<> : tensor<0xindex>]}} : (tensor<{n_in}x{n_in}xf32>) -> (tensor<{n_out}x{n_out}xf32>, tensor<i32>)
    return %0#0 : tensor<{n_out}x{n_out}xf32>
  }}
}}"""
    with mlir.make_ir_context():
        code = mlir.module_to_bytecode(ir.Module.parse(text))
    bad = dataclasses.replace(exp, mlir_module_serialized=code, out_avals=(jax.core.ShapedArray((n_out, n_out), jnp.float32),),
                              out_shardings_hlo=(None,))
    return bytes(bad.serialize())


def _compile_raw(mesh, blob: bytes, rid: int = 1):
    import hashlib

    return raw_request(mesh.addresses[0], {"op": "compile", "id": rid, "session": mesh.session,
                                           "digest": hashlib.sha256(blob).hexdigest()},
                       keys=mesh.keys, arrays=[np.frombuffer(blob, np.uint8)], timeout_ms=120_000)


def test_a_kernel_call_whose_result_does_not_fit_its_operand_is_refused_at_compile_naming_the_target():
    with mpmd.RemoteMesh.local(num_actors=1) as mesh:
        for n_in, n_out in ((64, 4), (4, 256)):
            reply = _compile_raw(mesh, _spotrf_blob(n_in, n_out, alias=False))
            assert reply.op == "error", reply.header
            msg = reply.header["message"]
            assert "'lapack_spotrf_ffi'" in msg and f"(tensor<{n_in}x{n_in}xf32>) -> (tensor<{n_out}x{n_out}xf32>, tensor<i32>)" in msg
            assert f"JAX writes (tensor<{n_in}x{n_in}xf32>) -> (tensor<{n_in}x{n_in}xf32>, tensor<i32>)" in msg
        assert _compile_raw(mesh, _spotrf_blob(8, 8, alias=True)).op == "reply"  # the form JAX writes is fine
        # The daemon is alive, and a real Cholesky still runs and equals jax.jit's.
        a = np.random.default_rng(0).standard_normal((6, 6)).astype(np.float32)
        spd = a @ a.T + 6 * np.eye(6, dtype=np.float32)
        got = mesh.actor(0).run(jax.jit(jax.numpy.linalg.cholesky), mesh.actor(0).put(spd)).to_numpy()
        np.testing.assert_allclose(got, np.asarray(jax.jit(jax.numpy.linalg.cholesky)(spd)), rtol=1e-5, atol=1e-5)
