"""The simulator against closed forms (GPipe, 1F1B, interleaved, ZB-H1 bubbles; peak activations), against
torch.distributed.pipelining's orders where no closed form exists, and on compiled Programs: a Program
built from a table must time exactly like the table, and `check_programs` must catch each kind of broken
Program."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import mpmd
from mpmd.cli import main
from mpmd.schedules import Custom, Task, validate
from mpmd.schedules.simulator import Costs, simulate, simulate_programs
from transport.program import Delete, Label, Program, Recv, Run, Send

# ---------------------------------------------------------------- closed forms, unit costs F=1, B=2, I=W=1


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 8, 16])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    for s in (mpmd.GPipe(p), mpmd.OneFOneB(p), mpmd.EagerOneFOneB(p)):
        r = simulate(s, m)
        assert r.step_time == 3 * (m + p - 1)
        assert r.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert r.bubble_per_actor == pytest.approx([(p - 1) / (m + p - 1)] * p, abs=1e-12)


@pytest.mark.parametrize("p, v, m", [(p, v, m) for p, v in [(2, 2), (3, 2), (4, 2), (4, 3), (5, 4)] for m in (4, 5, 6, 8, 9, 16)
                                     if m >= p])  # the closed form needs at least one microbatch per actor
def test_interleaved_bubble_is_p_minus_1_over_v_m_plus_p_minus_1(p, v, m):
    r = simulate(mpmd.InterleavedOneFOneB(v * p, p), m)
    assert r.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("m", [5, 8, 16])
def test_zb_h1_idles_a_third_of_1f1b_when_f_i_w_cost_the_same(p, m):
    # ZB paper (Qi et al. 2024, sec. 3): with T_F = T_B(input) = T_W, 1F1B idles (p-1)(T_F + T_B + T_W) per actor,
    # ZB-H1 (p-1)(T_F + T_B - T_W): here 3(p-1) and p-1, so the bubble is (p-1)/(3m+p-1).
    zb, ofob = simulate(mpmd.ZeroBubbleH1(p), m), simulate(mpmd.OneFOneB(p), m)
    assert [b * zb.step_time for b in zb.bubble_per_actor] == pytest.approx([p - 1] * p)
    assert [b * ofob.step_time for b in ofob.bubble_per_actor] == pytest.approx([3 * (p - 1)] * p)
    assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert max(zb.peak_activations) == max(ofob.peak_activations) == p  # 1F1B's activation memory


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zero_bubble_schedules_idle_only_the_pipeline_fill(p):
    # With F = I = W every actor idles p-1 units, the fill the last actor waits before its first forward: the
    # property ZB-H1 has by construction (above) and the V and interleaved zero-bubble orders keep (mpmd.schedules).
    for s, ms in [(mpmd.InterleavedZeroBubble(2 * p, p), range(p, 3 * p)), (mpmd.InterleavedZeroBubble(3 * p, p), range(p, 3 * p)),
                  (mpmd.ZeroBubbleV(p), range(2 * p - 1, 4 * p)), (mpmd.DualPipeV(p), range(2 * p, 4 * p))]:
        for m in ms:
            r = simulate(s, m)
            assert [b * r.step_time for b in r.bubble_per_actor] == pytest.approx([p - 1] * p), (s, m)


@pytest.mark.parametrize("p, m", [(2, 2), (3, 6), (4, 8), (5, 15)])
def test_peak_activations_1f1b_p_minus_a_gpipe_m(p, m):
    assert simulate(mpmd.OneFOneB(p), m).peak_activations == tuple(min(p - a, m) for a in range(p))
    assert simulate(mpmd.GPipe(p), m).peak_activations == (m,) * p
    assert simulate(mpmd.EagerOneFOneB(p), m).peak_activations == tuple(min(2 * (p - a) - 1, m) for a in range(p))
    # Interleaved (m a multiple of p): each actor holds its warm-up forwards plus one, counted per stage-microbatch.
    v = 2
    assert simulate(mpmd.InterleavedOneFOneB(v * p, p), m).peak_activations == tuple(
        min((v - 1) * p + 2 * (p - 1 - a) + 1, v * m) for a in range(p))
    assert max(simulate(mpmd.ZeroBubbleV(p), m).peak_activations) <= 2 * p  # ZB-V: 1F1B's p, in half-size stages


@pytest.mark.parametrize("latency", [0.25, 0.5, 1.0])
def test_eager_1f1b_hides_transfer_latency_that_stalls_1f1b(latency):
    # With a transfer latency L <= one forward, Eager 1F1B pays L only along the fill and the drain,
    # 2(p-1) transfers: step = 3(m+p-1) + 2(p-1)L. 1F1B pays it again in every steady-state round trip.
    p, m = 4, 8
    costs = Costs(latency=latency)
    eager, ofob = simulate(mpmd.EagerOneFOneB(p), m, costs), simulate(mpmd.OneFOneB(p), m, costs)
    assert eager.step_time == pytest.approx(3 * (m + p - 1) + 2 * (p - 1) * latency)
    assert ofob.step_time > eager.step_time


# ---------------------------------------------------------------- against torch.distributed.pipelining

# Step times of torch's orders under unit costs. Computed offline (torch is not a dependency) with torch
# 2.13.0+cpu in a separate venv: each class was built through its __init__ with stand-in stage objects
# (group_size = ranks, the rank's stage indices, no process group), its compute-only `pipeline_order`
# (for ScheduleGPipe / Schedule1F1B: `_get_pipeline_order()`) taken per rank with None slots and
# REDUCE_GRAD dropped and OVERLAP_F_B expanded into its sub-actions in order, and the resulting table
# simulated with mpmd.simulate as a Custom schedule (unit costs, free transfers). Classes and arguments:
#   ScheduleGPipe(stage, m), Schedule1F1B(stage, m)              one stage per rank
#   ScheduleInterleaved1F1B(stages, m)                          2 stages per rank, stage s on rank s % p
#   ScheduleInterleavedZeroBubble(stages, m)                    1 stage per rank ("ZB1P" = ZB-H1), and 2 per rank
#   ScheduleZBVZeroBubble(stages, m), ScheduleDualPipeV(stages, m)  2 stages per rank, V placement
# Two adjustments: Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1 (F1..Fm; its runtime
# uses F0..Fm-1), so microbatch numbers were reassigned in order of appearance; ScheduleDualPipeV's
# FULL_BACKWARD actions were written as I then W back to back, the way our DualPipeV writes a backward whose W
# is not postponed (a stage must use I/W throughout). ScheduleDualPipeV refuses 4 ranks with 4 microbatches.
TORCH_STEP = {
    # (our schedule, p, m): torch step time
    ("GPipe", 2, 4): 15, ("GPipe", 2, 8): 27, ("GPipe", 2, 16): 51, ("GPipe", 4, 4): 21, ("GPipe", 4, 8): 33, ("GPipe", 4, 16): 57,
    ("OneFOneB", 2, 4): 15, ("OneFOneB", 2, 8): 27, ("OneFOneB", 2, 16): 51,
    ("OneFOneB", 4, 4): 21, ("OneFOneB", 4, 8): 33, ("OneFOneB", 4, 16): 57,
    ("InterleavedOneFOneB", 2, 4): 27, ("InterleavedOneFOneB", 2, 8): 51, ("InterleavedOneFOneB", 2, 16): 99,
    ("InterleavedOneFOneB", 4, 4): 33, ("InterleavedOneFOneB", 4, 8): 57, ("InterleavedOneFOneB", 4, 16): 105,
    ("ZeroBubbleH1", 2, 4): 13, ("ZeroBubbleH1", 2, 8): 25, ("ZeroBubbleH1", 2, 16): 49,
    ("ZeroBubbleH1", 4, 4): 15, ("ZeroBubbleH1", 4, 8): 27, ("ZeroBubbleH1", 4, 16): 51,
    ("InterleavedZeroBubble", 2, 4): 25, ("InterleavedZeroBubble", 2, 8): 49, ("InterleavedZeroBubble", 2, 16): 97,
    ("InterleavedZeroBubble", 4, 4): 27, ("InterleavedZeroBubble", 4, 8): 51, ("InterleavedZeroBubble", 4, 16): 99,
    ("ZeroBubbleV", 2, 4): 25, ("ZeroBubbleV", 2, 8): 49, ("ZeroBubbleV", 2, 16): 97,
    ("ZeroBubbleV", 4, 4): 30, ("ZeroBubbleV", 4, 8): 51, ("ZeroBubbleV", 4, 16): 99,
    ("DualPipeV", 2, 4): 25, ("DualPipeV", 2, 8): 49, ("DualPipeV", 2, 16): 97, ("DualPipeV", 4, 8): 51, ("DualPipeV", 4, 16): 99,
}


def ours(name: str, p: int) -> mpmd.Schedule:
    cls = getattr(mpmd, name)
    if name.startswith("Interleaved"):
        return cls(num_stages=2 * p, num_actors=p)
    if name in ("ZeroBubbleV", "DualPipeV"):
        return cls(num_actors=p)
    return cls(num_stages=p)


@pytest.mark.parametrize("name, p, m", sorted(TORCH_STEP))
def test_every_builtin_is_no_worse_than_torchs_order(name, p, m):
    s = ours(name, p)
    r = simulate(s, m)
    work = 3 * (s.num_stages // p) * m  # every built-in gives each actor the same work
    torch_bubble = 1 - work / TORCH_STEP[(name, p, m)]
    assert r.step_time <= TORCH_STEP[(name, p, m)]
    assert r.bubble <= torch_bubble + 1e-12
    if name == "OneFOneB":  # torch has no Eager 1F1B; with free transfers it must match 1F1B
        assert simulate(mpmd.EagerOneFOneB(p), m).step_time <= TORCH_STEP[(name, p, m)]


# ---------------------------------------------------------------- cost model


def test_a_single_microbatch_is_the_chain_of_per_stage_costs_and_transfers():
    f, b = (1.0, 2.0, 0.5), (2.0, 3.0, 1.0)
    costs = Costs(F=f, B=b, latency=0.1, bandwidth=1000.0, activation_bytes=(100.0, 300.0, 0.0))
    r = simulate(mpmd.GPipe(3), 1, costs)
    hops = 2 * (0.1 + 100 / 1000) + 2 * (0.1 + 300 / 1000)  # boundary 0-1 and 1-2, both directions
    assert r.step_time == pytest.approx(sum(f) + sum(b) + hops)


def test_a_fitted_route_per_actor_pair_times_the_hops_of_a_schedule_too():
    """`Costs.routes` (what `fit_costs` measures per pair of actors) times a schedule's hops as it times compiled
    Programs' (it was read only by simulate_programs: a route of 10 s changed nothing here; a probe)."""
    one_way = Costs(routes=(((0, 1), (10.0, math.inf)),))  # 0 -> 1 slow; 1 -> 0 falls back to latency 0
    both = Costs(routes=(((0, 1), (10.0, math.inf)), ((1, 0), (10.0, math.inf))))
    plain = simulate(mpmd.GPipe(2), 1).step_time  # F, F, B, B with unit costs F=1, B=2: 6
    assert simulate(mpmd.GPipe(2), 1, one_way).step_time == pytest.approx(plain + 10)
    assert simulate(mpmd.GPipe(2), 1, both).step_time == pytest.approx(plain + 20)
    assert simulate(mpmd.GPipe(2), 1, both).step_time == pytest.approx(simulate(mpmd.GPipe(2), 1, Costs(latency=10.0)).step_time)


@pytest.mark.parametrize("routes, says", [
    ("garbage", "must be a sequence"), (((0, 1),), "each entry must be"), ((((0, 1), (1.0, 0)),), "bandwidth > 0"),
    ((((0, 1), (math.nan, 1.0)),), "finite latency"), ((((0, 1), (-1.0, 1.0)),), "finite latency"),
    ((((0, 0), (1.0, 1.0)),), "two different actors"), ((((0, 1.5), (1.0, 1.0)),), "two different actors"),
])
def test_bad_routes_are_refused_naming_the_entry(routes, says):
    """Every other Costs field was checked; routes took anything and failed later, or never (a probe)."""
    with pytest.raises(ValueError, match=says):
        Costs(routes=routes)
    assert Costs(routes=[((0, 1), (2.0, math.inf))]).routes == (((0, 1), (2.0, math.inf)),)


