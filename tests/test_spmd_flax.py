"""flax's logical-axis sharding through mpmd, written the way flax users write it: nnx.Linear kernels annotated
with `nnx.with_partitioning(init, ("embed", "mlp"))`, logical-to-mesh rules, the PartitionSpecs taken from
the state with `nnx.get_partition_spec` + `flax.linen.logical_to_mesh` and handed to `mpmd.distributed` as
`in_shardings`, an activation constraint with `flax.linen.with_logical_constraint`. Two actors of two devices
each ((1, 2) meshes over ("data", "model")), 1F1B, AdamW: equal to jax.jit of the same step on a single-process
(1, 2) mesh (the test process has 4 host devices, see conftest.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd.testing import make_train_step
from tests.test_pipeline import assert_trees_close

RULES = (("batch", "data"), ("embed", None), ("mlp", "model"))
D, F = 16, 64  # embed, mlp
M, B, T = 4, 8, 4  # microbatches, rows per microbatch, tokens per row


class MegatronMLP(nnx.Module):
    """Column-parallel up-projection ("embed" -> "mlp"), row-parallel down-projection, residual."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(D, F, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                             bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(F, D, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
                               bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = nnx.gelu(self.up(x))
        h = nn.with_logical_constraint(h, ("batch", None, "mlp"))  # rules from the logical_axis_rules context
        return x + self.down(h)


class TwoStageModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.stages = nnx.List([MegatronMLP(rngs), MegatronMLP(rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.stages[0](x)
        x = mpmd.pipeline_yield(x)  # stage 0 ends here
        return self.stages[1](x)


def build():
    """The model's graphdef and parameter State (host values: no mesh in the controller), and the mesh
    PartitionSpecs of the parameters the flax way."""
    with nnx.use_eager_sharding(False):
        model = TwoStageModel(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    logical = nnx.get_partition_spec(params)  # State of Params holding P("embed", "mlp"), ...
    specs = nn.logical_to_mesh(logical, RULES)  # ... mapped to the mesh axes
    return graphdef, params, specs


def loss_of(graphdef):
    def loss(params, mb):
        y = nnx.merge(graphdef, params)(mb["x"])
        return jnp.mean((y - mb["y"]) ** 2)

    return loss


def batches(n, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((M, B, T, D)).astype(np.float32), "y": rng.standard_normal((M, B, T, D)).astype(np.float32)}
            for _ in range(n)]


BATCH_SPEC = nn.logical_to_mesh_axes((None, "batch"), RULES)  # [microbatch, batch, ...]: batch over "data"


def reference(graphdef, params, opt, data, shape=(1, 2)):
    """jax.jit of the undecorated step on a single-process mesh of `shape`, flax's own sharding path."""
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(shape), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        step = jax.jit(make_train_step(loss_of(graphdef), opt, None))
        p = jax.device_put(params, nnx.get_named_sharding(params, mesh))
        o = opt.init(p)
        losses = []
        for b in data:
            b = jax.device_put(b, jax.sharding.NamedSharding(mesh, BATCH_SPEC))
            p, o, loss_value = step(p, o, b)
            losses.append(np.asarray(loss_value))
        if mesh.shape["model"] > 1:  # (jax leaves a size-1 axis out of the spec)
            assert p["stages"][0]["up"]["kernel"].get_value().sharding.spec == P(None, "model")
    return jax.device_get(p), jax.device_get(o), losses


def run_steps(step, params, opt, data):
    """The mpmd `step` over `data`, from `params` and a fresh `opt` state (each step takes the outputs of the one
    before): the last params and optimizer state, and the losses, as RemoteArrays."""
    p, o = params, opt.init(params)
    losses = []
    for b in data:
        p, o, loss_value = step(p, o, b)
        losses.append(loss_value)
    return p, o, losses


def assert_like_reference(got, ref):
    """`run_steps`' result agrees with `reference`'s."""
    (p, o, losses), (rp, ro, rl) = got, ref
    for loss_value, want in zip(losses, rl):
        np.testing.assert_allclose(loss_value.to_numpy(), want, rtol=1e-5)
    assert_trees_close(mpmd.fetch(p), rp)
    assert_trees_close(mpmd.fetch(o), ro)


@pytest.fixture(scope="module")
def mesh():
    with mpmd.RemoteMesh.local(num_actors=2, devices_per_actor=2, mesh_shape=(1, 2), axis_names=("data", "model")) as m:
        yield m


def test_flax_partition_specs_come_out_as_mesh_specs():
    _, params, specs = build()
    s = specs["stages"]
    for i in range(2):
        assert s[i]["up"]["kernel"].get_value() == P(None, "model")
        assert s[i]["up"]["bias"].get_value() == P("model")
        assert s[i]["down"]["kernel"].get_value() == P("model", None)
        assert s[i]["down"]["bias"].get_value() == P(None)
    # the context-rules form of the same thing agrees
    with nnx.logical_axis_rules(RULES):
        assert jax.tree.leaves(nnx.get_partition_spec(params)) == jax.tree.leaves(specs)
    assert BATCH_SPEC == P(None, "data")


def test_flax_logical_sharding_trains_like_jit_on_a_1x2_mesh(mesh):
    graphdef, params, specs = build()
    opt = optax.adamw(1e-2)
    data = batches(3)
    ref = reference(graphdef, params, opt, data)

    with nn.logical_axis_rules(RULES):  # the activation constraint reads the rules while the step is traced
        step = mpmd.distributed(make_train_step(loss_of(graphdef), opt, mpmd.OneFOneB(2)), mesh=mesh,
                                in_shardings=(specs, None, BATCH_SPEC))
        jaxpr, _ = step.trace(params, opt.init(params), data[0])
        assert "sharding_constraint" in str(jaxpr)  # with_logical_constraint really constrained something
        got = run_steps(step, params, opt, data)

    assert_like_reference(got, ref)
    p = got[0]

    # the parameters stay where the pipeline put them, laid out as flax's rules asked
    k0, k1 = p["stages"][0]["up"]["kernel"].get_value(), p["stages"][1]["down"]["kernel"].get_value()
    assert k0.actors == [0] and k1.actors == [1]
    assert k0.sharding.spec == P(None, "model") and k1.sharding.layout == ("model",)
    assert p["stages"][0]["down"]["bias"].get_value().sharding.layout == ()
    # and each device of actor 0 really holds half of the [16, 64] kernel: freeing it frees 2 KiB per device
    before = mesh.actor(0).stats()["device_bytes"]
    k0.delete()
    after = mesh.actor(0).stats()["device_bytes"]
    assert [b - a for a, b in zip(after, before)] == [D * F * 4 // 2] * 2
