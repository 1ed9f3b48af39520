"""Fixes of what a probe of the schedules, the simulator, tune and the mpmd command found: zero costs in tune
(D1), costs that overflow and the command's tracebacks (D2), simulate ignoring remat (D3), an invalid schedule
suggested by an error (D4), InterleavedOneFOneB's documented peak (D5), the table cap (D6), numpy integers (D7),
tune's remat advice (D8). Each test compares with a closed form or the simulator; no actor is started."""

from __future__ import annotations

import json
import math
import os
import re
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpmd
from mpmd.cli import main
from mpmd.schedules import BUILTINS, builtin, validate
from mpmd.schedules.simulator import MAX_COST, Costs, simulate
from mpmd.schedules.validation import MAX_TABLE_TASKS
from tests.test_balance import FakeMesh
from tests.test_pipeline import make_step


def two_segments():
    """A step of 2 marker segments (one pipeline_yield) on 2 microbatches of 2 rows, and its arguments."""
    def loss(p, mb):
        x = jnp.tanh(mb["x"] @ p[0])
        x = mpmd.pipeline_yield(x)
        return jnp.mean((x @ p[1] - mb["y"]) ** 2)

    opt = optax.sgd(0.1)
    params = [np.eye(4, dtype=np.float32)] * 2
    batch = {"x": np.ones((2, 2, 4), np.float32), "y": np.zeros((2, 2, 4), np.float32)}
    return make_step(loss, opt, mpmd.OneFOneB(2)), (params, opt.init(params), batch)


def tune_two(**kw):
    step, args = two_segments()
    return mpmd.tune(step, *args, mesh=FakeMesh(2), microbatches=[2], **kw)


# ---------------------------------------------------------------- D1: zero costs


def test_tune_refuses_segment_costs_that_are_all_zero_before_anything_runs():
    zero = mpmd.SegmentCosts(F=(0, 0), B=(0, 0))
    for calibrate in (True, False):  # (FakeMesh has no actors: reaching calibrate would fail otherwise)
        with pytest.raises(mpmd.PipelineError, match=r"segment costs \(given\) are all zero.*costs=None to measure"):
            tune_two(costs=zero, calibrate=calibrate)
    # a zero segment among positive ones is a cost like any other
    assert tune_two(costs=mpmd.SegmentCosts(F=(0, 1), B=(0, 2)), schedules=["OneFOneB"]).best.predicted > 0


def test_calibrate_takes_its_factor_from_the_candidates_predicted_above_zero(monkeypatch):
    from mpmd import tuning

    # every one at zero: no factor exists, and calibrate says so before running anything, changing nothing
    r = tune_two(costs=mpmd.SegmentCosts(F=(1e-3, 1e-3), B=(2e-3, 2e-3)), schedules=["OneFOneB"])
    r.feasible[0].predicted = 0.0
    with pytest.raises(mpmd.MpmdError, match=r"predicted to take 0 s per step.*no measured / predicted factor"):
        r.calibrate()
    assert r.calibration == 1.0 and r.chosen is None
    # one at zero among the top three: the other two set the factor (not measured / 0)
    r = tune_two(costs=mpmd.SegmentCosts(F=(1e-3, 1e-3), B=(2e-3, 2e-3)), schedules=["GPipe", "OneFOneB", "ZeroBubbleH1"])
    top = r.feasible[:3]
    assert len(top) == 3
    before = [c.predicted for c in top]
    monkeypatch.setattr(tuning.DistributedFunction, "with_schedule", lambda self, s: type("S", (), {"schedule": s})())
    monkeypatch.setattr(tuning, "_timed_round", lambda step, *a: next(
        2.0 * b if b else 1.0 for c, b in zip(top, before) if c.schedule is step.schedule))
    top[1].predicted = 0.0  # (e.g. a candidate whose tasks the costs give no time)
    assert r.calibrate(rounds=1) == pytest.approx(2.0)  # the median of the other two ratios, 2 and 2
    assert [c.predicted for c in top] == pytest.approx([2 * before[0], 0.0, 2 * before[2]])


# ---------------------------------------------------------------- D2: costs that overflow; the command's errors


