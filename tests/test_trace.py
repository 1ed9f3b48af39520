"""The real-run trace and asynchronous steps, on real daemons."""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpmd
from mpmd.observe.replay import replay_trace
from mpmd.observe.trace import as_sim_result
from tests import models
from tests.test_pipeline import assert_trees_close, make_step
from transport.program import Recv, Run


def test_a_traced_one_f_one_b_step_runs_each_actors_tasks_in_the_schedule_order(mesh2, tmp_path):
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, width=32)
    opt = optax.sgd(0.1)
    schedule = mpmd.OneFOneB(2)
    dist = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, schedule), mesh=mesh2)
    batch = models.regression_batch(rng, 6, 4, 32)
    dist(params, opt.init(params), batch)[2].block_until_ready()  # compiled and warm
    with mesh2.trace() as t:
        out = dist(params, opt.init(params), batch)
    assert len(t.steps) == 1
    measured = as_sim_result(t)  # (no peak activations claimed: a trace does not record them; it printed zeros)
    assert measured.peak_activations == () and "peak activations" not in measured.summary()
    table = schedule.tasks(6)
    for a in range(2):
        ran = [task for label in t.runs(a) for task in label.split("+") if task[0].isdigit()]
        assert ran == [str(task) for task in table[a]]
        spans = t.steps[-1][a].runs
        assert all(r.waited_from <= r.ready and r.start <= r.end for r in spans)
        assert all(x.end <= y.start + 1e-6 for x, y in zip(spans, spans[1:]))  # one after another
        transfers = t.steps[-1][a].transfers
        assert {x.kind for x in transfers} == {"send", "recv"} and all(x.peer == 1 - a for x in transfers)
    # Each Run says when the last of its inputs that came this step arrived: its received inputs' arrival (later
    # only for an input the step's request handed in), never after the interpreter saw them there.
    programs = dist.compile(params, opt.init(params), batch).plan.programs
    reading = 0
    for a in range(2):
        arrived_at = {x.tag: x.end for x in t.steps[-1][a].transfers if x.kind == "recv"}
        tag_of = {ins.buf: ins.tag for ins in programs[a].instructions if isinstance(ins, Recv)}
        runs = [ins for ins in programs[a].instructions if isinstance(ins, Run)]
        for ins, r in zip(runs, t.steps[-1][a].runs, strict=True):
            got = [arrived_at[tag_of[b]] for b in ins.inputs if b in tag_of]
            assert r.arrived is not None and r.arrived <= r.ready + 1e-9, r
            if got:  # (the step's own inputs are all in before its receives are posted: the last arrival is a receive's)
                assert r.arrived == max(got), (r, got)
                reading += 1
    assert reading >= 12  # (each actor's Runs reading an activation or a cotangent: 6 or more per actor)
    # The step replayed over its Programs with its own measured Runs, gaps and hops is the step: every Run's
    # arrival reported, the trace's transfers matched to the Programs' (exact by construction once they are).
    assert replay_trace(t, programs) == pytest.approx(1.0, abs=0.01)
    b = t.breakdown()
    for a in range(2):
        parts = b[a].compute + b[a].waiting + b[a].overhead + b[a].idle
        assert b[a].compute > 0 and parts == pytest.approx(b[a].wall, rel=1e-6)
        # each actor reports the CPU its event loop used over the step (what fit_costs reads the runtime's load
        # from; a report over the step's wall time is dropped by from_wire, tested in test_simulate)
        assert t.steps[-1][a].cpu is not None and t.steps[-1][a].cpu > 0
    text = t.summary()
    assert "compute" in text and "waiting for data" in text and "runtime overhead" in text
    path = tmp_path / "trace.json"
    t.to_perfetto(str(path))
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    assert all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in events)
    assert any(e["name"] == "1F0+1B0" or e["name"] == "1F0" for e in events)
    # complete events on one track nest or follow one another (the trace format's rule: Perfetto drops the others,
    # and dropped most receives, posted together as a step starts; a probe); async ones pair up begin and end
    for key in {(e["pid"], e["tid"]) for e in events}:
        on = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if (e["pid"], e["tid"]) == key)
        assert all(b0 >= a1 - 1.0 or b1 <= a1 + 1.0 for (a0, a1), (b0, b1) in zip(on, on[1:])), key  # (1 µs, as above)
    begins = {(e["cat"], e["id"]): e for e in doc["traceEvents"] if e["ph"] == "b"}
    ends = {(e["cat"], e["id"]): e for e in doc["traceEvents"] if e["ph"] == "e"}
    assert begins.keys() == ends.keys() and all(ends[k]["ts"] >= b["ts"] for k, b in begins.items())
    assert {k[0] for k in begins} >= {"step", "send", "recv"}
    np.testing.assert_allclose(out[2].to_numpy(), jax.jit(make_step(models.mse_loss(models.mlp), opt, None))(
        params, opt.init(params), batch)[2], rtol=1e-5)