@pytest.mark.parametrize("how", ["simulate", "simulate_programs", "simulate_monte_carlo", "Costs.check_actors"])
@pytest.mark.parametrize("route", [(1, 2), (3, 0)])
def test_a_route_naming_an_actor_the_schedule_lacks_is_refused_naming_it_and_the_actor_count(how, route):
    """Routes fitted on a trace of 4 actors, given to a 2-actor schedule: the routes past actor 1 were ignored and
    the step timed on other costs than those given (a 1 s route 1->2 changed nothing; a probe). Refused where
    the number of actors is known, naming the route and the count; routes between the schedule's actors still time."""
    from mpmd.schedules.montecarlo import simulate_monte_carlo

    schedule = mpmd.OneFOneB(2)
    costs = Costs(routes=(((0, 1), (1.0, math.inf)), (route, (1.0, math.inf))))
    says = rf"route {route[0]}->{route[1]}, but there are 2 actors \(0 to 1\)"
    run = {"simulate": lambda c: simulate(schedule, 4, c),
           "simulate_programs": lambda c: simulate_programs(programs_from_table(schedule, validate(schedule, 4)), c),
           "simulate_monte_carlo": lambda c: simulate_monte_carlo(programs_from_table(schedule, validate(schedule, 4)), c, runs=2),
           "Costs.check_actors": lambda c: c.check_actors(2)}[how]
    with pytest.raises(ValueError if how == "Costs.check_actors" else mpmd.ScheduleError, match=says):
        run(costs)
    kept = Costs(routes=(((0, 1), (1.0, math.inf)),))
    if how != "Costs.check_actors":  # (the route between the schedule's two actors: 4 forward hops of 1 s each way)
        assert run(kept).step_time > run(Costs()).step_time + 1
    costs.check_actors(4)


def test_overhead_is_added_to_every_task_and_one_actor_has_no_bubble():
    r = simulate(mpmd.OneFOneB(1), 5, Costs(F=1, B=2, overhead=0.5))
    assert r.step_time == pytest.approx(5 * (1 + 2 + 2 * 0.5)) and r.bubble == 0


def test_a_gap_before_every_run_is_idle_time_not_compute():
    # one actor, 5 microbatches of F=1, B=2: 10 Runs, each 0.5 idle first -> step 15 + 5, bubble 5 / 20
    r = simulate(mpmd.OneFOneB(1), 5, Costs(F=1, B=2, gap=0.5))
    assert r.step_time == pytest.approx(20.0) and r.bubble == pytest.approx(0.25)
    prog = Program(0, [0], [2], [Run(0, (0,), (1,), Label.of(Task(0, "F", 0))), Run(1, (1,), (2,), Label.of(Task(0, "B", 0)))])
    r = simulate_programs([prog], Costs(F=1.0, B=2.0, gap=0.25))
    assert same_spans(r.timeline, [[(0.25, 1.25, "0F0"), (1.5, 3.5, "0B0")]]) and r.step_time == pytest.approx(3.5)
    with pytest.raises(ValueError, match="gap"):
        Costs(gap=-1)


def test_costs_from_measured_timings():
    c = Costs.from_timings({"F": 0.01, "1F": 0.02, "B": 0.03, "0B3": 0.05, "0B4": 0.07, ("W", 1): 0.4}, num_stages=2, latency=1e-3)
    assert c.F == (0.01, 0.02) and c.B == pytest.approx((0.06, 0.03)) and c.W == (1.0, 0.4) and c.I == 1.0 and c.latency == 1e-3
    assert Costs.from_timings({"F": 2.0, "B": 4.0}) == Costs(F=2.0, B=4.0)
    with pytest.raises(ValueError, match="need num_stages"):
        Costs.from_timings({"1F": 0.02})
    with pytest.raises(ValueError, match="'F3x' is not a kind"):
        Costs.from_timings({"F3x": 1.0})


def test_bad_costs_name_the_field():
    with pytest.raises(ValueError, match="Costs.F must be a finite non-negative number"):
        Costs(F=-1)
    with pytest.raises(ValueError, match="Costs.bandwidth must be > 0"):
        Costs(bandwidth=0)
    with pytest.raises(mpmd.ScheduleError, match="Costs.B has 2 per-stage values for 4 stages"):
        simulate(mpmd.GPipe(4), 2, Costs(B=(1, 2)))


def test_simulate_refuses_a_schedule_that_cannot_run():
    with pytest.raises(mpmd.ScheduleError, match="deadlocks"):
        simulate(Custom(num_stages=2, order=(("0F0", "0B0", "0F1", "0B1"), ("1F0", "1F1", "1B0", "1B1"))), 2)


def test_perfetto_trace_has_one_track_per_actor_and_one_event_per_task(tmp_path):
    r = simulate(mpmd.ZeroBubbleV(2), 4)
    path = tmp_path / "t.json"
    r.to_perfetto(str(path))
    trace = json.load(open(path))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 2 * 2 * 4 * 3 - 4  # 4 stages, 4 microbatches, F I W each, but stage 0 has no I (no Run)
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) for e in spans)
    assert {e["tid"] for e in spans} == {0, 1}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"actor 0", "actor 1"}
    first = next(e for e in spans if e["name"] == "3I0")
    assert first["tid"] == 0 and first["cat"] == "I" and first["dur"] == pytest.approx(1e6)


@pytest.mark.parametrize("schedule", [mpmd.OneFOneB(3), mpmd.ZeroBubbleV(2)])
def test_perfetto_flow_arrows_start_in_the_sending_task_and_end_in_the_reading_one(tmp_path, schedule):
    """A flow event binds to the slice enclosing its time on its track: placed at the send's end and at the arrival,
    0 of 16 arrows of a 1F1B trace started on the task that sent (a probe)."""
    r = simulate(schedule, 4, costs=mpmd.Costs(F=1, B=2, I=1, W=1, latency=0.2) if schedule.split_backward else
                 mpmd.Costs(F=1, B=2, latency=0.2))
    path = tmp_path / "t.json"
    r.to_perfetto(str(path))
    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]

    def enclosing(tid, ts):
        inside = [e["name"] for e in spans if e["tid"] == tid and e["ts"] < ts < e["ts"] + e["dur"]]
        assert len(inside) == 1, (tid, ts, inside)
        return inside[0]

    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert flows and len(flows) == 2 * len(r.transfers)
    for e in flows:
        sent, _, read = e["name"].removeprefix("xfer ").partition("->")
        if read.startswith("0I"):  # (stage 0 has no I task: its W runs the whole backward)
            read = read.replace("I", "W")
        assert enclosing(e["tid"], e["ts"]) == (sent if e["ph"] == "s" else read), e


def test_svg_picture_has_a_box_per_task_coloured_by_kind(tmp_path):
    from mpmd.schedules.draw import COLOURS

    r = simulate(mpmd.ZeroBubbleH1(2), 3)
    path = tmp_path / "t.svg"
    r.draw(str(path))
    root = ET.parse(path).getroot()
    boxes = [e for e in root.iter("{http://www.w3.org/2000/svg}rect") if e.find("{http://www.w3.org/2000/svg}title") is not None]
    assert len(boxes) == 2 * 3 * 3 - 3  # stage 0 has no I task
    by_label = {e.find("{http://www.w3.org/2000/svg}title").text.split()[0]: e.get("fill") for e in boxes}
    assert by_label["0F0"] == COLOURS["F"] and by_label["1I2"] == COLOURS["I"] and by_label["0W1"] == COLOURS["W"]
    assert "0F0" in {e.text for e in root.iter("{http://www.w3.org/2000/svg}text")}


def test_stacked_pictures_share_one_time_axis(tmp_path):
    """draw_stacked scaled each panel to its own step: a step of 15 and one of 30 were drawn the same width, a tick
    of 10 at x=743 in one and x=407 in the other (a probe). The axis is the longest step's, in every panel."""
    from mpmd.schedules.draw import draw_stacked

    short = simulate(mpmd.OneFOneB(2), 2, costs=mpmd.Costs(F=1, B=2))
    long = simulate(mpmd.OneFOneB(2), 2, costs=mpmd.Costs(F=2, B=4))
    assert long.step_time == pytest.approx(2 * short.step_time)
    path = tmp_path / "stacked.svg"
    draw_stacked([short, long], ["short", "long"], str(path))
    ns = "{http://www.w3.org/2000/svg}"
    panels = [p for p in ET.parse(path).getroot() if p.tag == ns + "svg"]
    assert len(panels) == 2
    ticks = [{t.text: float(t.get("x")) for t in p.iter(ns + "text") if t.text and re.fullmatch(r"[0-9.e+-]+", t.text)}
             for p in panels]
    shared = set(ticks[0]) & set(ticks[1]) - {"0"}
    assert shared and all(ticks[0][t] == pytest.approx(ticks[1][t]) for t in shared), ticks

    def right_edge(panel):
        boxes = [b for b in panel.iter(ns + "rect") if b.find(ns + "title") is not None]
        return max(float(b.get("x")) + float(b.get("width")) for b in boxes)

    left = 70  # (the panels' left margin)
    assert right_edge(panels[0]) - left == pytest.approx((right_edge(panels[1]) - left) / 2, rel=0.01)


def test_png_picture(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    simulate(mpmd.OneFOneB(2), 2).draw(str(path))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="as .png or .svg"):  # (a .jpg was written as SVG, silently)
        simulate(mpmd.OneFOneB(2), 2).draw(str(tmp_path / "t.jpg"))
    assert not (tmp_path / "t.jpg").exists()


# ---------------------------------------------------------------- compiled Programs


def same_spans(got, want) -> bool:
    """Timelines equal up to float rounding: same labels in the same order, same start and end times."""
    return [[label for _, _, label in row] for row in got] == [[label for _, _, label in row] for row in want] and all(
        math.isclose(a, b, abs_tol=1e-9) for g, w in zip(got, want) for gs, ws in zip(g, w) for a, b in zip(gs[:2], ws[:2]))


def programs_from_table(schedule: mpmd.Schedule, table: list[list[Task]], shape=(4, 8), dtype="float32") -> list[Program]:
    """A minimal compiler: one Run per task reading its inputs (the dependency rules of the brief), a Recv for
    each input made on another actor (all posted first, as mpmd's compiler does) and a Send after the Run.
    As mpmd's compiler, it gives stage 0 no I task (it exports no input gradient): its W reads what the I read."""
    split = {t.stage for row in table for t in row if t.kind in "IW"}
    n = schedule.num_stages
    table = [[t for t in row if not (t.stage == 0 and t.kind == "I")] for row in table]

    def inputs(t: Task) -> list[Task]:
        if t.kind == "F":
            return [Task(t.stage - 1, "F", t.mb)] if t.stage else []
        if t.kind == "W" and t.stage:
            return [Task(t.stage, "I", t.mb)]
        nxt = [Task(t.stage + 1, "I" if t.stage + 1 in split else "B", t.mb)] if t.stage < n - 1 else []
        return [Task(t.stage, "F", t.mb), *nxt]

    tasks = [t for row in table for t in row]
    tag = {(d, t): k for k, (d, t) in enumerate((d, t) for t in tasks for d in inputs(t))}
    progs = []
    for a, row in enumerate(table):
        buf: dict[Task, int] = {}
        recvs, body = [], []
        for t in row:
            for d in inputs(t):
                if schedule.actor_of(d.stage) != a and d not in buf:
                    buf[d] = len(buf)
                    recvs.append(Recv(buf[d], schedule.actor_of(d.stage), tag[(d, t)], dtype, shape, Label.of(d)))
            buf[t] = len(buf)
            body.append(Run(0, tuple(buf[d] for d in inputs(t)), (buf[t],), Label.of(t)))
            for u in tasks:
                if t in inputs(u) and schedule.actor_of(u.stage) != a:
                    body.append(Send(buf[t], schedule.actor_of(u.stage), tag[(t, u)], Label.of(t)))
        progs.append(Program(a, [], [], recvs + body))
    return progs


@pytest.mark.parametrize("schedule, m", [(mpmd.OneFOneB(3), 5), (mpmd.InterleavedOneFOneB(4, 2), 4), (mpmd.ZeroBubbleV(2), 4),
                                         (mpmd.DualPipeV(2), 5)])
def test_programs_of_a_table_time_exactly_like_the_table(schedule, m):
    nbytes = 4 * 8 * 4
    costs = Costs(F=1.0, B=2.5, I=1.5, W=0.5, latency=0.3, bandwidth=nbytes / 0.2, activation_bytes=nbytes, overhead=0.05)
    table = validate(schedule, m)
    progs = programs_from_table(schedule, table)
    mpmd.check_programs(progs)
    got, want = simulate_programs(progs, costs), simulate(schedule, m, costs)
    assert got.step_time == pytest.approx(want.step_time)
    assert same_spans(got.timeline, want.timeline)
    assert got.peak_activations == want.peak_activations and got.bubble == pytest.approx(want.bubble)