def test_costs_past_max_cost_are_refused_and_costs_at_it_give_a_finite_step():
    for kw in ({"F": 1e308}, {"B": (1.0, 1e300)}, {"latency": 1e200}, {"overhead": 1e101}, {"activation_bytes": 1e300}):
        with pytest.raises(ValueError, match=re.escape(f"{MAX_COST:g}")):
            Costs(**kw)
    with pytest.raises(ValueError, match=r"transfer of activation_bytes=1e\+90 at bandwidth=1e-20.*larger bandwidth"):
        Costs(activation_bytes=1e90, bandwidth=1e-20)
    with pytest.raises(ValueError, match=re.escape(f"{MAX_COST:g}")):
        mpmd.SegmentCosts(F=(1e308, 1.0), B=(1.0, 1.0))
    p, m = 2, 4
    r = simulate(mpmd.OneFOneB(p), m, Costs(F=MAX_COST, B=MAX_COST, activation_bytes=MAX_COST, bandwidth=1.0))
    assert math.isfinite(r.step_time) and r.step_time >= (m + p - 1) * 2 * MAX_COST  # (1F1B's closed form, plus transfers)
    assert all(0 <= b < 1 for b in r.bubble_per_actor)
    # remat adds a forward to each backward: past MAX_COST, yet the step stays finite and is 1F1B's closed form
    r = simulate(mpmd.OneFOneB(p, remat=(0, 1)), m, Costs(F=MAX_COST, B=MAX_COST))
    assert r.step_time == pytest.approx((m + p - 1) * 3 * MAX_COST)


def test_a_simulation_whose_times_add_up_to_inf_is_refused_not_returned_as_inf_and_nan():
    from mpmd.schedules.simulator import simulate_programs
    from tests.test_simulate import programs_from_table

    schedule = mpmd.OneFOneB(2)
    progs = programs_from_table(schedule, validate(schedule, 4))
    fitted = Costs(routes=(((0, 1), (1e308, 1.0)), ((1, 0), (1e308, 1.0))))  # (routes come from a trace: not capped)
    with pytest.raises(mpmd.ScheduleError, match=r"add up past the largest float.*below 1e\+100"):
        simulate_programs(progs, fitted, name="two")


def test_the_command_refuses_overflowing_costs_with_a_message_not_a_traceback(tmp_path, capsys):
    args = ["simulate", "--schedule", "OneFOneB", "--actors", "2", "--microbatches", "4"]
    with pytest.raises(SystemExit) as e:
        main([*args, "--costs", "F=1e308,B=1e308", "--svg", str(tmp_path / "inf.svg")])
    assert e.value.code == 2 and "Costs.F must be a finite non-negative number (at most 1e+100)" in capsys.readouterr().err
    assert not (tmp_path / "inf.svg").exists()


def test_a_step_of_a_few_subnormals_draws_its_axis(tmp_path):
    path = tmp_path / "tiny.svg"
    assert main(["simulate", "--schedule", "OneFOneB", "--actors", "2", "--microbatches", "4", "--costs", "F=5e-324,B=0",
                 "--svg", str(path)]) == 0
    text = path.read_text()
    assert "nan" not in text and "inf" not in text
    xs = [float(x) for x in re.findall(r'<line x1="([0-9.]+)"', text)]
    assert xs == [70.0, 1080.0]  # ticks at 0 and at the step: the two ends of the time axis
    with pytest.raises(ValueError, match="step time is inf"):
        from mpmd.schedules.draw import svg

        svg(type("T", (), {"name": "t", "step_time": math.inf, "timeline": (), "num_actors": 0, "bubble": 0.0})())


def test_the_command_prints_an_mpmd_or_value_error_of_a_subcommand_on_one_line_with_exit_2(monkeypatch, capsys):
    import mpmd.schedules.simulator as simulator

    args = ["simulate", "--schedule", "OneFOneB", "--actors", "2", "--microbatches", "4"]

    def fails(*a, **k):
        raise mpmd.PipelineError("the programs cannot run")

    monkeypatch.setattr(simulator, "simulate", fails)
    assert main(args) == 2
    assert capsys.readouterr().err == "mpmd simulate: the programs cannot run\n"
    monkeypatch.undo()

    def bad_picture(self, path, title=None, fmt=None):
        raise ValueError("a timeline picture is 'png' or 'svg'")

    monkeypatch.setattr(simulator.SimResult, "draw", bad_picture)
    assert main([*args, "--svg", "x.svg"]) == 2
    assert capsys.readouterr().err == "mpmd simulate: a timeline picture is 'png' or 'svg'\n"


# ---------------------------------------------------------------- D3: simulate counts remat


def test_simulate_makes_a_remat_stages_backward_pay_its_forward_again():
    p, m = 2, 4
    # 1F1B under F=1, B=2: (m+p-1)(F+B); with every stage remat each B also runs F: (m+p-1)(F+F+B)
    assert simulate(mpmd.OneFOneB(p), m).step_time == (m + p - 1) * 3
    assert simulate(mpmd.OneFOneB(p, remat=(0, 1)), m).step_time == (m + p - 1) * 4
    # one stage, per-stage costs: the same as that stage's B given as B + F
    f, b = (1.0, 2.0, 3.0), (2.0, 4.0, 6.0)
    got = simulate(mpmd.OneFOneB(3, remat=(1,)), 5, Costs(F=f, B=b))
    assert got.step_time == simulate(mpmd.OneFOneB(3), 5, Costs(F=f, B=(2.0, 6.0, 6.0))).step_time
    assert got.step_time > simulate(mpmd.OneFOneB(3), 5, Costs(F=f, B=b)).step_time
    # split backwards: both halves recompute (I and W are Runs of their own), as tune's remat rows count them;
    # stage 0 has no I Run (its W runs the whole backward, I + W): it recomputes once
    zbv = mpmd.ZeroBubbleV(2, remat=(0, 3))
    want = simulate(mpmd.ZeroBubbleV(2), 4, Costs(I=(1, 1, 1, 2), W=(2, 1, 1, 2))).step_time
    assert simulate(zbv, 4).step_time == want > simulate(mpmd.ZeroBubbleV(2), 4).step_time


