"""Bad arguments to the schedule and simulator API get an error naming what was wrong and what to give (not a raw
TypeError later, nor a silent wrong result); numpy integers and 0-d / 1-d numpy and JAX arrays are taken where a
Python int or number (or a sequence of them) is. No actor is started, except by the last tests (local meshes' counts,
`mesh.actor`, `actor.run` and step arguments), which start one."""

from __future__ import annotations

import asyncio
import math
import os
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpmd
from mpmd.cli import main
from mpmd.schedules import Task, validate
from mpmd.schedules.montecarlo import simulate_monte_carlo
from mpmd.schedules.simulator import Costs, simulate
from transport.program import Label, Program, Run


def gpipe(n, m, stage=int, mb=int):
    return [[Task(stage(s), "F", mb(i)) for i in range(m)] + [Task(stage(s), "B", mb(i)) for i in range(m)] for s in range(n)]


@dataclass(frozen=True)
class FloatActors(mpmd.Schedule):
    @property
    def num_actors(self):
        return 2.0

    def tasks(self, m):
        return gpipe(self.num_stages, m)


@dataclass(frozen=True)
class StrMin(mpmd.Schedule):
    @property
    def min_microbatches(self):
        return "1"

    def tasks(self, m):
        return gpipe(self.num_stages, m)


@dataclass(frozen=True)
class Table(mpmd.Schedule):
    """GPipe with its stages and microbatches made by `stage` and `mb` (float, bool, np.int64, ...)."""

    stage: type = int
    mb: type = int

    def tasks(self, m):
        return gpipe(self.num_stages, m, self.stage, self.mb)


def test_validate_refuses_schedule_fields_and_task_indices_that_are_not_ints():
    for schedule, said in ((FloatActors(2), r"num_actors must be a positive int, got 2\.0"),
                           (StrMin(2), r"min_microbatches must be an int, got '1'"),
                           (Table(2, stage=float), r"actor 0's task 0 has stage 0\.0; a Task's stage and microbatch are ints"),
                           (Table(2, mb=float), r"actor 0's task 0 has microbatch 0\.0"),
                           (Table(2, mb=bool), r"actor 0's task 0 has microbatch False")):
        for check in (validate, simulate):
            with pytest.raises(mpmd.ScheduleError, match=said):
                check(schedule, 2)
    assert validate(Table(2, stage=np.int64, mb=np.int64), 2) == validate(mpmd.GPipe(2), 2)  # numpy integers are ints