class _NoActors:
    """A mesh stand-in for tracing and planning only (no actor is contacted)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("schedule", [mpmd.OneFOneB(2), mpmd.EagerOneFOneB(3), mpmd.InterleavedOneFOneB(4, 2),
                                      mpmd.ZeroBubbleH1(2), mpmd.DualPipeV(2)])
def test_programs_the_compiler_makes_pass_check_programs_and_time_like_their_schedule(schedule):
    """Split backwards included: the compiler gives stage 0 no I task, and both simulators charge its whole
    backward (I + W) to its W."""
    import optax

    from mpmd.compiler.plan import plan_step
    from mpmd.step import DistributedFunction
    from tests import models
    from tests.test_pipeline import make_step

    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, schedule.num_stages, 8)
    args = (params, optax.sgd(0.1).init(params), models.regression_batch(rng, 4, 2, 8))
    step = DistributedFunction(make_step(models.mse_loss(models.mlp), optax.sgd(0.1), schedule), _NoActors(schedule.num_actors))
    programs = plan_step(step.trace(*args)[0], schedule.num_actors).programs
    mpmd.check_programs(programs)
    costs = Costs(latency=0.1)  # the step's other phases (slicing, optimizer) cost 0 by default
    got, want = simulate_programs(programs, costs), simulate(schedule, 4, costs)
    assert not any(t.stage == 0 and t.kind == "I" for p in programs for r in p.instructions if isinstance(r, Run) for t in r.label.tasks)
    tasks_only = [[span for span in row if span[2] not in ("pre", "post", "slice", "stack")] for row in got.timeline]
    assert got.step_time == pytest.approx(want.step_time)
    assert same_spans(tasks_only, want.timeline)


def test_program_costs_fused_runs_phases_and_peak_bytes():
    # actor 0: x(b0, 100 B) -> pre -> b1 (40 B) -> RUN 0F0+0B0 -> b2 (10 B), donating b1; DEL b0; post -> b3 (5 B)
    prog = Program(0, [0], [3], [
        Run(0, (0,), (1,), Label("pre")),
        Run(1, (1,), (2,), Label.of(Task(0, "F", 0), Task(0, "B", 0)), donate=(0,)),
        Delete((0,)),
        Run(2, (2,), (3,), Label("post")),
        Delete((2,)),
    ], buffer_bytes={0: 100, 1: 40, 2: 10, 3: 5})
    r = simulate_programs([prog], Costs(F=1.0, B=2.0, other=0.25, overhead=0.1))
    assert same_spans(r.timeline, [[(0, 0.35, "pre"), (0.35, 1.45, "0F0"), (1.45, 3.45, "0B0"), (3.45, 3.8, "post")]])  # a fused Run: one span per task
    assert r.step_time == pytest.approx(0.35 + 3.1 + 0.35)
    # Live bytes: 100; +40 = 140 during pre; the fused Run frees donated b1 and makes b2: 110; DEL b0: 10; +5: 15.
    assert r.peak_bytes == (140,)
    assert r.peak_activations == (1,)


def test_transfer_time_comes_from_the_recv_dtype_and_shape():
    # a0 runs 0F0 and sends b0 (bfloat16[1000, 500] = 1e6 B); a1 receives it, then runs 1F0.
    progs = [Program(0, [], [], [Run(0, (), (0,), Label.of(Task(0, "F", 0))), Send(0, 1, 7)]),
             Program(1, [], [], [Recv(0, 0, 7, "bfloat16", (1000, 500)), Run(0, (0,), (1,), Label.of(Task(1, "F", 0)))])]
    r = simulate_programs(progs, Costs(F=1.0, latency=0.5, bandwidth=1e6))
    assert r.timeline[1] == ((2.5, 3.5, "1F0"),)
    assert r.transfers == ((0, 1, 1.0, 2.5, "xfer"),)


def listing_marks(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.lstrip().startswith(">")]


def test_check_programs_finds_a_deadlock_and_says_who_waits_for_what():
    # Each actor's Run needs the other's buffer, which the other sends only after its own Run.
    progs = [Program(0, [], [], [Recv(1, 1, 0, "float32", (2,)), Run(0, (1,), (2,), Label.of(Task(0, "B", 0))), Send(2, 1, 1)]),
             Program(1, [], [], [Recv(1, 0, 1, "float32", (2,)), Run(0, (1,), (2,), Label.of(Task(1, "F", 0))), Send(2, 0, 0)])]
    with pytest.raises(mpmd.PipelineError, match="deadlock") as err:
        mpmd.check_programs(progs)
    text = str(err.value)
    marks = listing_marks(text)
    assert len(marks) == 2 and all("RUN" in line for line in marks)
    assert "waits for b1 from actor 1 (#0); actor 1 never reaches its SEND #0 (instruction 2): it is stuck at instruction 1" in text
    assert "actor 0: inputs" in text and "actor 1: inputs" in text


def test_check_programs_catches_a_deadlocking_schedule_compiled_as_is():
    bad = Custom(num_stages=2, order=(("0F0", "0B0", "0F1", "0B1"), ("1F0", "1F1", "1B0", "1B1")))
    progs = programs_from_table(bad, bad.tasks(2))
    with pytest.raises(mpmd.PipelineError, match="deadlock") as err:
        mpmd.check_programs(progs)
    assert [m.split()[2] for m in listing_marks(str(err.value))] == ["RUN", "RUN"]
    assert "RUN 0B0" in listing_marks(str(err.value))[0] and "RUN 1F1" in listing_marks(str(err.value))[1]


def test_check_programs_recv_without_send_and_send_without_recv():
    no_send = [Program(0, [], [], []), Program(1, [], [], [Recv(0, 0, 3, "float32", (1,))])]
    with pytest.raises(mpmd.PipelineError, match="receives tag #3 from actor 0, but actor 0 has no matching SEND") as err:
        mpmd.check_programs(no_send)
    assert listing_marks(str(err.value))[0].split()[2] == "RECV"
    no_recv = [Program(0, [0], [], [Send(0, 1, 3)]), Program(1, [], [], [])]
    with pytest.raises(mpmd.PipelineError, match="sends tag #3 to actor 1, but actor 1 has no matching RECV"):
        mpmd.check_programs(no_recv)


def test_check_programs_run_reading_a_buffer_nothing_produces():
    with pytest.raises(mpmd.PipelineError, match="reads buffer b5, but nothing produces it") as err:
        mpmd.check_programs([Program(0, [0], [], [Run(0, (0, 5), (1,))])])
    assert "RUN" in listing_marks(str(err.value))[0]
    with pytest.raises(mpmd.PipelineError, match="reads buffer b1, but it is only made later, at instruction 1"):
        mpmd.check_programs([Program(0, [0], [], [Run(0, (1,), (2,)), Run(0, (0,), (1,))])])
    with pytest.raises(mpmd.PipelineError, match=r"reads buffer b0, but it was deleted \(or donated to a Run\) at instruction 0"):
        mpmd.check_programs([Program(0, [0], [], [Delete((0,)), Run(0, (0,), (1,))])])


def test_check_programs_a_buffer_read_after_a_run_donated_it_and_what_is_not_a_list_of_programs():
    """The actor deletes a Run's donated inputs; check_programs let a later read of one pass (a probe), and a list
    of ints or None failed with an AttributeError or TypeError."""
    a0 = Program(0, [0], [2], [Run(0, (0,), (1,), Label.parse("0F0"), donate=(0,)), Run(0, (0,), (2,), Label.parse("0F1"))])
    with pytest.raises(mpmd.PipelineError, match=r"actor 0 instruction 1 .* reads buffer b0, but it was deleted \(or donated to a "
                                            r"Run\) at instruction 0"):
        mpmd.check_programs([a0])
    kept = Program(0, [0], [1], [Run(0, (0,), (1,), Label.parse("0F0"), donate=(0,)), Send(1, 1, 7)])  # the output is read: fine
    mpmd.check_programs([kept, Program(1, [], [5], [Recv(5, 0, 7, "float32", (4,))])])
    for bad in ([1, 2], None, "programs"):
        with pytest.raises(mpmd.PipelineError, match="check_programs takes a list of Programs"):
            mpmd.check_programs(bad)


def test_check_programs_accepts_inputs_and_consts_and_a_send_of_a_received_buffer():
    # a0 sends its input to a1, which forwards it to a2; a2 reads it with a constant.
    progs = [Program(0, [0], [], [Send(0, 1, 0)]),
             Program(1, [], [], [Recv(4, 0, 0, "float32", (3,)), Send(4, 2, 1)]),
             Program(2, [], [9], [Recv(2, 1, 1, "float32", (3,)), Run(0, (2, 7), (9,))], consts={7: None})]
    mpmd.check_programs(progs)
    r = simulate_programs(progs, Costs(latency=1.0))
    assert r.timeline[2] == ((2.0, 2.0, "task"),)
    assert math.isclose(r.step_time, 2.0)


# ---------------------------------------------------------------- the mpmd command


def test_cli_prints_the_table_bubbles_and_peaks_and_writes_pictures(tmp_path, capsys):
    svg, trace = tmp_path / "o.svg", tmp_path / "o.json"
    code = main(["simulate", "--schedule", "InterleavedOneFOneB", "--actors", "4", "--stages", "8", "--microbatches", "16",
                 "--svg", str(svg), "--trace", str(trace), "--costs", "F=1,B=2,I=1,W=1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "actor 0: 0F0 0F1 0F2 0F3 4F0" in out
    assert f"bubble {3 / 35:.4f}" in out and "bubble per actor:" in out and "peak activations:   a0 11  a1 9  a2 7  a3 5" in out
    assert svg.read_text().startswith("<svg") and json.loads(trace.read_text())["traceEvents"]


def test_cli_exits_2_with_the_validation_error(capsys):
    assert main(["simulate", "--schedule", "DualPipeV", "--actors", "4", "--microbatches", "6"]) == 2
    assert "needs at least 8 microbatches, got 6" in capsys.readouterr().err
    assert main(["simulate", "--schedule", "GPipe", "--actors", "4", "--stages", "3", "--microbatches", "6"]) == 2
    assert "--actors and --stages must agree" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--schedule", "GPipe", "--actors", "2", "--microbatches", "2", "--costs", "Q=1"])
    assert e.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # (a cost given twice kept the last silently: a probe)
        main(["simulate", "--schedule", "GPipe", "--actors", "2", "--microbatches", "2", "--costs", "F=1,B=2,F=2"])
    assert e.value.code == 2 and "F is given twice" in capsys.readouterr().err


def test_cli_simulate_refuses_a_picture_named_for_the_other_format(tmp_path, capsys):
    """`--svg out.png` wrote SVG into out.png, and `--png out.svg` PNG into out.svg (a probe). Refused, exit 2,
    nothing written; other names take the flag's format."""
    for flag, name in (("--svg", "out.png"), ("--png", "out.svg")):
        assert main(["simulate", "--schedule", "GPipe", "--actors", "2", "--microbatches", "2", flag, str(tmp_path / name)]) == 2
        assert f"{flag} {tmp_path / name}: that name ends in .{name[-3:]}" in capsys.readouterr().err
        assert not (tmp_path / name).exists()
    assert main(["simulate", "--schedule", "GPipe", "--actors", "2", "--microbatches", "2", "--svg", str(tmp_path / "t.pic")]) == 0
    assert (tmp_path / "t.pic").read_text().startswith("<svg")