def test_tune_predicts_a_schedules_own_remat_as_simulate_does():
    seg = mpmd.SegmentCosts(F=(1.0, 1.0), B=(2.0, 2.0))
    remat = tune_two(costs=seg, schedules=[mpmd.OneFOneB(2, remat=(0, 1))]).best
    plain = tune_two(costs=seg, schedules=[mpmd.OneFOneB(2)]).best
    paid = tune_two(costs=mpmd.SegmentCosts(F=(1.0, 1.0), B=(3.0, 3.0)), schedules=[mpmd.OneFOneB(2)]).best
    assert remat.schedule.remat == (0, 1) and remat.predicted == pytest.approx(paid.predicted)
    assert remat.predicted > plain.predicted
    m = remat.num_microbatches
    assert remat.predicted == pytest.approx(simulate(mpmd.OneFOneB(2, remat=(0, 1)), m, Costs(F=1.0, B=2.0)).step_time)


# ---------------------------------------------------------------- D4: the suggested schedules are valid


@pytest.mark.parametrize("stages, actors", [(3, 2), (8, 4), (6, 4), (5, 1), (12, 8), (7, 3)])
def test_the_too_few_actors_error_suggests_schedules_that_fit_the_mesh(stages, actors):
    from mpmd.compiler.loop_tasks import check_schedule

    with pytest.raises(mpmd.PipelineError, match=f"needs {stages} actors but the mesh has {actors}") as e:
        check_schedule(mpmd.OneFOneB(stages), stages, actors)
    names = "|".join(BUILTINS)
    suggested = re.findall(rf"\b((?:{names})\([^()]*\))", str(e.value).split("e.g.", 1)[1])
    assert suggested
    for text in suggested:
        s = eval(text, dict(BUILTINS))  # raises ScheduleError if the suggestion is no valid schedule
        assert s.num_actors <= actors and s.num_stages <= stages
        if s.balance is None:  # runs the step's stages as they are
            assert s.num_stages == stages
        validate(s, max(s.min_microbatches, 2 * actors))
    interleaved = [t for t in suggested if t.startswith("InterleavedOneFOneB")]
    fits = [d for d in range(2, min(actors, stages - 1) + 1) if stages % d == 0]
    assert len(interleaved) == bool(fits)  # offered exactly when a divisor spreads the stages evenly


# ---------------------------------------------------------------- D5: InterleavedOneFOneB's documented peak


def documented_interleaved_peak():
    """The peak column of InterleavedOneFOneB's row in mpmd.schedules.builtin's table, as a function of p, v, m,
    a and q (implicit products made explicit), capped at v*m as the footnote says."""
    row = next(line for line in builtin.__doc__.splitlines() if line.strip().startswith("InterleavedOneFOneB("))
    expr = row.split("m >= p", 1)[1].replace("*", "").strip()
    expr = re.sub(r"(?<=[\w)])(?=\()|(?<=\))(?=\w)", "*", expr)
    assert "at most vm" in builtin.__doc__
    return lambda **names: min(eval(expr, {}, names), names["v"] * names["m"])