def test_k_steps_dispatched_without_fetching_equal_jit(mesh2):
    rng = np.random.default_rng(1)
    params = models.mlp_params(rng, 2)
    opt = optax.adam(1e-2)
    ref = jax.jit(make_step(models.mse_loss(models.mlp), opt, None))
    dist = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    batches = [models.regression_batch(rng, 4, 3, 16) for _ in range(6)]
    rp, ro = params, opt.init(params)
    dp, do = params, opt.init(params)
    ref_losses, losses = [], []
    for b in batches:
        rp, ro, rl = ref(rp, ro, b)
        ref_losses.append(rl)
        dp, do, dl = dist(dp, do, b)  # returns at once: nothing fetched until the end
        losses.append(dl)
    # a trace begun behind steps in flight waits for them first (their time read as the traced step's "waiting for
    # data": 86 of 94 ms behind 6 untraced steps; a probe)
    with mesh2.trace() as t:
        assert all(x.is_ready() for x in losses)
        dp, do, dl = dist(dp, do, batches[0])
    rp, ro, rl = ref(rp, ro, batches[0])
    ref_losses.append(rl)
    losses.append(dl)
    assert len(t.steps) == 1
    for got, want in zip(mpmd.fetch(losses), ref_losses):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_trees_close(dp, rp)
    assert_trees_close(do, ro)