def test_cli_simulate_names_the_flag_it_refuses_and_runs_as_python_m_mpmd(tmp_path, capsys):
    """`--actors -2` was refused as the schedule's "num_stages must be a positive int", `--svg ''` wrote nothing and
    said nothing (exit 0), and `python -m mpmd` had no __main__ (a probe)."""
    import os
    import subprocess
    import sys

    for flags, said in ((["--actors", "-2"], "argument --actors: must be a number above 0, got -2"),
                        (["--actors", "2", "--stages", "0"], "argument --stages: must be a number above 0, got 0"),
                        (["--actors", "2", "--microbatches", "0"], "argument --microbatches: must be a number above 0, got 0")):
        with pytest.raises(SystemExit) as e:
            main(["simulate", "--schedule", "OneFOneB", "--microbatches", "4", *flags])
        assert e.value.code == 2 and said in capsys.readouterr().err
    for flag in ("--svg", "--png", "--trace"):
        assert main(["simulate", "--schedule", "GPipe", "--actors", "2", "--microbatches", "2", flag, ""]) == 2
        assert f"{flag} needs a file name, got ''" in capsys.readouterr().err
        assert main(["simulate", "--schedule", "GPipe", "--actors", "2", "--microbatches", "2", flag, "-"]) == 2
        assert f"{flag} -: give a file name" in capsys.readouterr().err and not os.path.exists("-")
    assert main(["simulate", "--schedule", "GPipe", "--actors", "2", "--microbatches", "2", "--trace", str(tmp_path / "t.svg")]) == 0
    assert (tmp_path / "t.svg").read_text().lstrip().startswith(("{", "["))  # (a trace may be named anything)
    out = subprocess.run([sys.executable, "-m", "mpmd", "simulate", "--schedule", "GPipe", "--actors", "2", "--microbatches", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "bubble per actor" in out.stdout, out.stderr[-500:]


def test_cli_tune_refuses_counts_that_cannot_work_before_starting_anything(capsys):
    for flags, said in ((["--actors", "0"], "--actors: must be a number above 0"), (["--layers", "0"], "--layers: must be a number above 0"),
                        (["--memory-limit-mib", "-5"], "--memory-limit-mib: must be a number above 0"),
                        (["--verify", "-1"], "--verify: must be 0 (none) or more"), (["--verify", "x"], "is not a whole number")):
        with pytest.raises(SystemExit) as e:
            main(["tune", *flags])
        assert e.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["tune", "--width", "130"])
    assert e.value.code == 2 and "must be a multiple of --heads 4" in capsys.readouterr().err
    # a model past the machine's memory is refused in one line before anything is built (a JAX RESOURCE_EXHAUSTED
    # traceback, or the machine taken; a probe)
    with pytest.raises(SystemExit) as e:
        main(["tune", "--layers", "2", "--width", "200000", "--heads", "1"])
    assert re.fullmatch(r"mpmd tune: a GPT of --layers 2 and --width 200000 has about [\d,]+M parameters: .* GiB, more than this "
                        r"machine's [\d.,]+ GiB available; pass a smaller --width or --layers", str(e.value.code))


def test_mpmd_simulate_is_the_simulate_function():
    assert mpmd.simulate is simulate and mpmd.simulate(mpmd.GPipe(2), 2).step_time == 9


# ---- fitted costs as distributions, and the Monte Carlo simulator (mpmd.schedules.montecarlo) ----------------
def synthetic_trace(task_ms, gaps_ms, routes, m=4):
    """A traced 2-actor 1F1B-like step with known costs: `task_ms[(stage, kind)]` per Run (ms), the gaps before
    successive Runs cycling through `gaps_ms`, hops of route (src, dst) taking latency + bytes / bandwidth."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, TransferSpan

    trace = Trace()
    steps = {a: ActorStep(a, 0, 0.0, 0.0) for a in range(2)}
    clock = [0.0, 0.0]
    gap_iter = iter(gaps_ms * 100)
    made = {}
    order = {0: [(0, "F", i) for i in range(m)] + [(0, "B", i) for i in range(m)],
             1: [(1, k, i) for i in range(m) for k in ("F", "B")]}
    arrivals = {}
    for a in (0, 1):  # actor 0 first: actor 1's forward Runs wait for its activations
        for stage, kind, i in order[a]:
            label = f"{stage}{kind}{i}"
            ready = arrivals.get((a, label), clock[a])
            could = max(clock[a], ready)
            start = could + next(gap_iter) * 1e-3
            end = start + task_ms[(stage, kind)] * 1e-3
            steps[a].runs.append(RunSpan(label, clock[a], ready, start, end))
            clock[a] = end
            made[(a, label)] = end
            if a == 0 and kind == "F":  # the activation to stage 1, bytes growing with the microbatch
                nbytes = (i + 1) * 100_000
                lat, bw = routes[(0, 1)]
                arrive = end + lat + nbytes / bw
                steps[0].transfers.append(TransferSpan("send", label, 1, nbytes, end, end, i))
                steps[1].transfers.append(TransferSpan("recv", f"1F{i}", 0, nbytes, 0.0, arrive, i))
                arrivals[(1, f"1F{i}")] = arrive
    for a in (0, 1):
        steps[a].end = clock[a]
    trace.steps.append(steps)
    return trace


def test_fit_costs_recovers_known_task_times_gaps_and_per_route_latency_and_bandwidth():
    from mpmd.observe.trace import fit_costs

    task_ms = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.5, (1, "B"): 2.5}
    gaps_ms = [0.1, 0.3, 0.2]
    costs = fit_costs(synthetic_trace(task_ms, gaps_ms, {(0, 1): (2e-4, 1e9)}), num_stages=2)
    assert costs.F == pytest.approx((1e-3, 1.5e-3)) and costs.B == pytest.approx((2e-3, 2.5e-3))
    routes = dict(costs.routes)
    assert routes[(0, 1)][0] == pytest.approx(2e-4, rel=1e-6) and routes[(0, 1)][1] == pytest.approx(1e9, rel=1e-6)
    assert costs.route_time(0, 1, 1e6) == pytest.approx(2e-4 + 1e-3)
    samples = costs.empirical.task_samples()
    assert samples[(1, "B")] == pytest.approx((2.5e-3,) * 4)
    assert all(max(abs(r) for r in rs) < 1e-9 for _, rs in costs.empirical.hops)  # a straight line: no residual
    assert set(round(g * 1e3, 6) for g in costs.empirical.gaps) <= set(gaps_ms)
    assert costs.gap == pytest.approx(np.mean(costs.empirical.gaps))


def test_fit_costs_estimates_the_backward_kinds_the_traced_schedule_did_not_run():
    """A 1F1B trace has no I or W task, a zero-bubble one no B: fitted at 0 they read as free, and ZeroBubbleH1
    predicted from a 1F1B trace came out at half its measured time (a probe). I and W are now half of B each,
    and B is I + W (the first stage's W, which runs its whole backward, is its B)."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs

    task_ms = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.5, (1, "B"): 3.0}
    costs = fit_costs(synthetic_trace(task_ms, [0.0], {(0, 1): (2e-4, 1e9)}), num_stages=2)
    assert costs.B == pytest.approx((2e-3, 3e-3))
    assert costs.I == pytest.approx((1e-3, 1.5e-3)) and costs.W == pytest.approx((1e-3, 1.5e-3))

    ms = 1e-3
    t = Trace()
    zb = {0: [("0F0", 1.0), ("0F1", 1.0), ("0W0", 2.0), ("0W1", 2.0)],
          1: [("1F0", 1.5), ("1I0", 1.0), ("1F1", 1.5), ("1I1", 1.0), ("1W0", 2.0), ("1W1", 2.0)]}
    steps = {}
    for a, runs in zb.items():
        x, clock = ActorStep(a, 0, 0.0, 0.0), 0.0
        for label, d in runs:
            x.runs.append(RunSpan(label, clock, clock, clock, clock + d * ms, -math.inf))
            clock += d * ms
        x.end = clock
        steps[a] = x
    t.steps.append(steps)
    costs = fit_costs(t, num_stages=2)
    assert costs.W == pytest.approx((2 * ms, 2 * ms)) and costs.I == pytest.approx((0.0, 1 * ms))
    assert costs.B == pytest.approx((2 * ms, 3 * ms))


def test_fit_costs_names_a_trace_or_flag_it_cannot_take():
    """None, or a list of traces, met "has no attribute 'steps'"; own_core="yes" was taken as true (a probe)."""
    from mpmd.observe.trace import fit_costs

    trace = synthetic_trace({(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.5, (1, "B"): 3.0}, [0.0], {(0, 1): (2e-4, 1e9)})
    for bad, said in ((None, "NoneType"), ([], "list"), ([trace, None], "a list holding NoneType, Trace")):
        with pytest.raises(mpmd.MpmdError, match=f"trace must be the Trace of .* got {said}"):
            fit_costs(bad, 2)
    with pytest.raises(mpmd.MpmdError, match="own_core must be True or False, got 'yes'"):
        fit_costs(trace, 2, own_core="yes")
    assert fit_costs(trace, 2, own_core=np.bool_(False)).F == pytest.approx((1e-3, 1.5e-3))


def test_fit_costs_leaves_stalls_out_of_the_hops_and_gaps_it_fits_and_samples():
    """A hop 150 ms late among hops of 0.3 ms (the actor or machine stopped, delaying every hop in flight at once)
    is no route's latency and no residual to draw: drawn on their own, one replay in three met one, and a ZB-V step
    was predicted 2.2x its held-out steps. A gap longer than the step's longest Run likewise. Tails within the
    Runs' own length stay."""
    from mpmd.observe.trace import fit_costs

    task_ms = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.5, (1, "B"): 2.5}
    clean = synthetic_trace(task_ms, [0.1, 0.3, 0.2], {(0, 1): (2e-4, 1e9)}, m=8)
    stalled = synthetic_trace(task_ms, [0.1, 0.3, 0.2], {(0, 1): (2e-4, 1e9)}, m=8)
    late = {3: 0.150, 5: 0.0015}  # (a tail shorter than a Run: kept. The Runs after them start as traced: only the
    got = stalled.steps[0][1].transfers  # hops' own times are late)
    got[:] = [dataclasses.replace(t, end=t.end + late.get(t.tag, 0.0)) if t.kind == "recv" else t for t in got]
    runs = stalled.steps[0][1].runs  # a gap of 150 ms before one Run, the Runs after it that much later
    runs[4:] = [dataclasses.replace(r, start=r.start + 0.150, end=r.end + 0.150) for r in runs[4:]]
    c0, c = fit_costs(clean, 2), fit_costs(stalled, 2)
    assert dict(c.routes)[(0, 1)][0] < 5e-4 and c.latency == pytest.approx(c0.latency)
    res = dict(c.empirical.hops)[(0, 1)]
    assert len(res) == 7 and max(res) == pytest.approx(1.5e-3, rel=0.2)
    assert max(c.empirical.gaps) < 1e-3 and c.gap == pytest.approx(c0.gap, rel=0.1)
    # on the route's largest hop (the most bytes), where a plain least-squares line bends to it (a review)
    last = synthetic_trace(task_ms, [0.1, 0.3, 0.2], {(0, 1): (2e-4, 1e9)}, m=8)
    got = last.steps[0][1].transfers
    got[:] = [dataclasses.replace(t, end=t.end + 0.150) if t.kind == "recv" and t.tag == 7 else t for t in got]
    c = fit_costs(last, 2)
    lat, bw = dict(c.routes)[(0, 1)]
    assert lat == pytest.approx(2e-4, rel=1e-3) and bw == pytest.approx(1e9, rel=1e-3) and len(dict(c.empirical.hops)[(0, 1)]) == 7


def test_fit_costs_pools_several_traced_steps():
    """Steps of one trace (`step=[...]` or "all") or several traces fit together: the Runs of both in one least
    squares (a task 1 ms in one step and 3 ms in the next fits 2 ms), their samples, gaps and hops pooled, their
    leads averaged; one step listed is that step's fit, and a list of one trace is that trace."""
    from mpmd.observe.trace import Trace, fit_costs

    fast = synthetic_trace({(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.5, (1, "B"): 2.5}, [0.1], {(0, 1): (2e-4, 1e9)})
    slow = synthetic_trace({(0, "F"): 3.0, (0, "B"): 4.0, (1, "F"): 2.5, (1, "B"): 4.5}, [0.3], {(0, 1): (4e-4, 1e9)})
    both = Trace()
    both.steps = fast.steps + slow.steps
    pooled = fit_costs([fast, slow], 2)
    assert pooled == fit_costs(both, 2, step="all") == fit_costs(both, 2, step=[0, -1]) == fit_costs(both, 2, step=range(2)) \
        == fit_costs(both, 2, step=np.arange(2))
    assert pooled.F == pytest.approx((2e-3, 2e-3)) and pooled.B == pytest.approx((3e-3, 3.5e-3))
    assert pooled.gap == pytest.approx(2e-4)
    routes = dict(pooled.routes)
    assert routes[(0, 1)][0] == pytest.approx(3e-4, rel=1e-6)  # (the same bytes in both: the two latencies' mean)
    samples = pooled.empirical.task_samples()
    assert sorted(samples[(1, "B")]) == pytest.approx([2.5e-3] * 4 + [4.5e-3] * 4)
    assert len(pooled.empirical.gaps) == len(fit_costs(fast, 2).empirical.gaps) + len(fit_costs(slow, 2).empirical.gaps)
    assert fit_costs([fast], 2) == fit_costs(fast, 2) and fit_costs(both, 2, step=[1]) == fit_costs(both, 2, step=1) == fit_costs(slow, 2)
    # of three or more, a step over 1.25x their median is left out (the machine slowed all of it)
    again = synthetic_trace({(0, "F"): 1.1, (0, "B"): 2.1, (1, "F"): 1.6, (1, "B"): 2.6}, [0.1], {(0, 1): (2e-4, 1e9)})
    assert fit_costs([fast, slow, again], 2) == fit_costs([fast, again], 2) != fit_costs([fast, slow], 2)
    for step, said in (([], "a non-empty list"), ("some", "got 'some'"), ([0, 2], "step=2 but the trace holds 2 steps"),
                       (1.0, "got 1.0"), ([True], "step lists True, not a step's index")):
        with pytest.raises(mpmd.MpmdError, match=said):
            fit_costs(both, 2, step=step)
    with pytest.raises(mpmd.MpmdError, match="step=1 but trace 0 of 2 holds 1 step"):
        fit_costs([fast, slow], 2, step=1)
    for twice in (lambda: fit_costs([fast, fast], 2), lambda: fit_costs(both, 2, step=[1, -1]),
                  lambda: fit_costs([fast, both], 2, step=[0])):  # (both's first step is fast's)
        with pytest.raises(mpmd.MpmdError, match="a traced step is listed twice"):
            twice()
    # steps of another compiled step on the same actors (here 8 microbatches, not 4) are refused, not pooled
    more = synthetic_trace({(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.5, (1, "B"): 2.5}, [0.1], {(0, 1): (2e-4, 1e9)}, m=8)
    with pytest.raises(mpmd.MpmdError, match=r"trace 1 of 2 ran other Runs on actor 0 than step 0 of trace 0 of 2 \(16 against 8 Runs; its Run 4 0F4, the other's 0B0\)"):
        fit_costs([fast, more], 2)


def test_trace_breakdown_of_each_actor_adds_up_to_the_step_time():
    task_ms = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.5, (1, "B"): 2.5}
    trace = synthetic_trace(task_ms, [0.1, 0.3], {(0, 1): (2e-4, 1e9)})
    w0, w1 = trace.window()
    for a, b in trace.breakdown().items():
        assert b.compute + b.waiting + b.overhead + b.idle == pytest.approx(w1 - w0)
        assert b.wall == pytest.approx(w1 - w0) and min(b.compute, b.waiting, b.overhead, b.idle) >= 0
        assert b.compute == pytest.approx(sum(task_ms[(a, k)] for k in "FB") * 4e-3)


def test_fit_costs_counts_a_runs_gap_from_its_last_inputs_arrival_not_from_when_the_interpreter_saw_it():
    """The gap before a Run is the runtime's time from when the Run could start (the Run before it ended and its
    last received input arrived) to its start. Counted from when the interpreter saw its inputs there (`ready`),
    the time the interpreter took to reach the Run (posting the sends before it) and to wake on an arrival fell
    out of the model: a real 1F1B step's fitted gap was a fifth of this one, and its replay ended 2 % early. An
    actor that does not report `arrived` (None) is read as before."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs

    ms = 1e-3

    def trace(arrived):  # arrived: (0F1's, 0F2's)
        t = Trace()
        x = ActorStep(0, 0, 0.0, 4.25 * ms)
        x.runs = [RunSpan("0F0", 0.0, 0.0, 0.0, 1.0 * ms, -math.inf if arrived else None),
                  # inputs there all along; the interpreter reached it 0.4 ms after 0F0 ended, started 0.05 ms later
                  RunSpan("0F1", 1.4 * ms, 1.4 * ms, 1.45 * ms, 2.45 * ms, arrived and arrived[0]),
                  # its input arrived at 3.0 ms; the waiting interpreter woke at 3.2 and it started at 3.25
                  RunSpan("0F2", 2.6 * ms, 3.2 * ms, 3.25 * ms, 4.25 * ms, arrived and arrived[1])]
        t.steps.append({0: x})
        return t

    new = trace((-math.inf, 3.0 * ms))
    assert fit_costs(new, 1).gap == pytest.approx((0.45 + 0.25) / 2 * ms)
    assert sorted(fit_costs(new, 1).empirical.gaps) == pytest.approx([0.25 * ms, 0.45 * ms])
    b = new.breakdown()[0]  # waiting for data until the arrival; the rest before a Run is the runtime's
    assert b.waiting == pytest.approx(0.55 * ms) and b.overhead == pytest.approx(0.7 * ms) and b.compute == pytest.approx(3 * ms)
    old = trace(None)
    assert fit_costs(old, 1).gap == pytest.approx(0.05 * ms)
    assert old.breakdown()[0].waiting == pytest.approx(0.4 * ms + 0.75 * ms)


def test_a_run_event_says_when_its_last_input_arrived_and_an_older_actors_does_not():
    from mpmd.observe.trace import ActorStep

    events = [["run", "0F0", 0, 10, 20, 900], ["recv", "x", 1, 8, 0, 1200, 3], ["run", "0F1", 900, 1500, 1510, 2000]]
    wire = {"start": 0, "end": 10_000, "events": events, "run_arrivals": [0, 1200]}
    runs = ActorStep.from_wire(0, 0, wire, offset_ns=0).runs
    assert runs[0].arrived == -math.inf and runs[1].arrived == pytest.approx(1.2e-6)  # (0: none came this step)
    assert runs[0].could_start(0.5e-6) == pytest.approx(0.5e-6) and runs[1].could_start(0.9e-6) == pytest.approx(1.2e-6)
    # an older actor's record (no arrivals), or arrivals that are not one int >= 0 per Run: read from `ready`
    for bad in (None, [0], [0, 1200, 5], [0, True], [0, -1], [0, 1.5], [0, "1200"], "ab"):
        runs = ActorStep.from_wire(0, 0, {**wire, "run_arrivals": bad}, offset_ns=0).runs
        assert [r.arrived for r in runs] == [None, None] and runs[1].could_start(0.9e-6) == pytest.approx(1.5e-6)


def test_replay_trace_replays_a_step_with_its_own_times_and_refuses_another_programs_trace():
    """A trace made by replaying Programs (each Run a gap then its time, each hop its time) is replayed back to
    exactly its span; with a hop 1.0 longer than the trace's Runs allow, the replay waits for it (longer than
    the trace); a trace of other Programs is refused, naming the actor."""
    from mpmd.observe.replay import replay_trace
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, TransferSpan
    from mpmd.schedules.validation import replay_programs

    schedule, m = mpmd.OneFOneB(2), 4
    progs = programs_from_table(schedule, validate(schedule, m))
    gap, hop = 0.1, 0.3
    rep = replay_programs(progs, lambda a, r: gap + (1.0 if r.label.tasks[0].kind == "F" else 2.0) + 0.01 * a, lambda a, r: hop)
    t = Trace()
    steps = {a: ActorStep(a, 0, 0.0, max(rep.end.values())) for a in range(2)}
    for a, p in enumerate(progs):
        tag_of = {ins.buf: ins.tag for ins in p.instructions if isinstance(ins, Recv)}
        arrival = {ins.tag: rep.ready[(a, i)] for i, ins in enumerate(p.instructions) if isinstance(ins, Recv)}
        for i, ins in enumerate(p.instructions):
            if isinstance(ins, Run):
                got = [arrival[tag_of[b]] for b in ins.inputs if b in tag_of]
                steps[a].runs.append(RunSpan(str(ins.label), rep.start[(a, i)], rep.start[(a, i)], rep.start[(a, i)] + gap, rep.end[(a, i)],
                                             max(got) if got else -math.inf))
            elif isinstance(ins, Send):
                made = max(rep.end[(a, j)] for j, x in enumerate(p.instructions[:i]) if isinstance(x, Run) and ins.buf in x.outputs)
                steps[a].transfers.append(TransferSpan("send", str(ins.label), ins.to_actor, 128, made, made, ins.tag))
            elif isinstance(ins, Recv):
                steps[a].transfers.append(TransferSpan("recv", str(ins.label), ins.from_actor, 128, 0.0, arrival[ins.tag], ins.tag))
    t.steps.append(steps)
    first = min(r.start for x in steps.values() for r in x.runs)
    last = max(r.end for x in steps.values() for r in x.runs)
    assert replay_trace(t, progs) == pytest.approx((max(rep.end.values()) - first) / (last - first))
    assert replay_trace(t, progs) == pytest.approx(1.0)
    recv = next(x for x in steps[1].transfers if x.kind == "recv")
    steps[1].transfers[steps[1].transfers.index(recv)] = TransferSpan("recv", recv.label, recv.peer, 128, 0.0, recv.end + 1.0, recv.tag)
    assert replay_trace(t, progs) > 1.0 + 0.5 / (last - first)
    # the trace of a 1-actor program, or of programs with other Runs, is not this step's
    with pytest.raises(mpmd.MpmdError, match="actors"):
        replay_trace(t, progs[:1])
    other = programs_from_table(mpmd.GPipe(2), validate(mpmd.GPipe(2), m))
    with pytest.raises(mpmd.MpmdError, match="actor 0 ran .*not the trace of these programs"):
        replay_trace(t, other)


def test_monte_carlo_draws_runs_without_samples_of_their_own_from_every_runs_spread():
    """Most of 1F1B's Runs do two tasks, and the task samples are of Runs that did one: the Monte Carlo replay
    drew nothing for them and gave the mean model's step (a real step ended 0-7 % later than its Runs at their
    fitted means). Such Runs take their costs' time times a factor drawn from every Run's measured / fitted."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs
    from mpmd.schedules.montecarlo import Empirical, simulate_monte_carlo

    schedule, m = mpmd.OneFOneB(2), 4
    progs = programs_from_table(schedule, validate(schedule, m))
    base = Costs(F=1.0, B=2.0, latency=0.1)
    want = simulate_programs(progs, base)
    flat = Costs(F=1.0, B=2.0, latency=0.1, empirical=Empirical(factors=(1.0,)))
    assert simulate_monte_carlo(progs, flat, runs=5).step_time == pytest.approx(want.step_time)
    spread = Costs(F=1.0, B=2.0, latency=0.1, empirical=Empirical(factors=(0.7, 1.3)))
    a, b = simulate_monte_carlo(progs, spread, runs=300, seed=3), simulate_monte_carlo(progs, spread, runs=300, seed=3)
    assert a.step_times == b.step_times and a.stdev > 0
    assert a.step_time > 1.02 * want.step_time  # slow Runs on the critical path are not made up by fast ones off it
    # the factors are drawn as measured (a robust fit's means leave the slowest Runs out; their factors bring them
    # back): Runs all twice their costs' time are a step of costs twice as long
    doubled = Costs(F=1.0, B=2.0, latency=0.1, empirical=Empirical(factors=(2.0, 2.0)))
    twice = simulate_programs(progs, Costs(F=2.0, B=4.0, latency=0.1))
    assert simulate_monte_carlo(progs, doubled, runs=5).step_time == pytest.approx(twice.step_time)
    # fit_costs keeps each fused Run's own duration over its fitted one (3 and 5 ms, over the same fitted F + B).
    # Not a Run that also did a step phase (its phase's time is no task's) nor one of a task alone where fused ones
    # exist (a review: such Runs' factors of 2-10 made fused Runs 1.4-2x longer on average)
    t = Trace()
    x = ActorStep(0, 0, 0.0, 17.5e-3)
    clock = 0.0
    for label, ms in (("pre+0F0", 2.5), ("0F1", 1.0), ("0F2+0B0", 3.0), ("0F3+0B1", 5.0), ("0B2", 3.0), ("0B3", 3.0)):
        x.runs.append(RunSpan(label, clock, clock, clock, clock + ms * 1e-3, -math.inf))
        clock += ms * 1e-3
    t.steps.append({0: x})
    c = fit_costs(t, 1)
    want = c.F[0] + c.B[0] + c.overhead
    assert sorted(c.empirical.factors) == pytest.approx([3e-3 / want, 5e-3 / want])


