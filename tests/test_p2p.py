"""Actor-to-actor transfers over the TCP data plane, driven by hand-written Programs (Send/Recv only),
through the real interpreter and real daemons."""

import itertools

import ml_dtypes
import numpy as np
import pytest

import mpmd
from mpmd.program import Label, Program, Recv, Send
from transport.protocol import dtype_name

_ids = itertools.count(10_000)


def transfer_programs(pairs):
    """pairs: list of (src, dst, tag, array). Builds one program per actor of the 2-actor mesh:
    the sender's inputs are its arrays, the receiver's outputs are what it received."""
    progs = {a: Program(a, [], []) for a in (0, 1)}
    for i, (src, dst, tag, arr) in enumerate(pairs):
        sb, rb = 2 * i, 2 * i + 1
        progs[src].inputs.append(sb)
        progs[src].instructions.append(Send(sb, dst, tag, Label("xfer")))
        progs[dst].instructions.insert(0, Recv(rb, src, tag, dtype_name(arr.dtype), arr.shape, Label("xfer")))
        progs[dst].outputs.append(rb)
    return progs


def run_transfers(mesh, pairs):
    progs = transfer_programs(pairs)
    pid = next(_ids)
    for a, p in progs.items():
        mesh.run(mesh.conn(a).request("load_program", {"program": p.encode(pid, [])}))
    inputs = {0: [], 1: []}
    outputs = {0: [], 1: []}
    for src, dst, tag, arr in pairs:
        inputs[src].append(mesh.actor(src).put(arr))
        outputs[dst].append(mesh.new_buffer_id())

    async def go():
        import asyncio

        return await asyncio.gather(*(mesh.conn(a).request("run_program", {
            "program": pid, "step": 0, "inputs": [r.buffers[a] for r in inputs[a]], "outputs": outputs[a]}) for a in (0, 1)))

    mesh.run(go())
    got = {a: [mpmd.RemoteArray(mesh, {a: b}, (), np.float32) for b in outputs[a]] for a in (0, 1)}
    results = []
    seen = {0: 0, 1: 0}
    for src, dst, tag, arr in pairs:
        r = got[dst][seen[dst]]
        seen[dst] += 1
        results.append(mesh._get(dst, r.buffers[dst]))
    return results


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.int64, np.uint8, np.bool_, np.complex64]
SHAPES = [(), (0,), (1,), (3, 0), (17,), (4, 5, 6)]


def test_transfers_are_exact_for_many_dtypes_and_shapes(mesh2):
    rng = np.random.default_rng(0)
    pairs = []
    for i, (dt, shape) in enumerate(itertools.product(DTYPES, SHAPES)):
        a = (rng.standard_normal(shape) * 10).astype(dt) if dt != np.bool_ else rng.random(shape) > 0.5
        pairs.append((i % 2, 1 - i % 2, i, a))
    for (src, dst, tag, a), b in zip(pairs, run_transfers(mesh2, pairs)):
        assert b.dtype == a.dtype and b.shape == a.shape and b.tobytes() == a.tobytes(), (a.dtype, a.shape)


def test_many_concurrent_transfers_in_both_directions_with_out_of_order_tags(mesh2):
    rng = np.random.default_rng(1)
    tags = rng.permutation(200).tolist()  # receives are posted in a different order than sends go out
    pairs = [(t % 2, 1 - t % 2, t, rng.standard_normal((t % 7, 64)).astype(np.float32)) for t in tags]
    for (src, dst, tag, a), b in zip(pairs, run_transfers(mesh2, pairs)):
        np.testing.assert_array_equal(b, a)


def test_a_transfer_of_the_wrong_shape_fails_naming_both_actors_and_the_tag(mesh2):
    a = np.ones((3, 4), np.float32)
    progs = transfer_programs([(0, 1, 5, a)])
    progs[1].instructions[0] = Recv(1, 0, 5, "float32", (4, 3), Label("xfer"))
    pid = next(_ids)
    for act, p in progs.items():
        mesh2.run(mesh2.conn(act).request("load_program", {"program": p.encode(pid, [])}))
    src = mesh2.actor(0).put(a)

    async def go():
        import asyncio

        return await asyncio.gather(
            mesh2.conn(0).request("run_program", {"program": pid, "step": 0, "inputs": [src.buffers[0]], "outputs": []}),
            mesh2.conn(1).request("run_program", {"program": pid, "step": 0, "inputs": [], "outputs": [mesh2.new_buffer_id()]}),
            return_exceptions=True)

    ok, err = mesh2.run(go())
    assert isinstance(err, mpmd.RemoteError) and err.remote_type == "TransferError"
    assert "actor 1 expected float32[4, 3] from actor 0" in str(err) and "tag 5" in str(err)
    assert mesh2.actor(1).ping() > 0


def test_a_failing_stage_aborts_the_step_on_every_actor_and_the_mesh_stays_usable(mesh2):
    """A stage that raises (here: an input never put) must not leave the other actor waiting forever."""
    import jax
    import optax

    from tests import models
    from tests.test_pipeline import make_step

    rng = np.random.default_rng(2)
    params = models.mlp_params(rng, 2)
    opt = optax.sgd(0.1)
    dist = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    batch = models.regression_batch(rng, 4, 2, 16)
    p, o, _ = dist(params, opt.init(params), batch)
    bogus = jax.tree.map(lambda x: x, p)
    bogus[1]["w"] = mpmd.RemoteArray(mesh2, {1: 424242}, p[1]["w"].shape, np.float32)
    with pytest.raises(mpmd.RemoteError, match="no buffer 424242"):
        dist(bogus, o, batch)
    assert all(mesh2.actor(a).stats()["running"] == 0 for a in (0, 1))
    p2, o2, losses = dist(p, o, batch)
    assert np.isfinite(losses.to_numpy()).all()