def trace_of(labels_per_actor, steps=1):
    """A Trace of `steps` steps; actor a runs its labels one after another, 1 ms each."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace

    t = Trace()
    for k in range(steps):
        t.steps.append({})
        for a, labels in enumerate(labels_per_actor):
            x, clock = ActorStep(a, k, 0.0, 0.0), 0.0
            for label in labels:
                x.runs.append(RunSpan(label, clock, clock, clock, clock + 1e-3))
                clock += 1e-3
            x.end = clock
            t.steps[k][a] = x
    return t


def test_fit_costs_takes_numpy_ints_and_refuses_bad_cores_and_more_stages_than_the_trace_ran():
    from mpmd.observe.trace import fit_costs

    t = trace_of([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]], steps=2)
    assert fit_costs(t, 2, step=np.int64(0)) == fit_costs(t, 2, step=0)
    assert fit_costs(t, np.int64(2)) == fit_costs(t, 2)
    assert fit_costs(t, 2, cores=np.int64(1)) == fit_costs(t, 2, cores=1)
    for cores in ("1", 1.0, True, 0):
        with pytest.raises(mpmd.MpmdError, match=rf"fit_costs: cores must be a positive int .* or None, got {cores!r}"):
            fit_costs(t, 2, cores=cores)
    with pytest.raises(mpmd.MpmdError, match=r"num_stages=5 but the traced step runs 2 stages: pass num_stages=2"):
        fit_costs(t, 5)


def test_costs_take_0d_arrays_as_numbers_and_1d_numpy_and_jax_arrays_as_per_stage_values():
    assert Costs(F=np.array(1.5)) == Costs(F=jnp.mean(jnp.array([1.0, 2.0]))) == Costs(F=1.5)
    assert Costs(F=jnp.array([1.0, 2.0]), B=np.array([2.0, 3.0])) == Costs(F=(1.0, 2.0), B=(2.0, 3.0))
    assert Costs(latency=np.array(0.5), bandwidth=np.array(1e9)) == Costs(latency=0.5, bandwidth=1e9)
    assert type(Costs(F=np.array(1.5)).F) is float and type(Costs(F=jnp.array([1.0])).F[0]) is float
    for bad in ({"a": 1.0}, {1.0}, "1", math.nan, -1.0, np.array(math.nan), jnp.array([1.0, -1.0]), np.ones((2, 2))):
        with pytest.raises(ValueError, match=r"Costs\.F must be a finite non-negative number"):
            Costs(F=bad)
    two = Costs.from_timings({"1F": 1.0, "F": jnp.array(0.5)}, num_stages=2)
    assert Costs.from_timings({"1F": 1.0, "F": 0.5}, num_stages=np.int64(2)) == two == Costs(F=(0.5, 1.0))
    assert Costs.from_timings({("F", np.int64(1)): 1.0, "F": 0.5}, num_stages=2) == two


class Duck:
    """A schedule by its attributes (mpmd.schedules.validation.Schedule), not a subclass of mpmd.Schedule."""

    num_stages = num_actors = 2
    min_microbatches = 1
    split_backward = False
    balance = None
    remat = ()

    def actor_of(self, s):
        return s

    def tasks(self, m):
        return gpipe(2, m)


def test_accumulate_grads_takes_the_duck_typed_schedule_that_validate_and_with_schedule_take():
    def fn(mb):
        return mb * 2, mb.sum()

    batch = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert validate(Duck(), 2)
    got = mpmd.accumulate_grads(fn, batch, schedule=Duck())
    want = mpmd.accumulate_grads(fn, batch, schedule=mpmd.GPipe(2))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("flags, said", [(["--width", "10", "--heads", "4"], "--width 10 must be a multiple of --heads 4"),
                                         (["--try-microbatches", "0,2"], "--try-microbatches: takes comma-separated counts above 0"),
                                         (["--try-microbatches", "2,x"], "--try-microbatches: takes comma-separated counts above 0"),
                                         # (said before the actors start and measure for minutes, exit 2: it was 1; a probe)
                                         (["--try-microbatches", "3,5"], "--try-microbatches 3,5: none divides the batch's 32 rows")])
def test_cli_tune_argument_errors_exit_2_with_the_usage_like_argparses_own(flags, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and err.startswith("usage: mpmd tune")


def test_cli_tune_with_xla_costs_does_not_say_it_measures(monkeypatch, capsys):
    from mpmd.cli import tune

    class Stop(Exception):
        pass

    def stop(**kw):
        raise Stop

    monkeypatch.setattr(tune, "load_gpt", lambda: None)
    monkeypatch.setattr(tune, "gpt_setup", lambda *a, **kw: (None, None, None, None))
    monkeypatch.setattr(mpmd.RemoteMesh, "local", stop)
    for flags, said in ((["--xla-costs"], "mpmd tune: estimating the segments' costs with XLA's cost analysis"),
                        ([], "mpmd tune: measuring the segments on 2 actors")):
        with pytest.raises(Stop):
            main(["tune", *flags])
        err = capsys.readouterr().err
        assert said in err and ("measuring" in err) == (not flags)


def test_draw_takes_fmt_in_any_case_as_it_takes_the_paths_ending(tmp_path):
    r = simulate(mpmd.GPipe(2), 2)
    r.draw(tmp_path / "a.svg", fmt="svg")
    r.draw(tmp_path / "b.svg", fmt="SVG")
    r.draw(tmp_path / "c.SVG")
    assert (tmp_path / "a.svg").read_text() == (tmp_path / "b.svg").read_text() == (tmp_path / "c.SVG").read_text()
    with pytest.raises(ValueError, match=r"a timeline picture is 'png' or 'svg', got fmt='gif'"):
        r.draw(tmp_path / "d.svg", fmt="GIF")
    pytest.importorskip("matplotlib")
    for name in ("e.svg", "f.out", "g"):  # fmt="png" writes a PNG at exactly that path (it followed the ending: a probe)
        r.draw(tmp_path / name, fmt="png")
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("runs", ["5", None, 2.0, True, 0, 10**6])
def test_simulate_monte_carlo_names_a_runs_that_is_not_a_positive_int(runs):
    """(10**6 replays ran on for minutes: at most 10,000; a probe.)"""
    programs = [Program(a, [], [], [Run(i, (), (10 * a + i,), Label.of(Task(a, "F", i))) for i in range(2)]) for a in range(2)]
    assert simulate_monte_carlo(programs, Costs(), runs=np.int64(2)).step_time == 2.0
    with pytest.raises(ValueError, match=rf"simulate_monte_carlo: runs must be an int from 1 to 10000 \(how many replays\), got {runs!r}"):
        simulate_monte_carlo(programs, Costs(), runs=runs)


def test_simulate_monte_carlo_checks_its_costs_and_programs_as_simulate_programs_does():
    """Per-stage costs for 3 stages were taken for a 2-stage step (35.0 came out), None met an AttributeError, and an
    empty list of programs came out as a step of 0 from simulate_programs (a probe)."""
    from mpmd.schedules.simulator import simulate_programs

    programs = [Program(a, [], [], [Run(i, (), (10 * a + i,), Label.of(Task(a, "F", i))) for i in range(2)]) for a in range(2)]
    for replay in (simulate_monte_carlo, simulate_programs):
        with pytest.raises(mpmd.ScheduleError, match="Costs.F has 3 per-stage values for 2 stages"):
            replay(programs, Costs(F=(1, 2, 3)))
        with pytest.raises(mpmd.ScheduleError, match="programs must be a list of Programs, one per actor, got \\[\\]"):
            replay([], Costs())
    for bad in (None, {"F": 1}):
        with pytest.raises(mpmd.ScheduleError, match=f"costs must be mpmd.Costs .* got {type(bad).__name__}"):
            simulate_monte_carlo(programs, bad)


@pytest.mark.parametrize("counts", [[1, 2], np.array([1, 2]), jnp.array([1, 2])])
def test_balance_counts_as_a_list_or_a_1d_array_are_the_tuple_of_them(counts):
    """balance=[4, 5] and np.array([4, 5]) were refused, asking for the tuple (found by a probe)."""
    assert mpmd.OneFOneB(2, balance=counts) == mpmd.OneFOneB(2, balance=(1, 2))
    assert mpmd.ZeroBubbleV(1, balance=counts).balance == (1, 2)
    with pytest.raises(mpmd.ScheduleError, match="balance must be"):
        mpmd.OneFOneB(2, balance=[1.5, 2])


def test_two_custom_tables_of_one_shape_have_different_names_and_one_table_one_name():
    """tune's table printed two different Custom tables under one name (found by a probe)."""
    a = mpmd.Custom(2, order=[["0F0", "0B0"], ["1F0", "1B0"]])
    b = mpmd.Custom(2, order=[["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])
    again = mpmd.Custom(2, order=(("0F0", "0B0"), ("1F0", "1B0")))
    assert repr(a) != repr(b) and repr(a) == repr(again) and repr(a).startswith("Custom(num_stages=2, 2 actors, table ")


def test_local_mesh_counts_and_actor_indices_are_checked_before_anything_starts():
    """A probe: `RemoteMesh.local(num_actors=10**6)` spawned daemons without end (370 of them, load 500 on two
    cores, no error after 600 s); None, '2' and 2.0 failed in an internal comparison; True was taken as 1; and
    `mesh.actor('0')` failed comparing a str with an int."""
    import mpmd.runtime.launch.local as local

    for n in (None, "2", 2.0, True, 0):
        with pytest.raises(ValueError, match=rf"num_actors must be a whole number >= 1, got {re.escape(repr(n))}"):
            mpmd.RemoteMesh.local(num_actors=n)
    with pytest.raises(ValueError, match=r"num_actors=1000000: each local actor is a daemon process .* GiB of memory and swap"):
        mpmd.RemoteMesh.local(num_actors=10**6)
    with pytest.raises(ValueError, match="devices_per_actor must be a whole number >= 1, got None"):
        mpmd.RemoteMesh.local(num_actors=1, devices_per_actor=None)
    assert local.host_memory() is not None  # (Linux: the check is on)
    with mpmd.RemoteMesh.local(num_actors=1) as mesh:
        for bad in ("0", None, 0.0, True):
            with pytest.raises(TypeError, match="mesh.actor takes an actor index, an int from 0 to 0"):
                mesh.actor(bad)
        assert mesh.actor(np.int64(0)) is mesh.actor(0)


def test_actor_run_takes_python_scalars_out_and_names_host_callbacks():
    """A probe: `actor.run` of a plain function returning a Python float failed with "'float' object has no
    attribute 'shape'" (jax.jit returns an Array), and one calling jax.debug.print with jax's bare
    "serialization of host_callbacks is not yet implemented"."""
    import jax

    with mpmd.RemoteMesh.local(num_actors=1) as mesh:
        a = mesh.actor(0)
        v, one = a.run(lambda x: (x * 2, 1.0), np.ones(2, np.float32))
        assert v.to_numpy().tolist() == [2.0, 2.0] and one.to_numpy() == np.asarray(jax.jit(lambda: 1.0)())
        with pytest.raises(mpmd.MpmdError, match=r"cannot send a function that calls back to Python \(jax.debug.print"):
            a.run(lambda x: (jax.debug.print("x {}", x), x)[1], np.ones(2, np.float32))
        assert a.run(jax.jit(lambda x: x + 1), np.ones(2, np.float32)).to_numpy().tolist() == [2.0, 2.0]
        with pytest.raises(TypeError, match=r"fn must be the function to run on the actor .* got int 5"):  # (was bare)
            a.run(5, np.ones(2, np.float32))
        with pytest.raises(TypeError, match=r"mesh must be the mpmd.RemoteMesh to load into, got NoneType"):
            mpmd.restore("/nonexistent", None, [])  # (an AttributeError from inside; a probe)


def test_pipeline_yield_called_eagerly_is_the_identity_itself():
    """Outside any trace the marker gives back the very object (it gave a jax literal for a Python 3; a probe);
    inside one it marks, also on a constant."""
    import jax

    x, tree = np.ones(2), {"a": 3, "b": [2.0]}
    assert mpmd.pipeline_yield(3) == 3 and type(mpmd.pipeline_yield(3)) is int
    assert mpmd.pipeline_yield(x) is x and mpmd.pipeline_yield(tree) is tree
    jaxpr = jax.make_jaxpr(lambda v: mpmd.pipeline_yield(np.ones(2)) * v)(3.0)
    assert "pipeline_yield" in str(jaxpr)


@pytest.mark.filterwarnings("ignore:Python iterable type 'generator' is treated as a leaf:DeprecationWarning")  # (jax's own)
def test_an_argument_jax_cannot_use_is_named_by_its_own_type():
    """A generator as a batch leaf was reported as "a ndarray" (the object array numpy made of it; a probe), then
    with the hint for an object array ("build it with a numeric dtype"): it says to take the values from it."""
    import jax

    def step(p, batch):
        return p * 2

    with mpmd.RemoteMesh.local(num_actors=1) as mesh:
        with pytest.raises(mpmd.PipelineError, match=r"argument args\[1\]\['x'\] is a generator, which is not a valid JAX type.*"
                                                   r"not iterators.*np.stack\(list\(it\)\)"):
            mpmd.distributed(step, mesh=mesh)(np.ones(2, np.float32), {"x": (i for i in range(3))})
        # Any object numpy wraps in an object array got that hint too (a probe: a ShapeDtypeStruct, as jax.jit's
        # .lower takes): a shape without values says to pass values; another object, what a step takes.
        dist = mpmd.distributed(step, mesh=mesh)
        with pytest.raises(mpmd.PipelineError, match=r"argument args\[0\] is a ShapeDtypeStruct \(float32\[2\]\): a shape "
                                                   r"without values.*np.zeros\(s.shape, s.dtype\)"):
            dist.compile(jax.ShapeDtypeStruct((2,), np.float32), np.ones(2, np.float32))
        with pytest.raises(mpmd.PipelineError, match=r"argument args\[1\] is an object, which is not a valid JAX type: a step "
                                                   r"takes arrays, numbers, and pytrees"):
            dist(np.ones(2, np.float32), object())
        with pytest.raises(mpmd.PipelineError, match=r"args\[1\] is a ndarray.*dtype=object.*np.stack"):  # (a real one)
            dist(np.ones(2, np.float32), np.array([object(), 1], dtype=object))
        # Refused by jax.jit at the call, these reached the step's own arithmetic (or the lowering, whose failure then
        # disturbed the next step; a probe): refused here too, naming the argument.
        for value, said in ((np.ones(2, ">f4"), r"non-native byte order \(>f4\).*newbyteorder"),
                            (np.array(["2026-12-05"], "datetime64[D]"), r"dtype datetime64\[D\] \(dates and times\).*astype"),
                            (np.array([3], "timedelta64[s]"), r"dtype timedelta64\[s\]"),
                            (range(3), r"is a range, which is not a valid JAX type: pass np.arange")):
            with pytest.raises(mpmd.PipelineError, match=r"argument args\[1\] .*" + said):
                dist(np.ones(2, np.float32), value)


def test_cli_tune_says_counts_in_its_own_flag_and_runs_as_python_m_mpmd_cli(capsys):
    """`mpmd tune --try-microbatches 3` advised "pass counts that do, e.g. microbatches=[2, 4, ...]", mpmd.tune's
    argument rather than the command's flag, and `python -m mpmd.cli` had no __main__ (a probe)."""
    import subprocess
    import sys

    with pytest.raises(SystemExit) as e:
        main(["tune", "--try-microbatches", "3", "--xla-costs"])
    said = capsys.readouterr().err
    assert e.value.code == 2
    assert "--try-microbatches 3: none divides" in said and "e.g. --try-microbatches 2,4," in said and "microbatches=[" not in said
    out = subprocess.run([sys.executable, "-m", "mpmd.cli", "simulate", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: mpmd simulate"), out.stderr[-500:]


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_cli_tune_says_why_nothing_fits_in_its_own_flags_and_tune_refuses_a_closed_mesh(capsys):
    """`mpmd tune --memory-limit-mib 1` printed the table and exited 1 without the library's "no candidate fits ...
    raise memory_limit, pass remat=True" (a probe): it says it now, in the command's flags, and the table once. And mpmd.tune with
    costs="xla" on a closed mesh returned a whole table, the winner failing only when run: refused at once."""
    assert main(["tune", "--actors", "2", "--layers", "2", "--width", "64", "--microbatches", "4", "--rows", "2",
                 "--try-microbatches", "4", "--memory-limit-mib", "1", "--xla-costs"]) == 1
    out, err = capsys.readouterr()
    assert (out + err).count("mpmd.tune: 0 of 4 candidates fit") == 1  # (the table once: the error's copy was printed too)
    assert "mpmd tune: no candidate fits: all 4 were rejected" in err
    assert "raise --memory-limit-mib, pass --remat or mark more stage boundaries" in err and "memory_limit," not in err
    mesh = mpmd.RemoteMesh.local(num_actors=1)
    mesh.close()

    def step(params, batch):
        return mpmd.accumulate_grads(lambda mb: jax.value_and_grad(lambda p: jnp.sum(mb @ p))(params), batch)

    with pytest.raises(mpmd.MpmdError, match="tune: this RemoteMesh is closed"):
        mpmd.tune(mpmd.distributed(step, mesh=mesh), np.ones((2, 2), np.float32), np.ones((2, 3, 2), np.float32), costs="xla")


def test_hurried_arguments_are_named_before_anything_starts(tmp_path):
    """A probe's list of wrong arguments that got an error naming something else: startup_timeout NaN ("cannot convert
    float NaN to integer"), 0 ("took longer ... start fewer"), a str; log_level=10 ("expected str ... not int");
    static_argnums=1.5 ("'float' object is not iterable"); for_step='x' ("a step of another mesh"); put(x, spec='bad')
    ("needs actors with several devices"). Each names its argument now; no daemon starts for the first ones."""
    for bad in (float("nan"), 0, -1, "5", True, float("inf")):
        with pytest.raises(ValueError, match=r"startup_timeout must be a positive, finite number of seconds"):
            mpmd.RemoteMesh.local(num_actors=1, startup_timeout=bad)
    for bad in (10, "LOUD", None):
        with pytest.raises(ValueError, match=r"log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL"):
            mpmd.RemoteMesh.local(num_actors=1, log_level=bad)
    with mpmd.RemoteMesh.local(num_actors=1, log_level="info") as mesh:  # (any case, as the daemon's flag takes it)
        for flag in ("static_argnums", "donate_argnums"):
            with pytest.raises(mpmd.PipelineError, match=rf"{flag} must be ints \(argument positions\), got 1.5"):
                mpmd.distributed(lambda a, b: a, mesh=mesh, **{flag: 1.5})
        params = np.ones(3, np.float32)
        mpmd.save(tmp_path / "ck", params)
        with pytest.raises(mpmd.CheckpointError, match=r"for_step must be a step made with mpmd.distributed .*got str 'x'"):
            mpmd.restore(tmp_path / "ck", mesh, like=params, for_step="x")
        for bad in ("bad", 123):
            with pytest.raises(mpmd.MpmdError, match=r"put: spec must be a PartitionSpec .*got (str 'bad'|int 123)"):
                mesh.actor(0).put(params, spec=bad)
        np.testing.assert_array_equal(mesh.actor(0).put(params).to_numpy(), params)


def test_a_with_block_over_a_closed_mesh_is_refused_as_it_enters():
    """`with mesh:` over a closed mesh entered without a word and the first call inside said closed (a probe); it is
    refused as it enters, as `with` over a closed file is, and the block's body never runs."""
    mesh = mpmd.RemoteMesh.local(num_actors=1, transport="none")
    mesh.close()
    ran = []
    with pytest.raises(mpmd.MpmdError, match=r"this RemoteMesh is closed: make a new one"):
        with mesh:
            ran.append(1)

    async def in_async_with():
        async with mesh:
            ran.append(2)

    with pytest.raises(mpmd.MpmdError, match=r"this RemoteMesh is closed: make a new one"):
        asyncio.run(in_async_with())
    assert ran == []


def test_actor_run_on_a_closed_mesh_says_closed_and_stages_nothing(monkeypatch):
    """`actor.run` on a closed mesh staged its host arguments' puts first: the right "closed" came after a log line
    about shared memory and a "coroutine ... was never awaited" warning when the unsent puts were collected (a
    probe). Nothing is staged now: only the error."""
    import jax

    mesh = mpmd.RemoteMesh.local(num_actors=1)
    a = mesh.actor(0)
    mesh.close()
    staged = []
    monkeypatch.setattr(mesh, "put_requests", lambda *args: staged.append(args))
    with pytest.raises(mpmd.MpmdError, match="this RemoteMesh is closed"):
        a.run(jax.jit(lambda v: v + 1), np.ones((256, 128), np.float32))
    assert staged == []


def test_a_misspelt_keyword_to_remote_mesh_local_is_refused_before_any_daemon_starts(monkeypatch):
    """`RemoteMesh.local(2, mesh_shap=(1, 1))` started both daemons and then raised RemoteMesh.__init__'s TypeError,
    8 s later (a probe). Refused first, naming what it passes on."""
    from mpmd.runtime import mesh as mesh_module

    def no_daemons(*args, **kwargs):
        raise AssertionError("a daemon was started")

    monkeypatch.setattr(mesh_module, "start_local", no_daemons)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'mesh_shap'; .* axis_names, .*mesh_shape"):
        mpmd.RemoteMesh.local(num_actors=2, mesh_shap=(1, 1))

    class Tagged(mpmd.RemoteMesh):  # (a subclass that takes **kwargs judges its own: not refused here)
        def __init__(self, *args, tag=None, **kwargs):
            super().__init__(*args, **kwargs)

    with pytest.raises(AssertionError, match="a daemon was started"):
        Tagged.local(num_actors=1, heartbeat_timeout=30.0)


def test_a_ray_placement_error_lists_the_clusters_resources_without_rays_own():
    """The placement error listed Ray's CPU_group_<id> / CPU_group_0_<id> resources of earlier placement groups beside
    the cluster's own (a probe)."""
    from mpmd.runtime.launch.ray import _fmt

    got = _fmt({"CPU": 4.0, "GPU": 1.0, "memory": 2e9, "node:10.0.0.1": 1.0, "object_store_memory": 1e9,
                "CPU_group_0_ab12": 1.0, "CPU_group_ab12": 2.0, "bundle_group_ab12": 1000.0})
    assert got == "{CPU: 4, GPU: 1, memory: 2e+09}"


def test_public_arguments_a_fuzzing_probe_got_through_are_refused_naming_them(tmp_path):
    """A probe of every public name's arguments: transfer_timeout=np.int64(2) passed the check and msgpack refused
    it on the wire (2**70 overflowed there); cpus_per_actor='2' met a bare comparison; mesh_shape as a generator was
    used up by its own check, and a dict read as its keys; save(wait='no') was taken for True, load(verify=2)
    passed; save('') wrote into the working directory (where keep= prunes); loaders=5 and from_rendezvous(None)
    met bare Python errors; RemoteArray.is_deleted was a property where jax.Array's is a method."""
    from mpmd.runtime.arguments import check_seconds

    assert check_seconds("t", np.int64(2)) == 2.0 and type(check_seconds("t", np.float32(1.5))) is float
    for kw, said in (({"transfer_timeout": 2**70}, "transfer_timeout must be a positive, finite number of seconds"),
                     ({"cpus_per_actor": "2"}, "cpus_per_actor"), ({"cpus_per_actor": [1, 1]}, "cpus_per_actor"),
                     ({"cpus_per_actor": True}, "cpus_per_actor"), ({"devices_per_actor": 2**70}, "at most 4096"),
                     ({"devices_per_actor": 2, "mesh_shape": (d for d in (1, 2)), "axis_names": ("a", "b")}, "mesh_shape must be"),
                     ({"devices_per_actor": 2, "mesh_shape": {1: 2}, "axis_names": ("a",)}, "mesh_shape must be")):
        with pytest.raises(ValueError, match=said):
            mpmd.RemoteMesh.local(num_actors=1, **kw)
    with pytest.raises(TypeError, match="loaders= is a list of 'package.module:function' names, got int 5"):
        mpmd.RemoteMesh.local(num_actors=1, loaders=5)
    for cache in (5, "", [".cache"]):
        with pytest.raises(TypeError, match="cache_dir must be True .*, False or None .* or a directory"):
            mpmd.RemoteMesh.local(num_actors=1, cache_dir=cache)
    with pytest.raises(TypeError, match="from_rendezvous: where must be a directory every node sees"):
        mpmd.RemoteMesh.from_rendezvous(None, 2)
    with pytest.raises(TypeError, match="mpmd.save: wait must be True or False, got str 'no'"):
        mpmd.save(str(tmp_path / "c"), {"x": np.ones(2)}, wait="no")
    with pytest.raises(ValueError, match="mpmd.save: the checkpoint directory is an empty name"):
        mpmd.save("", {"x": np.ones(2)})
    not_utf8 = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run-\xff")  # (a name Linux takes; the actors could not be told it)
    for where, call in (("mpmd.save", lambda: mpmd.save(not_utf8, {"x": np.ones(2)})), ("mpmd.load", lambda: mpmd.load(not_utf8))):
        with pytest.raises(ValueError, match=rf"{where}.*: the checkpoint directory .* is not UTF-8 text"):
            call()
    assert not os.path.lexists(not_utf8)  # (nothing made: an empty directory was left behind)
    with pytest.raises(TypeError, match=r"mpmd.save: the checkpoint directory must be a path \(str or os.PathLike\), got bytes"):
        mpmd.save(os.fsencode(str(tmp_path / "b")), {"x": np.ones(2)})
    mpmd.save(str(tmp_path / "c"), {"x": np.ones(2)})
    with pytest.raises(TypeError, match="mpmd.load: verify must be True or False, got int 2"):
        mpmd.load(str(tmp_path / "c"), verify=2)
    with mpmd.RemoteMesh.local(num_actors=1, transfer_timeout=np.int64(30)) as mesh:  # (a numpy number: taken)
        x = mesh.actor(0).put(np.arange(3.0))
        with pytest.raises(TypeError, match="mpmd.restore: verify must be True or False, got str 'no'"):
            mpmd.restore(str(tmp_path / "c"), mesh, like={"x": np.ones(2)}, verify="no")
        assert x.is_deleted() is False
        x.delete()
        assert x.is_deleted() is True