def test_monte_carlo_refuses_factors_that_are_not_finite_and_positive():
    """The factors scale Runs as they are (no longer to mean 1): a negative, infinite or NaN one would give Runs of any
    length (a review)."""
    from mpmd.schedules.montecarlo import Empirical, simulate_monte_carlo

    schedule = mpmd.OneFOneB(2)
    progs = programs_from_table(schedule, validate(schedule, 4))
    for bad in ((1.0, -0.5), (math.inf,), (math.nan, 1.0), (0.0,)):
        with pytest.raises(mpmd.ScheduleError, match="factors must be finite numbers above 0"):
            simulate_monte_carlo(progs, Costs(F=1.0, B=2.0, empirical=Empirical(factors=bad)), runs=3)


def test_monte_carlo_without_factors_draws_each_of_a_fused_runs_tasks_from_its_samples():
    """An Empirical without factors (made by hand, or fitted from Runs of one task each) keeps the spread of a
    fused Run's tasks: each draws from its samples (the factors' first cut drew nothing then)."""
    from mpmd.schedules.montecarlo import Empirical, simulate_monte_carlo

    fused = Program(0, [0], [1], [Run(0, (0,), (1,), Label.of(Task(0, "F", 0), Task(0, "B", 0)))])
    tasks = {(0, "F"): [0.5, 1.5], (0, "B"): [1.0, 3.0]}
    spread = simulate_monte_carlo([fused], Costs(F=1.0, B=2.0, empirical=Empirical.of(tasks, [], {})), runs=50, seed=1)
    assert spread.stdev > 0 and set(spread.step_times) <= {1.5, 2.5, 3.5, 4.5}
    flat = simulate_monte_carlo([fused], Costs(F=1.0, B=2.0, empirical=Empirical.of(tasks, [], {}, factors=[1.0])), runs=5)
    assert flat.stdev == 0 and flat.step_time == pytest.approx(3.0)