def test_a_traced_two_actor_gpt_step_runs_the_schedules_table(mesh2):
    from tests.test_examples import load

    nnx = pytest.importorskip("flax.nnx")
    gpt = load("gpt")
    model = gpt.GPT(256, 32, 2, 2, 16, 2, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(1e-3)
    schedule = mpmd.ZeroBubbleH1(2)
    step = mpmd.distributed(gpt.make_step(graphdef, opt, schedule), mesh=mesh2)
    data = np.frombuffer(gpt.corpus(1 << 16), np.uint8)
    batch = next(gpt.batches(data, 4, 2, 16, np.random.default_rng(0)))
    step(params, opt.init(params), batch)[2].block_until_ready()
    with mesh2.trace() as t:
        step(params, opt.init(params), batch)[2].block_until_ready()
    table = schedule.tasks(4)
    for a in range(2):
        ran = [task for label in t.runs(a) for task in label.split("+") if task[0].isdigit()]
        assert ran == [str(x) for x in table[a] if str(x) in set(ran)]
        assert len(ran) >= 2 * 4  # every microbatch's F and backward halves (empty ones are skipped)


def test_a_slowed_stage_shows_up_in_the_trace_as_the_other_actors_recorded_wait_for_its_sends():
    """Stage 1 (actor 1) does tens of times stage 0's work. What the trace records must say so: actor 1's Runs
    are the long ones; each backward Run of actor 0 waited for the cotangent that stage 1's Run for the same
    microbatch sent, its wait ending no earlier than that value's arrival and covering the slowed Run; so actor
    0's time is mostly waiting and its measured bubble is the larger. All of it is read off one traced step
    (order, attribution, overlap), not wall-time ratios between two runs, which load on the machine can invert.
    Its own mesh: a traced step must not share actors with other tests' leftover work; each actor on a core of its
    own with single-threaded XLA (unpinned, the slowed stage's matmul threads took both cores, and stage 0's Runs
    measured a third of its time, not a fortieth: a failed CI run)."""
    from mpmd.observe.trace import measured_bubbles

    with mpmd.RemoteMesh.local(num_actors=2, cpus_per_actor=1 if (os.cpu_count() or 1) >= 2 else None) as mesh:
        t = _trace_a_step_with_stage_1_heavier(mesh, extra=40)
    step = t.steps[-1]

    def tasks(label):
        return [x for x in label.split("+") if x[:1].isdigit()]

    heavy = {x: r for r in step[1].runs for x in tasks(r.label) if x.startswith("1")}  # task -> actor 1's Run
    light = [r for r in step[0].runs if any(x.startswith("0") for x in tasks(r.label))]
    microbatches = range(4)
    assert {f"1B{i}" for i in microbatches} <= set(heavy), step[1].runs
    heavy_runs = list({id(r): r for r in heavy.values()}.values())
    heavy_time = sum(r.end - r.start for r in heavy_runs)
    # The slowed stage's work is inside its recorded spans: about 120 matmuls a microbatch (forward and
    # backward) against 2 or 3 in a Run of stage 0.
    assert heavy_time > 3 * sum(r.end - r.start for r in light), (step[0].runs, step[1].runs)

    sent_by = {x.tag: x for x in step[1].transfers if x.kind == "send" and x.peer == 0}
    arrived = {x.tag: x for x in step[0].transfers if x.kind == "recv" and x.peer == 1}
    clock = 0.25 * heavy_time / len(heavy_runs)  # the actors' clocks are aligned by ping round trips, not exactly
    covered = 0.0
    for i in microbatches:
        made = heavy[f"1B{i}"]
        backward = next(r for r in step[0].runs if f"0B{i}" in tasks(r.label))
        sends = [x for x in sent_by.values() if x.label == made.label]
        assert len(sends) == 1 and sends[0].tag in arrived, (i, step[1].transfers, step[0].transfers)
        recv = arrived[sends[0].tag]
        # Actor 0's Run for microbatch i's backward was ready only once the slowed stage's cotangent arrived
        # (one clock: exact), which was after the Run that made it ended (two clocks: up to their alignment).
        assert backward.ready >= recv.end - 1e-6 and recv.end >= made.end - clock, (i, backward, recv, made)
        # and the wait is recorded against that Run: it spans most of the slowed Run's compute.
        covered += max(0.0, min(backward.ready, made.end) - max(backward.waited_from, made.start))
    assert covered > 0.5 * sum(heavy[f"1B{i}"].end - heavy[f"1B{i}"].start for i in microbatches), covered

    b = t.breakdown()
    assert b[0].waiting > b[0].compute and b[0].waiting > 0.5 * heavy_time, b
    bubble = measured_bubbles(t)
    assert bubble[0] > bubble[1], (bubble, b)


def _trace_a_step_with_stage_1_heavier(mesh2, extra):
    def loss(params, mb):
        h = jnp.tanh(mb["x"] @ params[0]["w"])
        h = mpmd.pipeline_yield(h)
        for _ in range(extra):
            h = jnp.tanh(h @ params[1]["w"])
        return jnp.mean((h @ params[1]["w"] - mb["y"]) ** 2)

    rng = np.random.default_rng(3)
    params = [{"w": (rng.standard_normal((256, 256)) / 16).astype(np.float32)} for _ in range(2)]
    batch = {"x": rng.standard_normal((4, 256, 256)).astype(np.float32), "y": rng.standard_normal((4, 256, 256)).astype(np.float32)}
    opt = optax.sgd(0.01)
    dist = mpmd.distributed(make_step(loss, opt, mpmd.OneFOneB(2)), mesh=mesh2)
    dist(params, opt.init(params), batch)[2].block_until_ready()  # compiled and warm
    with mesh2.trace() as t:
        dist(params, opt.init(params), batch)[2].block_until_ready()
    return t


def test_mesh_profile_brings_back_a_jax_profiler_trace_per_actor_beside_mpmds_trace(mesh2, tmp_path, monkeypatch):
    """jax.profiler runs inside each daemon; its xplane files come back and name each actor; a second
    profile starts cleanly after the first (the daemons' profiler was stopped)."""
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, width=32)
    opt = optax.sgd(0.1)
    opt_state = opt.init(params)
    step = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    batch = models.regression_batch(rng, 4, 4, 32)
    step(params, opt_state, batch)[2].block_until_ready()  # compiled outside the profile
    # Inside mesh.trace() a profile is refused before it starts the actors' profilers (a failed one used to leave
    # them running: every later profile on the mesh failed with "already profiling").
    with mesh2.trace():
        with pytest.raises(mpmd.MpmdError, match="inside a mesh.trace\\(\\) block: use one of them"):
            mesh2.profile(tmp_path, run="nested").__enter__()
    for run in ("first", "second"):
        with mesh2.profile(tmp_path, run=run) as prof:
            out = step(params, opt_state, batch)
        jax.block_until_ready(mpmd.fetch(out[2]))
        run_dir = tmp_path / "plugins" / "profile" / run
        xplanes = sorted(p.name for p in run_dir.glob("*.xplane.pb"))
        assert xplanes == ["actor0.xplane.pb", "actor1.xplane.pb"], sorted(os.listdir(run_dir))
        assert all((run_dir / x).stat().st_size > 1000 for x in xplanes)
        events = json.loads((tmp_path / f"mpmd_trace_{run}.json").read_text())["traceEvents"]
        assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
        assert prof.trace is not None and len(prof.trace.steps) == 1
    # Two profiles with the default run name in one second: the second wrote over the first (a probe)
    import mpmd.observe.profile as profile_module

    monkeypatch.setattr(profile_module, "time", types.SimpleNamespace(strftime=lambda fmt: "2026_12_06_01_21_46"))  # (one second)
    runs = []
    for _ in range(2):
        with mesh2.profile(tmp_path / "default") as prof:
            step(params, opt_state, batch)[2].block_until_ready()
        runs.append(prof.run)
    assert runs[0] != runs[1] and all((tmp_path / "default" / "plugins" / "profile" / r).is_dir() for r in runs), runs
    (tmp_path / "a_file").write_text("")
    with pytest.raises(mpmd.MpmdError, match="cannot make the profile directory"):
        mesh2.profile(tmp_path / "a_file").__enter__()
    for blank in ("", "  "):  # ("" profiled into the working directory; a probe)
        with pytest.raises(ValueError, match="logdir must name a directory"):
            mesh2.profile(blank)


