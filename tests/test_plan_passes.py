"""The planner's passes (mpmd.compiler.loop_tasks, outside_loop, assemble) called one at a time on a small
traced step, no processes: each gives what the next one needs, its keys are the named types, it leaves its
input as it was, and the passes in sequence give the Programs that plan_step gives."""

import jax
import numpy as np
import optax
import pytest

import mpmd
from mpmd.compiler.assemble import (
    collect_templates,
    donate_buffers,
    emit_programs,
    fuse_units,
    infer_step_transfers,
    order_units,
)
from mpmd.compiler.keys import (
    VALUE_KEY_TYPES,
    Acc,
    ChunkTemplate,
    MbIndex,
    Outer,
    OutputHome,
    PerMb,
    RegionKey,
    TaskTemplate,
)
from mpmd.compiler.loop_tasks import (
    analyse_loop_body,
    canonical_vars,
    find_step_loop,
    plan_loop_tasks,
    schedule_stages,
)
from mpmd.compiler.outside_loop import place_outside_loop
from mpmd.compiler.plan import plan_step
from mpmd.primitives import accumulate_p
from mpmd.step import DistributedFunction
from tests import models
from tests.test_pipeline import make_step


class FakeMesh:
    """Stands in for a RemoteMesh where only tracing runs (no actor is contacted)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


SCHEDULES = {
    "1f1b": (2, lambda: mpmd.OneFOneB(2), 2),
    "zero-bubble": (2, lambda: mpmd.ZeroBubbleH1(2), 2),
    "interleaved": (4, lambda: mpmd.InterleavedOneFOneB(num_stages=4, num_actors=2), 2),
}


def _traced(name="1f1b", num_mb=4):
    """The traced step of an MLP with one stage per layer, trained with adam, and its mesh size."""
    num_stages, schedule, actors = SCHEDULES[name]
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, num_stages, 8)
    opt = optax.adam(1e-3)
    step = make_step(models.mse_loss(models.mlp), opt, schedule())
    outer, _ = DistributedFunction(step, FakeMesh(actors)).trace(params, opt.init(params), models.regression_batch(rng, num_mb, 2, 8))
    return outer, actors


def _front(outer, actors):
    loop = find_step_loop(outer)
    body = analyse_loop_body(loop)
    stages = schedule_stages(loop, body, actors)
    names = canonical_vars(loop, body)
    tasks = plan_loop_tasks(stages, body, names)
    outside = place_outside_loop(loop, body, names, tasks, stages.num_actors)
    return loop, body, stages, names, tasks, outside


def _ordered(outer, actors):
    loop, _, stages, names, tasks, outside = _front(outer, actors)
    ordered = order_units(loop, names, tasks, outside)
    return stages, ordered, infer_step_transfers(ordered)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_value_a_unit_reads_is_an_argument_a_constant_made_earlier_on_its_actor_or_received(name):
    stages, ordered, transfers = _ordered(*_traced(name))
    assert sorted(ordered.units) == list(range(stages.num_actors))
    for a, units in ordered.units.items():
        have = {k for k, homes in ordered.arg_homes.items() if a in homes}
        received = {k for (k, dst) in transfers.source if dst == a}
        for u in units:
            for p in u.parts:
                for k in p.inputs:
                    ok = k in have or k in received or isinstance(k, MbIndex)
                    assert ok, f"{p.label} on actor {a} reads {k}, which nothing before it makes"
                have.update(p.outputs)
    # a received value comes from an actor that makes it (or holds it as an argument)
    for (k, dst), src in transfers.source.items():
        assert src != dst and src in transfers.producers[k]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_loop_tasks_read_and_write_named_keys_and_chain_each_accumulator_on_one_actor(name):
    _, _, stages, _, tasks, outside = _front(*_traced(name))
    scheduled = sum(len(row) for row in stages.table)
    assert 0 < sum(len(us) for us in tasks.units.values()) <= scheduled
    for a, units in tasks.units.items():
        latest: dict = {}  # accumulator var -> its last Acc on this actor
        for u in units:
            (part,) = u.parts
            (task,) = part.label.tasks
            assert stages.actor_of(task.stage) == a
            assert part.template == TaskTemplate(task.stage, task.kind, part.template.accumulators)
            assert RegionKey(task.stage, task.kind) in stages.split.regions
            assert all(isinstance(k, VALUE_KEY_TYPES) for k in [*part.inputs, *part.outputs])
            assert all(isinstance(k, (PerMb, Acc)) for k in part.outputs)
            assert all(k.mb == task.mb for k in part.inputs if isinstance(k, (PerMb, MbIndex)))
            for k in part.inputs:
                if type(k) is Acc:
                    assert latest.get(k.var) == k, f"{part.label} adds to {k}, not to the last sum on actor {a}"
            for k in part.outputs:
                if type(k) is Acc:
                    assert k.upto == task.mb and tasks.acc_home.get(k.var, a) == a
                    latest[k.var] = k
        for step_value, final in tasks.finals.items():
            if tasks.acc_home[step_value.var] == a:
                assert latest[final.var] == final
    for u in [*outside.pre, *outside.post]:
        (part,) = u.parts
        assert isinstance(part.template, ChunkTemplate) and part.template.actor == u.actor
        assert all(type(k) is Outer for k in [*part.inputs, *part.outputs])


def test_fusing_and_donating_keep_each_actor_part_sequence_and_leave_their_input_units_alone():
    stages, ordered, transfers = _ordered(*_traced("1f1b"))
    before = {a: [(u.parts[0], list(u.parts[0].inputs)) for u in us] for a, us in ordered.units.items()}
    fused = fuse_units(ordered, transfers)
    final = donate_buffers(fused, ordered, transfers, stages.num_actors)
    # the inputs are as they were: one unsealed part per unit, inputs untouched, nothing donated
    assert {a: [(u.parts[0], list(u.parts[0].inputs)) for u in us] for a, us in ordered.units.items()} == before
    assert all(len(u.parts) == 1 and not u.inputs and not u.outputs for us in ordered.units.values() for u in us)
    assert not any(u.donate for us in fused.units.values() for u in us)
    for a, us in final.units.items():
        assert [p for u in us for p in u.parts] == [p for p, _ in before[a]]
        assert len(us) < len(before[a])  # 1F1B's last stage fuses its F and B; the pre chunk fuses with 0F0
    # a donated buffer is never a step argument or output, a sent or received value, or an index constant
    moved = {(k, a) for (k, dst), src in transfers.source.items() for a in (src, dst)}
    donated = 0
    for a, us in final.units.items():
        for u in us:
            for pos in u.donate:
                k = u.inputs[pos]
                donated += 1
                assert k not in ordered.arg_keys and k not in ordered.step_output_keys
                assert (k, a) not in moved and not isinstance(k, MbIndex)
    assert donated > 0  # the running gradient sums and adam's state are donated


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_passes_in_sequence_give_the_programs_plan_step_gives(name):
    outer, actors = _traced(name)
    stages, ordered, transfers = _ordered(outer, actors)
    final = donate_buffers(fuse_units(ordered, transfers), ordered, transfers, stages.num_actors)
    templates = collect_templates(final, ordered.avals)
    emitted = emit_programs(ordered, final, transfers, stages.num_actors)
    plan = plan_step(outer, actors)
    assert len(emitted.programs) == len(plan.programs) == stages.num_actors
    for got, want in zip(emitted.programs, plan.programs):
        assert str(got) == str(want)
        assert (got.actor, got.inputs, got.outputs, got.instructions) == (want.actor, want.inputs, want.outputs, want.instructions)
        assert got.executables == want.executables  # templates name no var: equal across two plans
        assert sorted(got.consts) == sorted(want.consts)
    assert emitted.out_homes == plan.out_homes and all(isinstance(h, OutputHome) for h in plan.out_homes)
    assert list(templates) == list(plan.templates)
    assert all(isinstance(p.template, (TaskTemplate, ChunkTemplate)) for us in final.units.values() for u in us for p in u.parts)


def test_find_step_loop_alone_rejects_a_step_without_accumulate_grads():
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, 8)
    batch = models.regression_batch(rng, 2, 2, 8)
    step = lambda p, b: jax.grad(models.mse_loss(models.mlp))(p, jax.tree.map(lambda x: x[0], b))
    outer, _ = DistributedFunction(step, FakeMesh(2)).trace(params, batch)
    with pytest.raises(mpmd.PipelineError, match="never calls mpmd.accumulate_grads"):
        find_step_loop(outer)


def test_find_step_loop_alone_gives_the_loop_and_its_parameters():
    outer, _ = _traced("1f1b", num_mb=3)
    loop = find_step_loop(outer)
    assert loop.eqn.primitive is accumulate_p
    assert loop.num_microbatches == 3 and loop.num_mb_leaves == 2 and loop.num_grads == 4
    assert loop.schedule == mpmd.OneFOneB(2)
    assert len(loop.before) + 1 + len(loop.after) == len(outer.jaxpr.eqns)


def test_an_activation_returned_as_aux_and_sent_to_the_next_stage_equals_jit(mesh2):
    """A value that is both a stage's output to the next stage and a per-microbatch aux output: the two keys
    (PerMb and Acc of the same variable and index) once compared equal as tuples and the step was refused."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import mpmd
    from tests import models

    def aux_step(params, batch):
        def mb(m):
            def loss(p, m):
                h = jnp.tanh(m["x"] @ p[0]["w"] + p[0]["b"])
                h = mpmd.pipeline_yield(h)
                out = jnp.tanh(h @ p[1]["w"] + p[1]["b"])
                return jnp.mean((out - m["y"]) ** 2), h
            (v, h), g = jax.value_and_grad(loss, has_aux=True)(params, m)
            return g, (v, h)
        g, aux = mpmd.accumulate_grads(mb, batch, schedule=mpmd.OneFOneB(2))
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), aux

    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, 8)
    batch = models.regression_batch(rng, 4, 2, 8)
    want = jax.jit(aux_step)(params, batch)
    got = mpmd.fetch(mpmd.distributed(aux_step, mesh=mesh2)(params, batch))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