def test_monte_carlo_without_spread_equals_the_mean_model_and_with_spread_is_seeded_and_never_faster():
    from mpmd.schedules.montecarlo import Empirical, simulate_monte_carlo

    schedule, m = mpmd.OneFOneB(2), 4
    progs = programs_from_table(schedule, validate(schedule, m))
    base = Costs(F=1.0, B=2.0, latency=0.1)
    flat = Costs(F=1.0, B=2.0, latency=0.1, empirical=Empirical.of({(0, "F"): [1.0], (1, "B"): [2.0]}, [], {}))
    want = simulate_programs(progs, base)
    got = simulate_monte_carlo(progs, flat, runs=5)
    assert got.step_time == pytest.approx(want.step_time) and got.bubble == pytest.approx(want.bubble)
    # Same means, spread out: the step is a max of sums (convex in the durations), so its mean can only grow.
    spread = Costs(F=1.0, B=2.0, latency=0.1, empirical=Empirical.of(
        {(s, k): [v * 0.5, v * 1.5] for s in range(2) for k, v in (("F", 1.0), ("B", 2.0))}, [], {((0, 1)): [-0.1, 0.1]}))
    a, b = simulate_monte_carlo(progs, spread, runs=200, seed=7), simulate_monte_carlo(progs, spread, runs=200, seed=7)
    assert a.step_times == b.step_times
    assert a.step_time >= want.step_time - 1e-9 and a.p90 >= a.step_time and a.stdev > 0


def test_monte_carlo_charges_stage_0s_whole_backward_to_its_w_as_the_mean_model_does():
    """Stage 0 exports no input gradient: no I task, its W runs the whole backward and costs I + W. The Monte
    Carlo replay used hand-made costs as given (27.0 for ZB-H1 where every other simulator gives 31.5; a probe)."""
    from mpmd.schedules.montecarlo import simulate_monte_carlo

    costs = Costs(F=1.0, B=2.0, I=5.0, W=0.5)
    for schedule, m in ((mpmd.ZeroBubbleH1(2), 4), (mpmd.ZeroBubbleH1(3), 5)):
        progs = programs_from_table(schedule, validate(schedule, m))
        want = simulate_programs(progs, costs)
        assert want.step_time == pytest.approx(simulate(schedule, m, costs).step_time)
        assert simulate_monte_carlo(progs, costs, runs=3).step_time == pytest.approx(want.step_time)


def test_monte_carlo_draws_around_the_fitted_means_not_the_samples_own():
    """The samples are Runs that did one task alone; the fit's means (over fused Runs too) may differ. The
    draws keep the samples' shape and take the fit's mean: samples all twice the fitted F give the fitted step."""
    from mpmd.schedules.montecarlo import Empirical, simulate_monte_carlo

    schedule, m = mpmd.OneFOneB(2), 4
    progs = programs_from_table(schedule, validate(schedule, m))
    want = simulate_programs(progs, Costs(F=1.0, B=2.0, latency=0.1))
    off = Costs(F=1.0, B=2.0, latency=0.1, empirical=Empirical.of({(s, "F"): [2.0, 2.0] for s in range(2)}, [], {}))
    assert simulate_monte_carlo(progs, off, runs=3).step_time == pytest.approx(want.step_time)
    # a spread of samples whose mean is off by 1.5x: the mean model's step from below, as with centred samples
    spread = Costs(F=1.0, B=2.0, latency=0.1, empirical=Empirical.of({(s, "B"): [1.5, 4.5] for s in range(2)}, [], {}))
    centred = Costs(F=1.0, B=2.0, latency=0.1, empirical=Empirical.of({(s, "B"): [1.0, 3.0] for s in range(2)}, [], {}))
    a, b = simulate_monte_carlo(progs, spread, runs=50, seed=3), simulate_monte_carlo(progs, centred, runs=50, seed=3)
    assert a.step_times == pytest.approx(b.step_times) and a.step_time >= want.step_time - 1e-9


def test_fit_costs_separates_a_per_run_overhead_where_fused_and_single_task_runs_tell_it_apart():
    """1F1B-like: single warm-up forwards, fused B+F, single cool-down backwards, each Run paying 0.4 ms on top
    of its tasks. The fit recovers the tasks and the overhead; without fused Runs it cannot, and folds it in."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs

    f, b, o = 1e-3, 2e-3, 4e-4

    def trace_of(labels):
        t, x, clock = Trace(), ActorStep(0, 0, 0.0, 0.0), 0.0
        for label in labels:
            d = o + sum(f if p[1] == "F" else b for p in label.split("+"))
            x.runs.append(RunSpan(label, clock, clock, clock, clock + d))
            clock += d
        x.end = clock
        t.steps.append({0: x})
        return t

    fused = fit_costs(trace_of(["0F0", "0F1", "0B0+0F2", "0B1+0F3", "0B2", "0B3"]), num_stages=1)
    assert fused.overhead == pytest.approx(o) and fused.F == pytest.approx((f,)) and fused.B == pytest.approx((b,))
    single = fit_costs(trace_of(["0F0", "0F1", "0B0", "0B1"]), num_stages=1)
    assert single.overhead == 0 and single.F == pytest.approx((f + o,)) and single.B == pytest.approx((b + o,))
    # per_run=False: the old model (tasks absorb the overhead), as profile_costs wants it
    assert fit_costs(trace_of(["0F0", "0B0+0F1", "0B1"]), 1, per_run=False).overhead == 0


def test_fit_costs_keeps_a_per_run_overhead_only_where_the_runs_scatter_leaves_it_told_apart():
    """On 4 actors sharing 2 cores one traced step's overhead came out anywhere from 0 to 3 ms, and pooled over
    three at 2.2 ms: rescaled to 8 stages every Run paid it (interleaved schedules predicted 1.4-1.7x). An
    overhead under 2 standard errors is folded into the tasks; a clear one (small scatter) stays."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs

    f, b = 1e-3, 2e-3
    labels = ["0F0", "0F1", "0F2", "0B0+0F3", "0B1+0F4", "0B2+0F5", "0B3+0F6", "0B4+0F7", "0B5", "0B6", "0B7"]

    def trace_of(o, noise):
        t, x, clock = Trace(), ActorStep(0, 0, 0.0, 0.0), 0.0
        for label, e in zip(labels, noise):
            d = o + sum(f if p[1] == "F" else b for p in label.split("+")) + e
            x.runs.append(RunSpan(label, clock, clock, clock, clock + d))
            clock += d
        x.end = clock
        t.steps.append({0: x})
        return t

    scatter = [3e-4, -1e-4, 2e-4, -4e-4, 3e-4, -2e-4, 1e-4, -3e-4, 4e-4, -1e-4, 2e-4]  # ~0.3 ms either way, no overhead
    import numpy as np

    rows = np.array([[lb.count("F"), lb.count("B"), 1.0] for lb in labels])
    durations = np.array([sum(f if p[1] == "F" else b for p in lb.split("+")) + e for lb, e in zip(labels, scatter)])
    assert np.linalg.lstsq(rows, durations, rcond=None)[0][-1] > 0  # least squares alone finds an overhead
    noisy = fit_costs(trace_of(0.0, scatter), num_stages=1)
    assert noisy.overhead == 0 and noisy.F[0] + noisy.B[0] == pytest.approx(f + b, rel=0.1)
    clear = fit_costs(trace_of(4e-4, [e / 10 for e in scatter]), num_stages=1)
    assert clear.overhead == pytest.approx(4e-4, rel=0.15)


def test_fit_costs_splits_a_stage_whose_f_and_b_always_ran_fused_as_the_other_stages_split_theirs():
    """The last stage's F and B ran as one Run each microbatch: only their sum is in the trace, and least squares
    had put it all on one of them (an F of 0: another schedule's B then started before that stage's forwards were
    done). The sum is split as the other stages' B / F (here 2.5), or 1:2 where no stage tells. Found by a probe."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs

    times = {(0, "F"): 1e-3, (0, "B"): 2.5e-3, (1, "F"): 1.2e-3, (1, "B"): 3e-3}

    def trace_of(labels):
        t, x, clock = Trace(), ActorStep(0, 0, 0.0, 0.0), 0.0
        for label in labels:
            d = sum(times[(int(p[0]), p[1])] for p in label.split("+"))
            x.runs.append(RunSpan(label, clock, clock, clock, clock + d))
            clock += d
        x.end = clock
        t.steps.append({0: x})
        return t

    got = fit_costs(trace_of(["0F0", "0F1", "1F0+1B0", "1F1+1B1", "0B0", "0B1"]), num_stages=2, per_run=False)
    assert got.F == pytest.approx((1e-3, 4.2e-3 / 3.5)) and got.B == pytest.approx((2.5e-3, 4.2e-3 * 2.5 / 3.5))
    alone = fit_costs(trace_of(["1F0+1B0", "1F1+1B1"]), num_stages=2, per_run=False)
    assert alone.F[1] == pytest.approx(1.4e-3) and alone.B[1] == pytest.approx(2.8e-3)
    # a split backward fuses the last stage's F and I (ZB-H1): split as the others do, here by stage 0's I / F
    times.update({(0, "I"): 2e-3, (0, "W"): 1e-3, (1, "I"): 2.4e-3, (1, "W"): 1e-3})
    zb = fit_costs(trace_of(["0F0", "1F0+1I0", "0I0", "0W0", "1W0", "0F1", "1F1+1I1", "0I1", "0W1", "1W1"]), num_stages=2,
                   per_run=False)
    assert zb.F == pytest.approx((1e-3, 1.2e-3)) and zb.I == pytest.approx((2e-3, 2.4e-3))


def test_fit_costs_is_not_pulled_off_by_one_outlying_run():
    """Run times of a real 2-actor 1F1B step of a 64-wide MLP: its first Run took 0.65 ms where its like took 0.15,
    and the fit made stage 0's F 0.4 ms and both stages' B 0 (the simulated step then had no backward at all; a
    probe). The Runs the fit explains worst (past 3 robust standard deviations) are left out of a second fit."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs

    runs = {0: [("0F0", .649), ("0F1", .147), ("0B0+0F2", .182), ("0B1+0F3", .306), ("0B2+0F4", .172), ("0B3+0F5", .124),
                ("0B4+0F6", .111), ("0B5+0F7", .102), ("0B6", .119), ("0B7+post", .128)],
            1: [("1F0+1B0", .312), ("1F1+1B1", .152), ("1F2+1B2", .212), ("1F3+1B3", .247), ("1F4+1B4", .224),
                ("1F5+1B5", .217), ("1F6+1B6", .215), ("1F7+1B7", .157), ("post", .134)]}
    t, step = Trace(), {}
    for a, rs in runs.items():
        x, now = ActorStep(a, 0, 0.0, 0.01), 1e-4
        for label, ms in rs:
            x.runs.append(RunSpan(label, now, now, now, now + ms * 1e-3))
            now += ms * 1e-3 + 2e-4
        step[a] = x
    t.steps.append(step)
    c = fit_costs(t, 2)
    assert all(b > 0.05e-3 for b in c.B), c.B
    assert 0.05e-3 < c.F[0] < 0.2e-3, c.F  # (the lone forwards but the first: 0.147 ms)
    assert c.F[0] + c.B[0] == pytest.approx(np.median([.182, .306, .172, .124, .111, .102]) * 1e-3, rel=0.35)


def test_fit_costs_recovers_the_steps_lead_and_tail_and_the_simulated_step_spans_the_traced_window():
    """The synthetic step shifted 0.7 ms after its start, ending 1.3 ms after its last Run: fit_costs finds both;
    simulating the same Programs on the fit gives the traced window, and lead and tail count as every actor's idle."""
    from mpmd.observe.trace import fit_costs

    task_ms = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.5, (1, "B"): 2.5}
    trace = synthetic_trace(task_ms, [0.0], {(0, 1): (2e-4, 1e9)})
    lead, tail = 7e-4, 1.3e-3
    for a, x in trace.steps[0].items():
        x.runs = [type(r)(r.label, r.waited_from + lead, r.ready + lead, r.start + lead, r.end + lead) for r in x.runs]
        x.transfers = [type(t)(t.kind, t.label, t.peer, t.nbytes, t.start + lead, t.end + lead, t.tag) for t in x.transfers]
    end = max(r.end for x in trace.steps[0].values() for r in x.runs) + tail
    for x in trace.steps[0].values():
        x.end = end
    costs = fit_costs(trace, num_stages=2)
    assert costs.lead == pytest.approx(lead) and costs.tail == pytest.approx(tail)
    bare = Costs(F=(1e-3, 1.5e-3), B=(2e-3, 2.5e-3), latency=2e-4)
    with_ends = Costs(F=(1e-3, 1.5e-3), B=(2e-3, 2.5e-3), latency=2e-4, lead=lead, tail=tail)
    schedule = mpmd.OneFOneB(2)
    a, b = mpmd.simulate(schedule, 4, bare), mpmd.simulate(schedule, 4, with_ends)
    assert b.step_time == pytest.approx(a.step_time + lead + tail)
    assert b.timeline[0][0][0] == pytest.approx(a.timeline[0][0][0] + lead)
    for x, y in zip(a.bubble_per_actor, b.bubble_per_actor):  # the same busy time over a longer step
        assert (1 - y) * b.step_time == pytest.approx((1 - x) * a.step_time)
    with pytest.raises(ValueError, match="Costs.tail must be a finite number >= 0"):
        Costs(tail=-1.0)