def test_a_measured_step_as_a_sim_result_claims_no_peak_activations():
    """`as_sim_result(trace).summary()` printed 'peak activations: a0 0 a1 0', placeholders read as measured (a probe)."""
    from mpmd.schedules.simulator import SimResult

    r = SimResult(1.0, (0.1, 0.2), (), ((), ()), name="measured")
    assert "peak activations" not in r.summary() and "bubble per actor:   a0 0.1000  a1 0.2000" in r.summary()
    assert "peak activations:   a0 2  a1 1" in mpmd.simulate(mpmd.OneFOneB(2), 4).summary()  # (1F1B: p - s in flight)


def test_an_empty_trace_or_a_step_it_does_not_hold_is_an_mpmd_error_naming_what_it_holds():
    """breakdown() of an empty trace and summary(step=3) of a one-step one raised a bare IndexError."""
    from mpmd.observe.trace import Trace

    t = Trace()
    assert t.summary() == "no traced step"
    for call in (t.breakdown, t.window, lambda: t.runs(0)):
        with pytest.raises(mpmd.MpmdError, match=r"no traced step -1: it holds 0 step\(s\); run a step inside"):
            call()
    with pytest.raises(mpmd.MpmdError, match="a step is an int"):
        t.breakdown("a")


def _two_stage_sgd(mesh, seed: int, width: int, scale: float, m: int, rows: int):
    """A 2-stage tanh MLP's 1F1B step with SGD on `mesh`: (params, optax sgd, batch, the distributed step, its loss)."""
    rng = np.random.default_rng(seed)
    params = [{"w": (rng.standard_normal((width, width)) / scale).astype(np.float32)} for _ in range(2)]

    def loss(p, mb):
        return jnp.mean((mpmd.pipeline_yield(jnp.tanh(mb["x"] @ p[0]["w"])) @ p[1]["w"] - mb["y"]) ** 2)

    opt = optax.sgd(0.01)
    batch = {k: rng.standard_normal((m, rows, width)).astype(np.float32) for k in ("x", "y")}
    return params, opt, batch, mpmd.distributed(make_step(loss, opt, mpmd.OneFOneB(2)), mesh=mesh), loss