def test_interleaved_1f1b_peak_activations_are_what_the_docstring_says_for_any_microbatch_count():
    assert "q = ceil(m / max(1, m // p))" in builtin.__doc__
    peak = documented_interleaved_peak()
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in range(1, 3 * p + 2):
                q = math.ceil(m / max(1, m // p))
                got = simulate(mpmd.InterleavedOneFOneB(v * p, p), m).peak_activations
                assert got == tuple(peak(p=p, v=v, m=m, a=a, q=q) for a in range(p)), (p, v, m)
    # p < m < 2p holds more than m = 2p: one round of all m microbatches
    assert simulate(mpmd.InterleavedOneFOneB(8, 4), 7).peak_activations[0] > simulate(mpmd.InterleavedOneFOneB(8, 4), 8).peak_activations[0]


# ---------------------------------------------------------------- D6: the table cap


def test_a_table_past_the_cap_is_refused_at_once_with_the_largest_count_that_fits():
    cap = MAX_TABLE_TASKS // 3  # microbatch-stages
    assert cap <= 100_000  # (a simulation at the cap takes seconds; at the old cap of a million, minutes)
    t = time.perf_counter()
    for stages in (8, 1000):
        with pytest.raises(mpmd.ScheduleError, match=rf"at most {cap // stages:,} microbatches with {stages} stages"):
            simulate(mpmd.OneFOneB(stages), cap // stages + 1)
    assert time.perf_counter() - t < 1.0
    assert validate(mpmd.OneFOneB(8), 64)  # (well under: as before)


# ---------------------------------------------------------------- D7: numpy integers


def test_numpy_integers_are_counts_and_come_back_as_ints_but_bools_and_floats_are_not():
    s = mpmd.OneFOneB(np.int64(2), remat=(np.int32(1),), balance=(np.int64(1), np.int64(1)))
    assert repr(s) == "OneFOneB(num_stages=2, balance=(1, 1), remat=(1,))"
    assert type(s.num_stages) is int and all(type(x) is int for x in (*s.remat, *s.balance))
    assert simulate(mpmd.OneFOneB(np.int64(2)), np.int64(4)) == simulate(mpmd.OneFOneB(2), 4)
    inter = mpmd.InterleavedOneFOneB(np.int64(4), np.uint8(2))
    assert repr(inter) == "InterleavedOneFOneB(num_stages=4, num_actors=2)" and type(inter.num_actors) is int
    assert simulate(inter, np.int16(4)) == simulate(mpmd.InterleavedOneFOneB(4, 2), 4)
    assert mpmd.ZeroBubbleV(np.int64(2)) == mpmd.ZeroBubbleV(2)
    for bad in (True, np.bool_(True), 2.0, np.float64(2)):
        with pytest.raises(mpmd.ScheduleError, match="num_stages must be a positive int"):
            mpmd.OneFOneB(bad)
        with pytest.raises(mpmd.ScheduleError, match="number of microbatches must be a positive int"):
            simulate(mpmd.OneFOneB(2), bad)


# ---------------------------------------------------------------- D8: tune's advice


def test_no_fit_advice_says_pass_remat_only_when_remat_was_not_passed():
    costs = mpmd.SegmentCosts(F=(1.0, 1.0), B=(2.0, 2.0))
    # Under what the step's arguments alone take per actor (128 bytes here), nothing but room helps: said so, and
    # neither remat nor other groupings are compiled for it.
    r = tune_two(costs=costs, schedules=["OneFOneB"], memory_limit=1, remat=True)
    assert not any(c.schedule.remat for c in r.candidates) and "no grouping can fit" in r.candidates[0].rejected
    with pytest.raises(mpmd.MpmdError, match=r"raise memory_limit or use more actors \(the step's arguments alone"):
        r.best
    for remat in (False, True):  # over that floor (128 bytes) but under every peak (232-360 bytes)
        r = tune_two(costs=costs, schedules=["OneFOneB"], memory_limit=200, remat=remat)
        assert r.candidates and not r.feasible
        assert remat == any(c.schedule.remat for c in r.candidates)  # the remat rows tried, and over the limit too
        with pytest.raises(mpmd.MpmdError, match="no candidate fits") as e:
            r.best
        first = str(e.value).splitlines()[0]
        assert ("pass remat=True" in first) != remat
        assert ("remat=True was tried" in first) == remat


# ---------------------------------------------------------------- a probe's Custom tables (2026-12-04)


def test_custom_names_the_mistake_not_its_symptom():
    ok = (("0F0", "0F1", "0B0", "0B1"), ("1F0", "1B0", "1F1", "1B1"))
    with pytest.raises(mpmd.ScheduleError, match=r"num_stages=3, but the table has no task of stage 2 \(it names stages 0, 1\)"):
        mpmd.Custom(num_stages=3, order=ok)  # (said: 'places stage 2 on actor 2, but its actors are 0..1')
    with pytest.raises(mpmd.ScheduleError, match=r"order\[0\]\[2\] \(0F1000000\) names microbatch 1000000, but the table's tasks "
                                                 r"name 2 microbatches"):
        mpmd.Custom(num_stages=2, order=(("0F0", "0B0", "0F1000000"), ("1F0", "1B0")))  # (said: more than a table holds)
    with pytest.raises(mpmd.ScheduleError, match="not a dict; e.g. order=tuple"):
        mpmd.Custom(num_stages=2, order={0: ("0F0", "0B0"), 1: ("1F0", "1B0")})  # (said: 'order[0] ... got 0')
    assert simulate(mpmd.Custom(num_stages=2, order=ok), 2).timeline == simulate(mpmd.OneFOneB(2), 2).timeline


@pytest.mark.parametrize("p,m,before,after", [(2, 1, 10, 9), (2, 2, 14, 13), (3, 1, 14, 13), (3, 3, 22, 21), (4, 4, 30, 29)])
def test_zero_bubble_v_below_a_full_v_runs_no_w_before_an_i_the_step_waits_on(p, m, before, after):
    """A probe (an exact search over every per-actor order): at m < 2p - 1 ZB-V ran a W before an I on the critical
    path (m=1 on 2 actors: actor 1 ran 2W0 before 1I0; 10 units where 9 do). Ws are moved later where that
    shortens the step; the peaks stay, and from a full V on (m >= 2p - 1) the table is as before: 6m + p - 1."""
    s = mpmd.ZeroBubbleV(p)
    r = simulate(s, m, Costs(F=1, B=2, I=1, W=1))
    assert r.step_time == after < before
    table = s.tasks(m)
    for row in table:  # the same tasks, each actor's Fs and Is in the order they were
        assert sorted(map(str, row)) == sorted(map(str, _zbv_rows(p, m)[table.index(row)]))
        assert [t for t in row if t.kind != "W"] == [t for t in _zbv_rows(p, m)[table.index(row)] if t.kind != "W"]
    full = 2 * p - 1
    assert simulate(s, full, Costs(F=1, B=2, I=1, W=1)).step_time == 6 * full + p - 1
    assert s.tasks(full) == _zbv_rows(p, full)


def _zbv_rows(p, m):
    from mpmd.schedules.builtin import _zbv_actor

    return [_zbv_actor(p, a, m) for a in range(p)]


@pytest.mark.parametrize("m", [1, 2])
def test_zero_bubble_v_below_a_full_v_trains_like_jit(mesh2, m):
    from tests import models
    from tests.test_pipeline import run_both

    rng = np.random.default_rng(m)
    params = models.mlp_params(rng, 4)
    run_both(mesh2, models.mse_loss(models.mlp), params, [models.regression_batch(rng, m, 3, 16) for _ in range(2)],
             mpmd.ZeroBubbleV(2))


def test_what_a_schedule_writer_meets_says_what_to_write():
    """A second probe of schedules as users write them: a torch pipeline_order's None idle slots were refused ("None
    is not a task"); a subclass placing 4 stages on 2 actors through actor_of alone was told to return 4 task lists
    (num_actors defaults to num_stages); a table splitting backwards for some microbatch counts only was blamed on a
    split_backward the user never wrote; a bad Custom stage_actor was reported as actor_of's; "use 1 microbatches"."""
    with_idle = mpmd.Custom(num_stages=2, order=(("0F0", None, None, "0B0"), (None, "1F0", "1B0")))
    assert with_idle.order == mpmd.Custom(num_stages=2, order=(("0F0", "0B0"), ("1F0", "1B0"))).order
    assert validate(with_idle, 1)

    class TwoPerActor(mpmd.Schedule):
        def actor_of(self, stage):
            return stage // 2

        def tasks(self, m):
            return [[mpmd.Task(s, k, i) for k in "FB" for s in (2 * a, 2 * a + 1)[:: 1 if k == "F" else -1] for i in range(m)]
                    for a in range(2)]

    with pytest.raises(mpmd.ScheduleError, match=r"overrides num_actors too, to return 2"):
        validate(TwoPerActor(num_stages=4), 2)

    class SplitWhenUseful(mpmd.Schedule):
        def tasks(self, m):
            kinds = "FIW" if m > 1 else "FB"
            return [[mpmd.Task(s, k, i) for i in range(m) for k in kinds] for s in range(self.num_stages)]

    with pytest.raises(mpmd.ScheduleError, match=r"reads it from tasks\(min_microbatches\)"):
        validate(SplitWhenUseful(num_stages=1), 2)
    with pytest.raises(mpmd.ScheduleError, match=r"stage_actor\[1\] must name one of the table's 2 rows"):
        validate(mpmd.Custom(num_stages=2, order=(("0F0", "0B0"), ("1F0", "1B0")), stage_actor=(0, 5)), 1)
    with pytest.raises(mpmd.ScheduleError, match=r"use 1 microbatch or write"):
        mpmd.Custom(num_stages=1, order=(("0F0", "0B0"),)).tasks(2)


def test_replaying_a_table_looks_at_each_task_a_bounded_number_of_times_whatever_the_stage_count(monkeypatch):
    """replay_table looked at every actor again in each pass, and a pass moved the backward wave one stage: work
    grew with stages squared (GPipe on 4,000 stages: 169 s to validate, inside the size cap; a probe). A worklist
    looks at an actor again only when the task it waits for has ended: each task's inputs are read a few times."""
    from mpmd.schedules import validation

    calls = 0
    real = validation.task_inputs

    def counted(*a):
        nonlocal calls
        calls += 1
        return real(*a)

    monkeypatch.setattr(validation, "task_inputs", counted)
    schedule = mpmd.GPipe(num_stages=500)
    table = [list(row) for row in schedule.tasks(2)]
    replay = validation.replay_table(table, 500, schedule.actor_of)
    tasks = sum(len(row) for row in table)
    assert not replay.stuck and len(replay.end) == tasks == 2000
    assert replay.end[mpmd.Task(0, "B", 1)] == (2 + 500 - 1) * 2  # GPipe's step: (m + p - 1) (F + B) with unit tasks
    assert calls <= 3 * tasks, calls  # (the pass-per-wave replay: ~500,000)


@pytest.mark.parametrize("where", ["tasks", "actor_of"])
@pytest.mark.parametrize("error", [TypeError, KeyError, RuntimeError])
def test_an_exception_in_a_user_schedules_own_method_names_the_schedule_and_keeps_its_traceback(where, error):
    """A TypeError in a user's tasks() read as 'must return one list of Tasks per actor' with its line lost (`from
    None`); a KeyError or RuntimeError there or in actor_of came out bare, naming no schedule (a probe)."""

    class Buggy(mpmd.GPipe):
        def tasks(self, m):
            if where == "tasks":
                raise error("my bug")
            return super().tasks(m)

        def actor_of(self, stage):
            if where == "actor_of":
                raise error("my bug")
            return super().actor_of(stage)

    with pytest.raises(mpmd.ScheduleError, match=rf"Buggy.*\.{where}\(\d\) raised {error.__name__}: .*my bug") as e:
        mpmd.validate(Buggy(num_stages=2), 2)
    assert isinstance(e.value.__cause__, error)


def test_an_exception_in_a_generator_tasks_names_the_schedule_too():
    """A tasks() written as a generator runs as the table is read: its error was 'must return one list of Tasks per
    actor' with no cause (a review)."""

    class Lazy(mpmd.GPipe):
        def tasks(self, m):
            yield from super().tasks(m)
            raise KeyError("my bug")

    with pytest.raises(mpmd.ScheduleError, match=r"Lazy.*\.tasks\(2\) raised KeyError: 'my bug'") as e:
        mpmd.validate(Lazy(num_stages=2), 2)
    assert isinstance(e.value.__cause__, KeyError)


def test_simulate_checks_its_output_names_before_any_work(tmp_path, capsys):
    """Two outputs named alike overwrote each other (both 'wrote'); an unwritable one failed after the table was
    printed and the outputs before it written (a probe). Each is refused first, nothing printed or written."""
    base = ["simulate", "--schedule", "OneFOneB", "--actors", "2", "--microbatches", "4"]
    same = str(tmp_path / "same.svg")
    assert main([*base, "--svg", same, "--trace", same]) == 2
    err = capsys.readouterr()
    assert "--svg and --trace both name" in err.err and "microbatches" not in err.out and not os.path.exists(same)
    first = str(tmp_path / "first.svg")
    assert main([*base, "--svg", first, "--trace", str(tmp_path / "no" / "such" / "t.json")]) == 2
    err = capsys.readouterr()
    assert "cannot write --trace" in err.err and "is not a directory" in err.err and not os.path.exists(first) and not err.out
    assert main([*base, "--svg", str(tmp_path)]) == 2 and "is a directory" in capsys.readouterr().err
    assert main([*base, "--svg", first, "--trace", str(tmp_path / "t.json")]) == 0
    assert os.path.getsize(first) > 0 and json.loads((tmp_path / "t.json").read_text())


# ---------------------------------------------------------------- a probe of hand-written schedules (session 36)


@pytest.mark.parametrize("order", [(("0F0", "0B0"), ("1F0",)), (("0F0", "0F1", "0B0", "0B1"), ("1F0", "1F1"))])
def test_a_forward_only_table_with_a_backward_whose_next_stage_has_none_is_refused_naming_the_missing_tasks(order):
    """An evaluation loop (forward_only) needs F tasks alone; a table giving stage 0 backwards but stage 1 none met a
    bare KeyError (Task(stage=1, kind='B', mb=0)) in the deadlock proof, from validate, simulate and a real evaluation
    step alike (a probe): stage 0's backward reads stage 1's, so those are missing."""
    m = len(order[1])
    schedule = mpmd.Custom(2, order=order)
    want = " ".join(f"1B{i}" for i in range(m))
    with pytest.raises(mpmd.ScheduleError, match=rf"tasks missing from the schedule: {want}; this loop computes no gradients"):
        validate(schedule, m, forward_only=True)
    with pytest.raises(mpmd.ScheduleError, match="tasks missing"):
        simulate(schedule, m, Costs(F=1.0, B=2.0), forward_only=True)
    # the same table with stage 1's backwards too is complete; with none at all, too
    full = mpmd.Custom(2, order=(order[0], tuple(t for i in range(m) for t in (f"1F{i}", f"1B{i}"))))
    assert validate(full, m, forward_only=True)
    fwd = mpmd.Custom(2, order=tuple(tuple(t for t in row if "F" in t) for row in order))
    assert simulate(fwd, m, Costs(F=1.0), forward_only=True).step_time == m + 1  # (m + p - 1) forwards of 1


def test_custom_takes_stage_actor_none_as_the_default_placement_and_refuses_one_that_is_no_sequence():
    """`stage_actor=None` met "'NoneType' object is not iterable" (a probe): it is the default, stage s on actor s."""
    order = (("0F0", "0B0"), ("1F0", "1B0"))
    assert mpmd.Custom(2, order=order, stage_actor=None).actor_of(1) == 1
    for bad in ("01", 5, {0: 0, 1: 1}):
        with pytest.raises(mpmd.ScheduleError, match="stage_actor must be a sequence with one actor per stage"):
            mpmd.Custom(2, order=order, stage_actor=bad)


def test_a_task_is_written_in_ascii_digits():
    """Arabic-Indic digits parsed as a task ("٠F٠" read as 0F0; a probe); a number of thousands of digits met Python's
    int-conversion limit instead of the task's message."""
    from transport.program import Task

    assert Task.parse(" 12W3 ") == Task(12, "W", 3)
    for bad in ("٠F٠", "1" * 5000 + "F0", "0F"):
        with pytest.raises(ValueError, match="is not a task"):
            Task.parse(bad)
    with pytest.raises(mpmd.ScheduleError, match=r"order\[0\]\[0\].*is not a task"):
        mpmd.Custom(1, order=(("٠F٠", "0B0"),))


def test_simulate_programs_checks_its_costs_as_simulate_does():
    """simulate_programs took Costs of 3 per-stage values for 2-stage Programs silently, and a dict met
    "'dict' object has no attribute 'cores'" (a probe); `mpmd.simulate` refuses both."""
    from mpmd.schedules.simulator import simulate_programs
    from transport.program import Label, Program, Recv, Run, Send, Task

    def run(i, ins, outs, task):
        return Run(i, ins, outs, Label.of(Task.parse(task)))

    progs = [Program(0, [0], [3], [run(0, (0,), (1,), "0F0"), Send(1, 1, 1), Recv(2, 1, 2, "float32", (2,)),
                                   run(1, (1, 2), (3,), "0B0")]),
             Program(1, [], [], [Recv(0, 0, 1, "float32", (2,)), run(0, (0,), (1,), "1F0"), run(1, (1,), (2,), "1B0"),
                                 Send(2, 0, 2)])]
    assert simulate_programs(progs, Costs(F=1.0, B=2.0)).step_time == 6.0  # F, F, B, B
    with pytest.raises(mpmd.ScheduleError, match=r"Costs.F has 3 per-stage values for 2 stages"):
        simulate_programs(progs, Costs(F=(1.0, 1.0, 1.0), B=2.0))
    with pytest.raises(mpmd.ScheduleError, match="costs must be mpmd.Costs.*got dict"):
        simulate_programs(progs, {"F": 1.0})


class _SwapsLater(mpmd.OneFOneB):
    """1F1B on 2 actors whose `actor_of` answers as 1F1B for its first `honest` calls, then swaps the two actors (a
    counter in a user's method: the answer changes from call to call)."""

    def __init__(self, honest: int) -> None:
        super().__init__(num_stages=2)
        object.__setattr__(self, "_calls", [0, honest])  # (not a field: the schedule stays hashable and equal to itself)

    def actor_of(self, stage: int) -> int:
        self._calls[0] += 1
        a = super().actor_of(stage)
        return a if self._calls[0] <= self._calls[1] else 1 - a


def test_a_schedule_whose_actor_of_answers_otherwise_when_asked_again_is_refused_naming_the_stage():
    """Its first answers checked, its later ones contradicted them: validate said "task 0F0 is on actor 0 but stage 0
    belongs to actor 1", as if the table were wrong (a probe). validate asks each stage twice and refuses an answer
    that changed, naming the stage and both answers."""
    with pytest.raises(mpmd.ScheduleError, match=r"actor_of\(0\) answered 0, then 1 when asked again; a stage lives on one actor: "
                                                 r"actor_of must give the same answer at every call"):
        validate(_SwapsLater(honest=2), 4)


def test_a_step_compiles_and_simulates_on_the_placement_validate_proved_not_on_later_answers_of_actor_of():
    """The compiler asked actor_of again in every pass (follow_inputs, recompute_cheap, each task's placement): a
    schedule answering as 1F1B while validated (each stage asked twice) and swapped after compiled Programs running
    stage 1's tasks on actor 0 and stage 0's on actor 1, against the table validate proved deadlock-free (a probe;
    answers changing within the passes failed check_programs with messages about internal buffers, or split a stage
    over two actors). The placement is read once per trace: every Run's tasks are on the actor of its row in the
    validated table, as for 1F1B itself, and simulate times the same placement."""
    from mpmd.compiler.plan import plan_step
    from mpmd.step import DistributedFunction
    from tests import models

    rng = np.random.default_rng(0)
    params, batch = models.mlp_params(rng, 2, 8), models.regression_batch(rng, 4, 2, 8)
    opt = optax.adam(1e-3)

    def placed(schedule):
        step = make_step(models.mse_loss(models.mlp), opt, schedule)
        outer, _ = DistributedFunction(step, FakeMesh(2)).trace(params, opt.init(params), batch)
        return [{str(t) for ins in prog.instructions if type(ins).__name__ == "Run" for t in ins.label.tasks}
                for prog in plan_step(outer, 2).programs]

    table = validate(mpmd.OneFOneB(2), 4)
    assert placed(_SwapsLater(honest=4)) == placed(mpmd.OneFOneB(2)) == [{str(t) for t in row} for row in table]
    costs = Costs(F=(1.0, 3.0), routes=(((0, 1), (5.0, math.inf)),))  # (a slow 0 -> 1: which actor holds stage 0 matters)
    got, want = simulate(_SwapsLater(honest=4), 4, costs), simulate(mpmd.OneFOneB(2), 4, costs)
    assert got.transfers == want.transfers and got.step_time == want.step_time


def test_a_table_missing_many_tasks_says_how_many_the_first_few_and_which_stages_not_every_one():
    """A subclass that forgets odd stages' backwards (8 stages x 64 microbatches), and a sparse Custom table validated
    for 10001 microbatches, listed every missing task on the error's first line: 1,272 and 137,837 characters (a
    probe). Now: the count, the first 12, and per stage and kind the microbatches whose task is missing."""
    from dataclasses import dataclass

    from mpmd.schedules import Task

    @dataclass(frozen=True)
    class Forgetful(mpmd.Schedule):
        def tasks(self, m):
            return [[Task(s, "F", i) for i in range(m)] + ([Task(s, "B", i) for i in range(m)] if s % 2 == 0 else [])
                    for s in range(self.num_stages)]

    with pytest.raises(mpmd.ScheduleError) as e:
        validate(Forgetful(8), 64)
    first = str(e.value).splitlines()[0]
    assert first.startswith("tasks missing from the schedule: 256 tasks, 1B0 1B1 ") and len(first) < 400, first
    assert all(f"stage {s} B: every microbatch" in first for s in (1, 3, 5, 7)) and "stage 0" not in first
    sparse = mpmd.Custom(num_stages=1, order=(("0F0", "0B0", "0F10000", "0B10000"),))
    with pytest.raises(mpmd.ScheduleError) as e:
        validate(sparse, 10001)
    assert len(str(e.value)) < 1000 and "19998 tasks" in str(e.value) and "stage 0 F: 9999 of 10001 microbatches" in str(e.value)


def test_a_subclass_whose_tasks_refuse_one_microbatch_is_told_to_set_min_microbatches():
    """The Schedule base class reads `split_backward` from `tasks(min_microbatches)`; a subclass that runs microbatches
    in pairs (and raises for 1) without setting min_microbatches failed `validate(s, 4)` with its own bare ValueError
    naming a count the caller never asked for (a probe). Now a ScheduleError naming the property, the count, and
    what to set; with min_microbatches set it validates."""
    from dataclasses import dataclass

    from mpmd.schedules import Task

    @dataclass(frozen=True)
    class Paired(mpmd.Schedule):
        def tasks(self, m):
            if m % 2:
                raise ValueError(f"Paired runs microbatches in pairs; got {m}")
            return [[Task(s, k, i) for k in ("F", "B") for i in range(m)] for s in range(self.num_stages)]

    with pytest.raises(mpmd.ScheduleError, match=r"Paired\(num_stages=1\)\.split_backward raised ValueError: Paired runs "
                                                 r"microbatches in pairs; got 1 .*tasks\(1\): set min_microbatches"):
        validate(Paired(1), 4)

    @dataclass(frozen=True)
    class PairedTwo(Paired):
        @property
        def min_microbatches(self):
            return 2

    assert len(validate(PairedTwo(1), 4)[0]) == 8


def test_a_schedule_on_fewer_actors_than_the_mesh_warns_naming_the_idle_ones():
    """A README probe (2026-12-07): OneFOneB(num_stages=2) on a 3-actor mesh left actor 2 idle without a word (more
    stages than actors is an error that says what to do). It runs, with a warning naming the idle actors; a schedule
    that uses every actor says nothing."""
    import warnings

    from mpmd.compiler.loop_tasks import check_schedule

    with pytest.warns(UserWarning, match=r"OneFOneB\(num_stages=2\) runs on 2 of the mesh's 3 actors: actor 2 gets no work"):
        check_schedule(mpmd.OneFOneB(2), 2, 3)
    with pytest.warns(UserWarning, match=r"actors 1, 2, 3 get no work"):
        check_schedule(mpmd.GPipe(1), 1, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_schedule(mpmd.OneFOneB(2), 2, 2)
        check_schedule(mpmd.InterleavedOneFOneB(4, 2), 4, 2)