# ---- actors sharing cores (mpmd.schedules.sharing) ------------------------------------------------------------
@pytest.mark.parametrize("schedule,m", [(mpmd.GPipe(2), 4), (mpmd.OneFOneB(4), 8), (mpmd.InterleavedOneFOneB(8, 4), 8)])
@pytest.mark.parametrize("uneven", [False, True])
def test_on_one_shared_core_the_step_takes_the_whole_work_and_on_enough_cores_nothing_changes(schedule, m, uneven):
    """One core for every actor: the work is done one Run at a time, so the step is the sum of all Runs (the
    processor-sharing fixed point reaches it within 1e-6, even and uneven stages); as many cores as actors: the
    plain replay; the schedule-table simulator and the Programs one agree."""
    s = schedule.num_stages
    f, b = ((1.0, 3.0, 0.5, 2.0, 1.0, 1.5, 0.7, 2.2)[:s], (2.0, 5.0, 1.0, 4.0, 2.0, 3.5, 1.2, 4.1)[:s]) if uneven else (1.0, 2.0)
    progs = programs_from_table(schedule, validate(schedule, m))
    alone = simulate_programs(progs, Costs(F=f, B=b))
    work = sum(e - s for row in alone.timeline for s, e, _ in row)
    assert simulate_programs(progs, Costs(F=f, B=b, cores=len(progs))).step_time == alone.step_time
    one = simulate_programs(progs, Costs(F=f, B=b, cores=1))
    assert one.step_time == pytest.approx(work, rel=1e-6)  # (printed to 6 digits: 23.9999 for 24 before the snap)
    assert mpmd.simulate(schedule, m, Costs(F=f, B=b, cores=1)).step_time == pytest.approx(one.step_time, rel=1e-3)
    two = simulate_programs(progs, Costs(F=f, B=b, cores=2)).step_time
    assert max(alone.step_time, work / 2) <= two * 1.001 and two <= one.step_time  # never faster than half the work on 2 cores


def test_sharing_factors_are_the_time_weighted_number_of_runs_over_the_cores():
    from mpmd.schedules.sharing import sharing_factors

    # actor 0 runs [0, 4); actor 1 runs [2, 4) and [4, 6); actor 2 runs [0, 2)
    spans = [(0, 0.0, 4.0), (1, 2.0, 4.0), (1, 4.0, 6.0), (2, 0.0, 2.0)]
    assert sharing_factors(spans, 1) == pytest.approx([2.0, 2.0, 1.0, 2.0])
    assert sharing_factors(spans, 2) == pytest.approx([1.0, 1.0, 1.0, 1.0])
    # processor sharing, not the mean load: alone for 1, then three at once on 2 cores for 1: 2 / (1 + 2/3)
    assert sharing_factors([(0, 0.0, 2.0), (1, 1.0, 2.0), (2, 1.0, 2.0)], 2) == pytest.approx([1.2, 1.5, 1.5])


def test_fit_costs_of_actors_sharing_a_core_recovers_each_runs_own_time():
    """Two actors whose Runs ran side by side on one core, each taking twice its own time: the fit with cores=1
    gives the own times, and simulating them on one shared core gives the measured step back."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs

    trace = Trace()
    steps = {a: ActorStep(a, 0, 0.0, 0.0) for a in range(2)}
    clock = 0.0
    for i in range(4):  # both actors run their stage's forward of microbatch i at once, each 2x its 1 ms
        for a in range(2):
            steps[a].runs.append(RunSpan(f"{a}F{i}", clock, clock, clock, clock + 2e-3))
        clock += 2e-3
    for a in range(2):
        steps[a].end = clock
    trace.steps.append(steps)
    assert fit_costs(trace, 2).F == pytest.approx((2e-3, 2e-3))
    own = fit_costs(trace, 2, cores=1)
    assert own.F == pytest.approx((1e-3, 1e-3)) and own.cores == 1
    assert fit_costs(trace, 2, cores=2).cores is None  # a core each: nothing to undo


def test_the_runtimes_own_cpu_loads_shared_cores_as_that_many_more_things_running():
    """Written-down model (mpmd.schedules.sharing): L CPU seconds of the runtime's own work over a step of T
    seconds count as L / T more things running. Two actors each with one Run of work 1 at once on one core:
    each progresses at 1 / (2 + L / T), so T = 2 + L / T, T = 1 + sqrt(1 + L) (L = 3: T = 3). With at least a
    core per actor (`cores` given) Runs are not slowed; Costs.runtime_cpu charges it per Run, Send and Recv."""
    from mpmd.schedules.sharing import runtime_loads, settle

    def replay(duration):
        return {k: 0.0 for k in "ab"}, {k: duration(k) for k in "ab"}

    busy, idle = {"a": 1.0, "b": 1.0}, {"a": 0.0, "b": 0.0}
    assert settle(replay, lambda k: "ab".index(k), busy, idle, 1, rounds=200, actor_loads=(1.0, 2.0)) == pytest.approx(
        {"a": 3.0, "b": 3.0}, rel=1e-4)  # (shared: the loops' 3 s in all)
    assert settle(replay, lambda k: "ab".index(k), busy, idle, 1, rounds=200) == pytest.approx({"a": 2.0, "b": 2.0}, rel=1e-4)
    progs = programs_from_table(mpmd.GPipe(2), validate(mpmd.GPipe(2), 4))
    count = sum(isinstance(i, (Run, Send, Recv)) for p in progs for i in p.instructions)
    assert sum(runtime_loads(progs, 1e-3)) == pytest.approx(count * 1e-3) and sum(runtime_loads(progs, 0.0)) == 0.0
    plain = simulate_programs(progs, Costs(F=1.0, B=2.0, cores=1)).step_time
    loaded = simulate_programs(progs, Costs(F=1.0, B=2.0, cores=1, runtime_cpu=0.5)).step_time
    assert loaded > plain * 1.2  # 32 instructions (16 Runs, 8 Sends, 8 Recvs) x 0.5 s beside 24 s of Runs
    assert simulate_programs(progs, Costs(F=1.0, B=2.0, cores=2, runtime_cpu=0.5)).step_time == pytest.approx(
        simulate_programs(progs, Costs(F=1.0, B=2.0)).step_time)  # a core each to spare: the plain replay
    table = mpmd.simulate(mpmd.GPipe(2), 4, Costs(F=1.0, B=2.0, cores=1, runtime_cpu=0.5)).step_time
    assert table == pytest.approx(loaded, rel=0.02)  # the table counts a Run per task, a Send and a Recv per hop


def test_an_actor_on_a_core_of_its_own_shares_it_with_its_event_loop_alone():
    """Written-down model: an actor pinned to its own core whose loop uses L CPU seconds over a step of T runs its
    Runs at 1 / (1 + L / T). One Run of 1 s and runtime_cpu = 2 s (one instruction): T = 1 + 2 / T, T = 2. Two
    actors: each is slowed by its own loop only (a busier loop on actor 1 does not slow actor 0)."""
    one = [Program(0, [], [], [Run(0, (), (0,), Label.of(Task(0, "F", 0)))])]
    assert simulate_programs(one, Costs(F=1.0, runtime_cpu=2.0)).step_time == pytest.approx(2.0, rel=1e-4)
    assert simulate_programs(one, Costs(F=1.0, runtime_cpu=2.0, cores=1)).step_time == 1.0  # a core per actor to spare
    assert simulate_programs(one, Costs(F=1.0)).step_time == 1.0
    from mpmd.schedules.montecarlo import simulate_monte_carlo

    assert simulate_monte_carlo(one, Costs(F=1.0, runtime_cpu=2.0), runs=3).step_time == pytest.approx(2.0, rel=1e-2)
    two = [Program(0, [], [], [Run(0, (), (0,), Label.of(Task(0, "F", 0)))]),
           Program(1, [], [], [Run(0, (), (0,), Label.of(Task(1, "F", 0))), *[Run(i, (), (i,), Label.of(Task(1, "F", i)))
                                                                              for i in range(1, 4)]])]
    sim = simulate_programs(two, Costs(F=(1.0, 0.25), runtime_cpu=0.25))
    t = sim.step_time  # actor 1: 4 Runs of 0.25 s and 1 s of loop CPU; actor 0: 1 Run of 1 s and 0.25 s of loop CPU
    assert t == pytest.approx(1.0 * (1 + 1.0 / t), rel=1e-3)
    assert sim.timeline[0][0][1] - sim.timeline[0][0][0] == pytest.approx(1.0 + 0.25 / t, rel=1e-3)
    table = mpmd.simulate(mpmd.OneFOneB(2), 4, Costs(F=1.0, B=2.0, runtime_cpu=0.5)).step_time
    progs = programs_from_table(mpmd.OneFOneB(2), validate(mpmd.OneFOneB(2), 4))
    assert table == pytest.approx(simulate_programs(progs, Costs(F=1.0, B=2.0, runtime_cpu=0.5)).step_time, rel=0.02)
    assert table > mpmd.simulate(mpmd.OneFOneB(2), 4, Costs(F=1.0, B=2.0)).step_time * 1.1


def test_fit_costs_reads_the_runtimes_cpu_per_instruction_from_what_each_actor_reports():
    """Two actors on one core, each Run 2 ms while both run; each actor's event loop reports 1.6 ms of CPU over
    the 8 ms step (4 Runs, 4 transfers: 0.2 ms per instruction): the fit gives runtime_cpu = 0.2 ms, and each
    Run's own time is 2 ms x 1 / (2 + 3.2 / 8) (the loops' load counted as 0.4 more things running); without
    the reports, or with a core each, none."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, TransferSpan, fit_costs

    def trace(report):
        t = Trace()
        steps = {a: ActorStep(a, 0, 0.0, 0.0) for a in range(2)}
        clock = 0.0
        for i in range(4):
            for a in range(2):
                steps[a].runs.append(RunSpan(f"{a}F{i}", clock, clock, clock, clock + 2e-3))
                steps[a].transfers.append(TransferSpan("send" if a == 0 else "recv", f"0F{i}", 1 - a, 64, clock + 2e-3,
                                                       clock + 2e-3, i))
            clock += 2e-3
        for a in range(2):
            steps[a].end = clock
            steps[a].cpu = report
        t.steps.append(steps)
        return t

    plain = fit_costs(trace(None), 2, cores=1)
    assert plain.runtime_cpu == 0.0 and plain.F == pytest.approx((1e-3, 1e-3))
    got = fit_costs(trace(1.6e-3), 2, cores=1)
    assert got.runtime_cpu == pytest.approx(0.2e-3)
    assert got.F == pytest.approx((2e-3 / 2.4, 2e-3 / 2.4))
    assert fit_costs(trace(1.6e-3), 2, cores=2).runtime_cpu == 0.0  # a core each, maybe not pinned: not read
    # pinned to a core each: the 2 ms Runs ran at 1 / (1 + 1.6 / 8) beside each actor's own loop
    pinned = fit_costs(trace(1.6e-3), 2, own_core=True)
    assert pinned.runtime_cpu == pytest.approx(0.2e-3) and pinned.cores is None
    assert pinned.F == pytest.approx((2e-3 / 1.2, 2e-3 / 1.2))
    # loops that differ are read as their mean per instruction, as the simulators charge it: 2.4 ms and 0.8 ms
    uneven = trace(1.6e-3)
    uneven.steps[0][0].cpu, uneven.steps[0][1].cpu = 2.4e-3, 0.8e-3
    both = fit_costs(uneven, 2, own_core=True)
    assert both.runtime_cpu == pytest.approx(0.2e-3) and both.F == pytest.approx((2e-3 / 1.2, 2e-3 / 1.2))