def test_two_independent_steps_traced_at_once_are_both_recorded_and_the_actors_go_on(mesh2):
    """A README probe (2026-12-07): `with mesh.trace(): step(p, o, b); step(p, o, b)` — two steps of the same
    arguments, in flight together — hung an actor for good in 4 of 4 runs (`Stream.idle` spun on the traced Run's
    finished holder before its callback freed the order token), and every later call failed as a lost actor."""
    params, opt, batch, dist, loss = _two_stage_sgd(mesh2, seed=5, width=64, scale=8, m=4, rows=8)
    want = jax.jit(make_step(loss, opt, None))(params, opt.init(params), batch)[2]
    state = opt.init(params)
    for _ in range(6):
        with mesh2.trace() as t:
            outs = [dist(params, state, batch) for _ in range(2)]
        assert len(t.steps) == 2 and not t.untraced, (len(t.steps), t.untraced)
        for out in outs:
            np.testing.assert_allclose(np.asarray(out[2]), np.asarray(want), rtol=1e-6)


def test_fit_costs_names_an_empty_trace_a_step_out_of_range_and_too_few_stages():
    """fit_costs on bad input raised IndexError (no step, step past the end) and KeyError: (1, 'F') (a trace
    of two stages fitted with num_stages=1); each must say what was wrong and what to pass."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs

    empty = Trace()
    with pytest.raises(mpmd.MpmdError, match=r"the trace holds no step.*mesh\.trace\(\)"):
        fit_costs(empty, 2)
    empty.count("failed")  # (its steps failed: said so, not "call the step inside the block", which it was; a probe)
    with pytest.raises(mpmd.MpmdError, match=r"the trace holds no step: not traced: 1 step\(s\) failed or aborted .*fetch "
                                             r"a step's outputs to see its error"):
        fit_costs(empty, 2)
    t = Trace()
    t.steps.append({})
    for a, labels in enumerate([["0F0", "0B0"], ["1F0", "1B0"]]):  # one step, stage a on actor a
        x, clock = ActorStep(a, 0, 0.0, 0.0), 0.0
        for label in labels:
            x.runs.append(RunSpan(label, clock, clock, clock, clock + 1e-3))
            clock += 1e-3
        x.end = clock
        t.steps[0][a] = x
    assert fit_costs(t, 2).F == pytest.approx((1e-3, 1e-3))  # the good case still fits
    assert fit_costs(t, 2, step=-1).B == pytest.approx((1e-3, 1e-3))
    with pytest.raises(mpmd.MpmdError, match=r"runs stage 1 .*num_stages=1.*at least 2"):
        fit_costs(t, 1)
    with pytest.raises(mpmd.MpmdError, match=r"step=5 but the trace holds 1 step: pass 0 or -1"):
        fit_costs(t, 2, step=5)
    with pytest.raises(mpmd.MpmdError, match=r"step=-2 but the trace holds 1 step"):
        fit_costs(t, 2, step=-2)
    with pytest.raises(mpmd.MpmdError, match=r"num_stages must be a positive int"):
        fit_costs(t, 0)


def test_steps_dispatched_back_to_back_are_not_counted_twice(mesh2):
    """A probe: with steps traced back to back (the README's loop that never waits), each step's window spans the
    steps before it, and an actor's time running or queued behind their Runs was this step's 'waiting for data'
    (four steps summed 53-61 ms of waiting over 37 ms). It is 'other steps' now: per actor, the steps' compute,
    waiting and overhead never add up to more than the time the four took, and each step's parts still add up."""
    params, opt, batch, dist, _ = _two_stage_sgd(mesh2, seed=4, width=128, scale=12, m=8, rows=32)
    p, o, losses = dist(params, opt.init(params), batch)
    losses.block_until_ready()
    with mesh2.trace() as t:
        for _ in range(4):
            p, o, losses = dist(p, o, batch)
        losses.block_until_ready()
    assert len(t.steps) == 4
    first = min(x.start for s in t.steps for x in s.values())
    last = max(x.end for s in t.steps for x in s.values())
    for a in range(2):
        parts = [t.breakdown(i)[a] for i in range(4)]
        for b in parts:
            assert b.compute + b.waiting + b.overhead + b.idle + b.other == pytest.approx(b.wall, rel=1e-6)
        assert sum(b.compute + b.waiting + b.overhead for b in parts) <= (last - first) * (1 + 1e-6), parts
    assert any(b.other > 0 for i in range(1, 4) for b in t.breakdown(i).values())  # (the windows did overlap)
    assert "other steps" in t.summary(-1)


def test_a_step_whose_runs_interleave_an_earlier_steps_adds_up_to_its_window():
    """Steps that do not depend on each other (the same params passed to each) interleave on an actor: one of this
    step's Runs before the earlier step's last. That Run was counted as compute and again as 'other steps' (queued
    behind the earlier step), and a row added up to 108-121 % (a probe). Synthetic spans, in seconds."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace

    def step(i, runs):
        return {0: ActorStep(0, i, runs[0][0], runs[-1][1], [RunSpan(f"r{j}", s, s, s, e) for j, (s, e) in enumerate(runs)])}

    t = Trace()
    t.steps = [step(0, [(0.0, 1.0), (3.0, 4.0)]),  # the earlier step: its last Run after one of the next step's
               step(1, [(1.0, 2.0), (5.0, 6.0)])]
    b = t.breakdown(1)[0]
    assert b.wall == 5.0 and b.compute == 2.0
    assert b.other == pytest.approx(2.0)  # (1.0-2.0 is this step's own Run; 2.0-4.0 the earlier step's, and queued behind it)
    assert b.compute + b.waiting + b.overhead + b.idle + b.other == pytest.approx(b.wall)


def test_the_lead_and_bubble_of_a_step_queued_behind_earlier_ones_leave_out_their_time():
    """Steps dispatched back to back: a step's window opens while its actors still run the earlier ones. fit_costs
    took that queue for the step's lead (30 ms for the 8th of 8 steps of 7 ms: the prediction grew with the queue)
    and measured_bubbles for bubble (0.91), both agreeing with the measurement by reading it back (a probe).
    Synthetic spans, in seconds: two actors, each step F on actor 0 then F on actor 1."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs, measured_bubbles

    def step(i, t0, at):  # actor 0's Run at `at`, actor 1's 1 s later; the window opens at t0
        return {0: ActorStep(0, i, t0, at + 1.0, [RunSpan("0F0", at, at, at, at + 1.0)]),
                1: ActorStep(1, i, t0, at + 2.0, [RunSpan("1F0", at + 1.0, at + 1.0, at + 1.0, at + 2.0)])}

    t = Trace()
    t.steps = [step(0, 0.0, 0.5), step(1, 0.1, 2.5)]  # the second opened at 0.1, its actor 0 busy until 1.5, idle 1 s
    assert fit_costs(t, 2, step=0).lead == pytest.approx(0.5)
    assert fit_costs(t, 2, step=1).lead == pytest.approx(1.0)  # (from 1.5, when actor 0 was done with step 0; was 2.4)
    # the window 0.1-4.5; actor 0 on step 0 until 1.5, computing 1 s of the 3 left; actor 1 until 2.5, 1 s of 2 left
    assert measured_bubbles(t, 1) == pytest.approx({0: 2 / 3, 1: 0.5})  # (was 1 - 1 / 4.4 on both)
    # steps that do not depend on each other interleave: an earlier step's Run ending after this one's first is no wait
    t.steps = [step(0, 0.0, 0.5), step(1, 0.1, 2.5)]
    t.steps[0][0].runs.append(RunSpan("0B0", 4.0, 4.0, 4.0, 5.0))
    assert fit_costs(t, 2, step=1).lead == pytest.approx(1.0)  # (not 0: from 1.5 still)


def test_fit_costs_fits_non_negative_costs_that_best_explain_the_runs():
    """Least squares then clipping at 0: a trace whose fused B+F Run was shorter than its lone Fs (noise on a tiny
    model) fitted B = -0.2 ms, clipped to 0, and left F at the lone Runs' 1.0 ms, the fused Run predicted 0.2 ms too
    long (a probe saw B = 0 on both stages of a 16-wide model). A non-negative fit takes the best F with B = 0."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs

    t = Trace()
    x, clock = ActorStep(0, 0, 0.0, 0.0), 0.0
    for label, ms in (("0F0", 1.0), ("0F1", 1.0), ("0B0+0F2", 0.8)):
        x.runs.append(RunSpan(label, clock, clock, clock, clock + ms * 1e-3))
        clock += ms * 1e-3
    x.end = clock
    t.steps.append({0: x})
    c = fit_costs(t, 1, per_run=False)
    assert c.B[0] == 0 and c.F[0] == pytest.approx(2.8e-3 / 3)  # (the mean of the three: the best F once B is 0)


def _raises_on_the_host(v):
    if v > 0:
        raise RuntimeError("boom from callback")


def test_a_traced_step_whose_host_callback_fails_is_counted_not_recorded():
    """A step whose host callback (jax.debug.callback, run on the controller after the actors' part) raised was
    recorded among `t.steps` as a normal step, and fit_costs fitted it without a word (a probe): only the actors'
    own failures were counted. It is counted as failed, as they are, and a step after it is recorded."""
    def model(params, x):
        x = jnp.tanh(x @ params[0]["w"])
        jax.debug.callback(_raises_on_the_host, params[2])
        x = mpmd.pipeline_yield(x)
        return x @ params[1]["w"]

    def loss(params, mb):
        return jnp.mean((model(params, mb["x"]) - mb["y"]) ** 2)

    k = jax.random.split(jax.random.key(0), 3)
    batch = {"x": jax.random.normal(k[2], (4, 4, 16)), "y": jnp.zeros((4, 4, 4))}
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        @mpmd.distributed(mesh=mesh)
        def grad_step(params, batch):
            return mpmd.accumulate_grads(lambda mb: jax.value_and_grad(loss)(params, mb)[::-1], batch,
                                         schedule=mpmd.OneFOneB(num_stages=2))

        params = [{"w": jax.random.normal(k[0], (16, 32)) / 4}, {"w": jax.random.normal(k[1], (32, 4)) / 6}]
        with mesh.trace() as t:
            with pytest.raises(RuntimeError, match="boom from callback"):  # (the callback's own error, as it raised it)
                mpmd.fetch(grad_step([*params, np.float32(1)], batch))
            mpmd.fetch(grad_step([*params, np.float32(-1)], batch))
    assert len(t.steps) == 1 and t.untraced == {"failed": 1}


def test_a_traced_step_that_fails_is_said_in_the_summary():
    """A step that failed inside `mesh.trace()` (here its actors' loader gives data of another shape than declared)
    left "no traced step" and nothing else (a probe): the failed steps are counted and said."""
    from mpmd.testing import LOADED_LEAF_SHAPE

    fn = "mpmd.testing:synthetic_regression_leaf"
    m, rows, width = LOADED_LEAF_SHAPE
    params = models.mlp_params(np.random.default_rng(0), 2, width=width)
    opt = optax.sgd(0.1)
    batch = mpmd.loaded_by_actors(fn, {leaf: jax.ShapeDtypeStruct((m, rows + 1, width), np.float32) for leaf in ("x", "y")})
    with mpmd.RemoteMesh.local(2, loaders=[fn]) as mesh:
        dist = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        with mesh.trace() as t:
            out = dist(params, opt.init(params), batch)
        with pytest.raises(mpmd.MpmdError):
            mpmd.fetch(out)
    assert t.steps == [] and t.untraced == {"failed": 1}
    assert t.summary() == "no traced step (not traced: 1 step(s) failed or aborted (their errors surface through their outputs))"
