"""Remat of a stage (`remat=` on a schedule): its backward recomputes its forward, so between a microbatch's F
and B only the stage's inputs are kept. Results equal jax.jit (real actors); the planned Programs keep fewer
bytes (the simulator's peak per actor, from the same Programs the actors run); bad `remat` is refused."""

import numpy as np
import optax
import pytest

import mpmd
from mpmd import testing as models
from mpmd.compiler.plan import plan_step
from mpmd.schedules.simulator import Costs, simulate_programs
from mpmd.step import DistributedFunction
from tests.test_balance import FakeMesh, uneven_loss, uneven_setup
from tests.test_pipeline import make_step, run_both


@pytest.mark.parametrize("schedule", [mpmd.OneFOneB(2, remat=(0,)), mpmd.GPipe(2, remat=(0, 1)),
                                      mpmd.ZeroBubbleH1(2, remat=(0,))], ids=["1F1B-0", "GPipe-01", "ZBH1-0"])
def test_remat_stages_train_equal_to_jax_jit(mesh2, schedule):
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, 16, 3)  # 2 stages of 3 tanh layers: 3 activations per stage and microbatch
    batches = [models.regression_batch(rng, 4, 3, 16) for _ in range(2)]
    run_both(mesh2, models.mse_loss(models.mlp), params, batches, schedule)


def test_remat_on_grouped_segments_equals_jax_jit(mesh2):
    params, batch = uneven_setup(num_mb=4, rows=8)
    run_both(mesh2, uneven_loss, params, [batch], mpmd.OneFOneB(2, balance=(3, 5), remat=(0, 1)), optax.adam(1e-3))


def peaks(schedule, m=4):
    """Peak bytes per actor of the planned Programs (simulated with unit costs)."""
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, 64, 4)  # 2 stages of 4 tanh layers
    batch = models.regression_batch(rng, m, 32, 64)
    opt = optax.sgd(1e-3)
    step = DistributedFunction(make_step(models.mse_loss(models.mlp), opt, schedule), FakeMesh(2))
    outer, _ = step.trace(params, opt.init(params), batch)
    plan = plan_step(outer, 2)
    sim = simulate_programs(plan.programs, Costs(F=(1.0, 1.0), B=(2.0, 2.0)))
    return sim.peak_bytes, plan


def test_remat_lowers_the_planned_peak_of_the_remat_stage_only():
    base, _ = peaks(mpmd.GPipe(2))
    first, _ = peaks(mpmd.GPipe(2, remat=(0,)))
    # GPipe keeps all 4 microbatches' activations of stage 0 (4 tanh layers of 32 x 64 floats) until the
    # backward; with remat only each microbatch's input to the stage (the batch rows) stays.
    assert first[0] < base[0] and first[1] == base[1]
    assert base[0] - first[0] >= 4 * 3 * 32 * 64 * 4  # at least 3 of the 4 activations per microbatch no longer kept


@pytest.mark.parametrize("bad", [(2,), (-1,), (0, 0), ("0",), (True,), 0])
def test_bad_remat_is_refused_naming_the_schedule(bad):
    with pytest.raises(mpmd.ScheduleError, match="remat"):
        mpmd.OneFOneB(2, remat=bad)


def test_remat_is_normalised_and_v_shapes_take_it():
    assert mpmd.OneFOneB(2, remat=[1, 0]).remat == (0, 1)
    assert mpmd.OneFOneB(3, remat=np.array([2, 0])).remat == (0, 2)  # as balance= takes an array (refused: a probe)
    assert mpmd.ZeroBubbleV(2, remat=(3,)).remat == (3,)
    with pytest.raises(mpmd.ScheduleError, match="remat"):
        mpmd.DualPipeV(2, remat=(4,))


def test_a_compiled_steps_simulation_counts_the_remat_as_mpmd_simulate_does(mesh2):
    """step.simulate of the compiled Programs and mpmd.simulate of the schedule agree on a remat schedule: the
    remat stage's backward pays its forward again (1F1B, p=2, m=4, F=1, B=2, stage 0 remat: B0 = 3)."""
    schedule = mpmd.OneFOneB(2, remat=(0,))
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, 16, 2)
    batch = models.regression_batch(rng, 4, 3, 16)
    opt = optax.sgd(1e-3)
    step = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, schedule), mesh=mesh2)
    costs = Costs(F=1.0, B=2.0)
    want = mpmd.simulate(schedule, 4, costs).step_time
    assert want > mpmd.simulate(mpmd.OneFOneB(2), 4, costs).step_time
    assert step.simulate(params, opt.init(params), batch, costs=costs).step_time == pytest.approx(want)


def test_a_compiled_steps_simulation_refuses_costs_for_another_number_of_stages(mesh2):
    """step.simulate took per-segment costs (8 values) for a step grouped into 2 stages and returned a wrong time
    silently, or a bare ValueError for other counts, where mpmd.simulate refuses them (a probe)."""
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, 16, 2)
    batch = models.regression_batch(rng, 4, 3, 16)
    opt = optax.sgd(1e-3)
    step = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    for n in (1, 3, 8):
        with pytest.raises(mpmd.ScheduleError, match=rf"Costs.F has {n} per-stage values for 2 stages.*runs 2 stages"):
            step.simulate(params, opt.init(params), batch, costs=Costs(F=(1.0,) * n, B=2.0))
    assert step.simulate(params, opt.init(params), batch, costs=Costs(F=(1.0, 1.0), B=2.0)).step_time == pytest.approx(
        mpmd.simulate(mpmd.OneFOneB(2), 4, Costs(F=1.0, B=2.0)).step_time)