def test_the_runtimes_load_fitted_over_a_window_with_lead_and_tail_simulates_the_traced_step_back():
    """Two actors on one core, four 2 ms Runs each side by side, 2 ms before the first and after the last, each
    loop reporting 1.6 ms of CPU: the fit spreads the 3.2 ms over the 12 ms window, and simulating the same
    Programs on the fit gives 12 ms again (the simulators spread it over the Runs' span plus lead and tail)."""
    from mpmd.observe.trace import ActorStep, RunSpan, Trace, fit_costs

    t, lead = Trace(), 2e-3
    steps = {a: ActorStep(a, 0, 0.0, 0.0, cpu=1.6e-3) for a in range(2)}
    for i in range(4):
        for a in range(2):
            c = lead + i * 2e-3
            steps[a].runs.append(RunSpan(f"{a}F{i}", c, c, c, c + 2e-3))
    for a in range(2):
        steps[a].end = lead + 8e-3 + 2e-3
    t.steps.append(steps)
    costs = fit_costs(t, 2, cores=1)
    assert costs.lead == pytest.approx(lead) and costs.tail == pytest.approx(2e-3)
    assert costs.runtime_cpu == pytest.approx(3.2e-3 / 8) and costs.F == pytest.approx((2e-3 / (2 + 3.2 / 12),) * 2)
    progs = [Program(a, [], [], [Run(i, (), (10 * a + i,), Label.of(Task(a, "F", i))) for i in range(4)]) for a in range(2)]
    assert simulate_programs(progs, costs).step_time == pytest.approx(12e-3, rel=1e-3)


@pytest.mark.parametrize("cpu", [math.nan, math.inf, -1.0, True, "1", None, 1e300, 0.5])
def test_a_cpu_report_that_cannot_be_a_loops_cpu_over_the_step_is_dropped_and_the_fit_goes_on(cpu):
    """What an actor says its loop used is read only when it is a number between 0 and the step's wall time
    (here 10 ms: 0.5 s is as impossible as NaN); else it is not reported, and the fit has no runtime load."""
    from mpmd.observe.trace import ActorStep, Trace, fit_costs

    wire = {"start": 0, "end": 10_000_000, "events": [["run", "0F0", 0, 0, 1_000_000, 9_000_000]], "cpu": cpu}
    x = ActorStep.from_wire(0, 0, wire, 0)
    assert x.cpu is None
    t = Trace()
    t.steps.append({0: x, 1: ActorStep.from_wire(1, 0, {**wire, "cpu": 1e-3}, 0)})
    costs = fit_costs(t, 1, cores=1)
    assert costs.runtime_cpu == 0.0 and costs.F[0] > 0
    assert ActorStep.from_wire(0, 0, {**wire, "cpu": 2e-3}, 0).cpu == 2e-3


@pytest.mark.parametrize("kw", [{"F": math.nan}, {"F": (1.0, math.nan)}, {"gap": math.nan}, {"latency": math.inf},
                                {"B": math.inf}, {"latency": "1"}, {"overhead": None}, {"bandwidth": math.nan}])
def test_costs_refuse_nan_infinity_and_non_numbers(kw):
    """A NaN task time timed 1F1B as nan with bubble 0; (1, nan) gave a finite wrong step (found by a probe)."""
    with pytest.raises(ValueError, match=f"Costs.{next(iter(kw))}"):
        Costs(**kw)


def test_segment_costs_refuse_nan():
    from mpmd.schedules.balance import SegmentCosts

    with pytest.raises(ValueError, match="SegmentCosts.F"):  # it made balance pick (1, 7) for equal segments
        SegmentCosts(F=(1, 1, 1, math.nan, 1, 1, 1, 1), B=(2,) * 8)
    assert Costs(F=np.float32(2), B=np.array([1, 2])).B == (1.0, 2.0)  # numpy numbers and arrays are numbers
    # bandwidth and cores too, at once (they were refused later as Costs' own, and tune called every candidate's
    # tracing failed, then said no candidate fit the batch: a probe)
    for kw in ({"bandwidth": 0}, {"bandwidth": -1.0}, {"bandwidth": math.nan}, {"cores": 0}, {"cores": 1.5}):
        with pytest.raises(ValueError, match=f"SegmentCosts.{next(iter(kw))}"):
            SegmentCosts(F=(1, 1), B=(2, 2), **kw)
    assert SegmentCosts(F=(1, 1), B=(2, 2), bandwidth=math.inf, cores=2).cores == 2


def test_from_timings_refuses_keys_it_would_drop():
    with pytest.raises(ValueError, match="names stage 5, but num_stages=2"):
        Costs.from_timings({"5F": 1.0}, num_stages=2)
    with pytest.raises(ValueError, match="timing key 3 is a int"):
        Costs.from_timings({3: 1.0})
    with pytest.raises(ValueError, match="not a finite number"):
        Costs.from_timings({"F": math.nan})


@pytest.mark.parametrize("schedule", [mpmd.OneFOneB, None, "OneFOneB"])
def test_simulate_and_validate_name_what_is_not_a_schedule(schedule):
    with pytest.raises(mpmd.ScheduleError, match="expected a schedule such as"):
        simulate(schedule, 4)


def test_simulate_refuses_costs_that_are_not_costs_and_schedules_whose_tasks_are_not_lists():
    with pytest.raises(mpmd.ScheduleError, match="costs must be mpmd.Costs"):
        simulate(mpmd.OneFOneB(2), 4, {"F": 1})

    class NoRows(mpmd.OneFOneB):
        def tasks(self, num_microbatches):
            return None

    with pytest.raises(mpmd.ScheduleError, match=r"tasks\(4\) must return one list of Tasks per actor"):
        validate(NoRows(2), 4)


def test_custom_refuses_tasks_that_are_not_tasks():
    with pytest.raises(mpmd.ScheduleError, match=r"order\[0\]\[0\] \(actor 0's task 0\): 1 is not a task"):  # as a bad string is
        Custom(num_stages=2, order=((1, 2), (3, 4)))
    with pytest.raises(mpmd.ScheduleError, match="stage and microbatch are ints >= 0"):  # it said "use 0 microbatches"
        Custom(num_stages=1, order=((Task(0, "F", -1),),))


def test_cli_writes_the_format_its_flag_names_and_says_when_it_cannot_write(tmp_path, capsys):
    args = ["simulate", "--schedule", "OneFOneB", "--actors", "2", "--microbatches", "4"]
    assert main([*args, "--svg", str(tmp_path / "a.pic")]) == 0
    assert (tmp_path / "a.pic").read_text().lstrip().startswith(("<svg", "<?xml"))  # --svg: an SVG, whatever the name
    assert main([*args, "--svg", str(tmp_path / "a.png")]) == 2  # (but not in a file named for the other format)
    capsys.readouterr()
    assert main([*args, "--svg", str(tmp_path / "missing" / "a.svg")]) == 2
    assert "cannot write" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--costs", "routes=1"])


def test_simulate_times_an_evaluation_table_of_forward_tasks_alone():
    """A table of F tasks validates with forward_only=True and runs on the actors; simulate refused it ("tasks
    missing from the schedule: 0B0 ...": a probe). Its step is the forward pipeline's (m + p - 1) F."""
    evaluation = Custom(num_stages=2, order=(("0F0", "0F1", "0F2"), ("1F0", "1F1", "1F2")))
    r = simulate(evaluation, 3, Costs(F=2.0), forward_only=True)
    assert r.step_time == pytest.approx((3 + 2 - 1) * 2.0) and r.bubble == pytest.approx(1 / 4)
    with pytest.raises(mpmd.ScheduleError, match="missing"):
        simulate(evaluation, 3)


@pytest.mark.parametrize("schedule", [mpmd.GPipe(3), mpmd.OneFOneB(3), mpmd.ZeroBubbleH1(3)])
def test_a_forward_only_simulation_runs_the_forward_tasks_alone_and_stashes_nothing(schedule):
    """`simulate(schedule, m, forward_only=True)` (an evaluation step) timed the schedule's backward tasks too and
    counted every microbatch as kept for them (GPipe(2), m=8: 27 and (8, 8), as training; a probe). An evaluation
    step is the forward pipeline alone: m + p - 1 forward times with unit costs, and nothing stashed."""
    got = mpmd.simulate(schedule, 8, mpmd.Costs(F=1.0, B=2.0), forward_only=True)
    assert got.step_time == pytest.approx(8 + 3 - 1)
    assert got.peak_activations == (0, 0, 0)
    assert all("F" in label and "B" not in label and "W" not in label for row in got.timeline for _, _, label in row)


def test_costs_split_stages_cuts_each_stage_into_equal_parts_for_a_schedule_of_more_stages():
    """Costs fitted on a 2-stage trace predict a 4-stage interleaved schedule on the same actors once each stage is
    cut into two of half its cost (as benchmarks.schedules did by hand): the per-Run overhead, gaps, routes and
    activation bytes stay, task samples halve. Asked of the simulator without it, the error names the method."""
    from mpmd.schedules.montecarlo import Empirical

    c = mpmd.Costs(F=(1e-3, 2e-3), B=(2e-3, 4e-3), I=(1e-3, 2e-3), W=(1e-3, 2e-3), activation_bytes=(8.0, 0.0), overhead=1e-4,
                   gap=5e-5, empirical=Empirical.of({(1, "B"): [4e-3, 6e-3]}, [5e-5], {}))
    four = c.split_stages(4)
    assert four.F == pytest.approx((5e-4, 5e-4, 1e-3, 1e-3)) and four.B == pytest.approx((1e-3, 1e-3, 2e-3, 2e-3))
    assert four.W == pytest.approx((5e-4, 5e-4, 1e-3, 1e-3)) and four.activation_bytes == (8.0, 8.0, 0.0, 0.0)
    assert four.overhead == c.overhead and four.gap == c.gap and four.empirical.gaps == c.empirical.gaps
    assert four.empirical.task_samples() == {(2, "B"): pytest.approx((2e-3, 3e-3)), (3, "B"): pytest.approx((2e-3, 3e-3))}
    assert c.split_stages(2) == c
    schedule = mpmd.InterleavedOneFOneB(num_stages=4, num_actors=2)
    with pytest.raises(mpmd.ScheduleError, match=r"or costs.split_stages\(4\) to cut each of its 2 stages into 2 of equal cost"):
        mpmd.simulate(schedule, 8, c)
    # each actor holds a half of each old stage (0 and 2, or 1 and 3): 1.5 ms of F and 3 ms of B per microbatch,
    # and 32 Runs of 0.1 ms overhead — busy 39.2 ms of the step on both
    got = mpmd.simulate(schedule, 8, four)
    for bubble in got.bubble_per_actor:
        assert got.step_time * (1 - bubble) == pytest.approx(8 * 4.5e-3 + 32 * 1e-4)
    for bad, said in ((3, "a multiple of the costs' 2 stages, got 3"), (1, "got 1"), (4.0, "got 4.0")):
        with pytest.raises(ValueError, match=said):
            c.split_stages(bad)
    with pytest.raises(ValueError, match="one number for every stage"):
        mpmd.Costs().split_stages(4)


def test_a_phase_fused_into_a_task_run_is_timed_and_drawn_alike_with_no_overlap():
    """`pre+0F0` and `0B0+post` (phases the compiler fuses into task Runs) were timed without `other`
    (Costs.run_time, as fit_costs folds their time into the task's) but drawn with an `other`-long part: spans on
    one actor overlapped, the bubble came out negative, and the step paid `other` only when the fused phase was the
    actor's last Run (8 here; a probe). Timed and drawn alike now, as the Monte Carlo replay times them."""
    from mpmd.schedules.montecarlo import simulate_monte_carlo
    from mpmd.schedules.simulator import simulate_programs
    from transport.program import Label, Program, Run

    prog = Program(actor=0, inputs=[0], outputs=[3], instructions=[
        Run(0, (0,), (1,), Label.parse("pre+0F0")), Run(1, (1,), (2,), Label.parse("0F1")),
        Run(2, (2,), (3,), Label.parse("0B0+post")), Run(3, (3,), (4,), Label.parse("0B1"))])
    costs = mpmd.Costs(F=1, B=1, other=5)
    r = simulate_programs([prog], costs)
    row = r.timeline[0]
    assert all(b[0] >= a[1] for a, b in zip(row, row[1:])), row
    assert r.step_time == 4 and r.bubble == 0.0, (r.step_time, r.bubble)
    assert simulate_monte_carlo([prog], costs, runs=3).step_time == r.step_time


def test_a_pictures_legend_lists_the_task_kinds_it_shows():
    """A ZB-V picture's legend listed "B: backward", a kind its table has none of (a probe)."""
    from mpmd.schedules.draw import svg

    texts = {e.text for e in ET.fromstring(svg(simulate(mpmd.ZeroBubbleV(2), 4))).iter("{http://www.w3.org/2000/svg}text")}
    assert {"F: forward", "I: input grad", "W: weight grad"} <= texts and "B: backward" not in texts, texts
    texts = {e.text for e in ET.fromstring(svg(simulate(mpmd.OneFOneB(2), 4))).iter("{http://www.w3.org/2000/svg}text")}
    assert {"F: forward", "B: backward"} <= texts and "W: weight grad" not in texts, texts
