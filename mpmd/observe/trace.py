"""The trace of a real run: what every actor did, instruction by instruction, on the controller's clock.

    with mesh.trace() as t:
        train_step(params, opt_state, batch)
    print(t.summary())                 # per actor: compute, waiting for data, runtime overhead, idle
    t.to_perfetto("step.json")         # chrome://tracing or ui.perfetto.dev: a track per actor and transfer stream

Actors record their instructions only for traced steps (off by default, free when off). Their clocks are
aligned to the controller's with the offset estimated from ping round trips (the sample with the smallest
round trip). A Run's compute span starts when it was dispatched or when the Run before it ended, whichever is
later (Runs execute one after another), and ends when its result is ready.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

NS = 1e-9


@dataclass(frozen=True)
class RunSpan:
    label: str
    waited_from: float  # the interpreter reached the Run (seconds, controller clock)
    ready: float  # its inputs were all there
    start: float  # it began computing
    end: float  # its result was ready
    arrived: float | None = None  # the last of its inputs that came this step arrived (-inf: none did; None: not reported)

    def could_start(self, prev_end: float) -> float:
        """When it could have started, the Run before it ending at `prev_end`: then, or when its last input
        arrived if later. (Without `arrived`, from an actor that does not report it: when the interpreter saw its
        inputs there, later than the arrival when the interpreter reached the Run late.)"""
        return max(prev_end, self.ready if self.arrived is None else self.arrived)


@dataclass(frozen=True)
class TransferSpan:
    kind: str  # "send" or "recv"
    label: str  # a send's: the Run that made the value
    peer: int
    nbytes: int
    start: float  # send: began (the value may still be computing); recv: posted
    end: float  # send: the bytes left; recv: the value arrived
    tag: int = -1


CPU_SLACK = 1e-3  # seconds: the clocks of the step's window and of the loop's CPU are read apart


@dataclass
class ActorStep:
    """One actor's part of one traced step."""

    actor: int
    step: int
    start: float
    end: float
    runs: list[RunSpan] = field(default_factory=list)
    transfers: list[TransferSpan] = field(default_factory=list)
    cpu: float | None = None  # CPU seconds the actor's event loop used over the step (None: not reported)

    @classmethod
    def from_wire(cls, actor: int, step: int, wire: dict[str, Any], offset_ns: int) -> ActorStep:
        def t(ns: int) -> float:
            return (ns - offset_ns) * NS

        cpu = wire.get("cpu")  # a thread's CPU over the step is at most the step's wall time: anything else is dropped
        ok = (isinstance(cpu, (int, float)) and not isinstance(cpu, bool) and math.isfinite(cpu)
              and 0 <= cpu <= (wire["end"] - wire["start"]) * NS + CPU_SLACK)
        out = cls(actor, step, t(wire["start"]), t(wire["end"]), cpu=float(cpu) if ok else None)
        # When each Run's last input that came this step arrived (0: none did): ints, one per run event, or
        # nothing at all (an actor that does not report them: RunSpan.arrived None).
        arrivals = wire.get("run_arrivals")
        runs = sum(1 for ev in wire["events"] if ev[0] == "run")
        if not (isinstance(arrivals, list) and len(arrivals) == runs
                and all(type(x) is int and x >= 0 for x in arrivals)):  # noqa: E721 (bool is no time)
            arrivals = [None] * runs
        each = iter(arrivals)
        for ev in wire["events"]:
            if ev[0] == "run":
                _, label, waited, ready, started, done = ev
                got = next(each)
                arrived = None if got is None else t(got) if got else -math.inf
                out.runs.append(RunSpan(label, t(waited), t(ready), t(started), t(done), arrived))
            else:
                kind, label, peer, nbytes, s, e, tag = ev
                out.transfers.append(TransferSpan(kind, label, int(peer), int(nbytes), t(s), t(e), int(tag)))
        return out


@dataclass(frozen=True)
class Breakdown:
    """Where one actor's time went in a step window (seconds)."""

    wall: float
    compute: float
    waiting: float  # the next Run's inputs were still being received
    overhead: float  # its inputs were there, but it had not started (interpreter, dispatch)
    idle: float  # before the first and after the last Run (other actors still working)
    other: float = 0.0  # on other traced steps, running or queued behind their Runs (steps dispatched back to back overlap)

    def fraction(self, name: str) -> float:
        return getattr(self, name) / self.wall if self.wall > 0 else 0.0


def _covered(x: float, y: float, spans: Sequence[tuple[float, float]]) -> float:
    """How much of [x, y] the (disjoint) `spans` cover."""
    return sum(max(0.0, min(y, e) - max(x, s)) for s, e in spans if e > x and s < y)


def breakdown(a: ActorStep, window: tuple[float, float], others: Sequence[tuple[float, float]] = (),
              queued_until: float | None = None) -> Breakdown:
    """`a`'s time in the step `window`. Of steps dispatched back to back: `others`, the spans of this actor's Runs
    in later traced steps, and `queued_until`, when its last Run of the earlier ones ended (until then the actor
    was busy with those: the time is `other`, not waiting for data or overhead)."""
    w0, w1 = window
    compute = sum(r.end - r.start for r in a.runs)
    waiting = overhead = 0.0
    queued = max(0.0, min(queued_until, w1) - w0) if queued_until is not None else 0.0
    prev_end = max(a.start, queued_until) if queued_until is not None else a.start
    for r in a.runs:
        gap_start = max(prev_end, w0)
        if r.start > gap_start:
            data_until = min(r.could_start(gap_start), r.start)
            waiting += data_until - gap_start - _covered(gap_start, data_until, others)
            overhead += r.start - data_until - _covered(data_until, r.start, others)
        prev_end = max(prev_end, r.end)
    wall = w1 - w0
    if queued:  # (less this step's own Runs in that span, counted as compute: an actor that ran one of this step's
        # Runs before an earlier step's last one was counted twice, and a row added up to 108-121 %; a probe)
        queued -= _covered(w0, min(queued_until, w1), [(r.start, r.end) for r in a.runs])
    other = queued + _covered(w0 if queued_until is None else max(w0, queued_until), w1, others)
    idle = max(0.0, wall - compute - waiting - overhead - other)
    return Breakdown(wall, compute, waiting, overhead, idle, other)


class Trace:
    """Traced steps of one mesh, in order; each step maps actor -> ActorStep."""

    def __init__(self) -> None:
        self.steps: list[dict[int, ActorStep]] = []
        # Steps dispatched while tracing that left no record: "failed" (or aborted), "recovered" (a lost actor's
        # step, run again by the recovery: also counted among "replayed"), and the recovery's "replayed" steps
        # (not traced as steps: the earlier ones since its snapshot, and the recovered ones).
        self.untraced: dict[str, int] = {}
        self._pending: list[Any] = []
        self._lock = threading.Lock()

    def count(self, kind: str) -> None:
        """One more dispatched step of `kind` (see `untraced`) that is not among `steps`."""
        with self._lock:
            self.untraced[kind] = self.untraced.get(kind, 0) + 1

    def untraced_note(self) -> str:
        """What was dispatched while tracing but is not among the steps ("" when nothing)."""
        said = {"failed": "failed or aborted (their errors surface through their outputs)",
                "recovered": "lost with an actor and recovered", "replayed": "replayed by a recovery (the recovered among them)"}
        parts = [f"{n} step(s) {said.get(k, k)}" for k, n in sorted(self.untraced.items()) if n]
        return f"not traced: {'; '.join(parts)}" if parts else ""

    def expect(self, done: Any) -> None:
        """A traced step was dispatched; `done` is its (concurrent) future."""
        with self._lock:
            self._pending.append(done)

    def wait(self) -> None:
        """Wait for every traced step dispatched so far (errors surface through the steps' outputs)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for f in pending:
            try:
                f.result()
            except Exception:
                pass
        self.steps.sort(key=lambda s: next(iter(s.values())).step if s else 0)

    def add_step(self, step: int, wires: dict[int, dict[str, Any] | None], offsets: dict[int, int]) -> None:
        """An actor-by-actor trace as the actors replied it (their clocks), aligned to the controller's."""
        got = {a: ActorStep.from_wire(a, step, w, offsets.get(a, 0)) for a, w in wires.items() if w}
        with self._lock:
            self.steps.append(got)

    def runs(self, actor: int, step: int = -1) -> list[str]:
        """The labels of the Runs `actor` did in a traced step, in order."""
        return [r.label for r in self._step(step)[actor].runs]

    def stages_with(self, kind: str) -> set[int]:
        """The stages that ran a task of `kind` ("F", "B", "I" or "W"; alone or fused into a Run) in any traced step."""
        return {s for st in self.steps for x in st.values() for r in x.runs for s, k in _tasks_of(r.label) if k == kind}

    def _step(self, step: int) -> dict[int, ActorStep]:
        """Traced step `step` (negative: from the end); an MpmdError naming what there is when there is none."""
        from mpmd.errors import MpmdError

        try:
            step = operator.index(step)  # (numpy integers too)
        except TypeError:
            raise MpmdError(f"trace: a step is an int (its index among the traced steps; -1 the last), got {step!r:.40}") from None
        if not -len(self.steps) <= step < len(self.steps):
            raise MpmdError(f"trace: no traced step {step}: it holds {len(self.steps)} step(s)"
                            + ("; run a step inside `with mesh.trace() as t:`" if not self.steps else ""))
        return self.steps[step]

    def window(self, step: int = -1) -> tuple[float, float]:
        s = self._step(step)
        return min(a.start for a in s.values()), max(a.end for a in s.values())

    def queued_until(self, step: int = -1, by: dict[int, float] | None = None) -> dict[int, float | None]:
        """Per actor of the step, when its last Run of the traced steps before it ended (None: none): until then the
        actor was busy with them (steps dispatched back to back overlap). `by`: per actor, only Runs ending by then
        count (steps that do not depend on each other interleave)."""
        mine = self._step(step)
        at = next(i for i, s in enumerate(self.steps) if s is mine)
        limit = by or {}
        return {a: max((r.end for s in self.steps[:at] if a in s for r in s[a].runs if r.end <= limit.get(a, math.inf)),
                       default=None) for a in mine}

    def breakdown(self, step: int = -1) -> dict[int, Breakdown]:
        w = self.window(step)
        mine = self._step(step)
        at = next(i for i, s in enumerate(self.steps) if s is mine)
        queued = self.queued_until(step)
        return {a: breakdown(x, w, [(r.start, r.end) for s in self.steps[at + 1:] if a in s for r in s[a].runs], queued[a])
                for a, x in sorted(mine.items())}

    def summary(self, step: int = -1) -> str:
        """Per actor: compute, waiting for data, runtime overhead, idle, as ms and shares of the step."""
        note = self.untraced_note()
        if not self.steps:
            return "no traced step" + (f" ({note})" if note else "")
        self._step(step)
        parts = self.breakdown(step)
        overlap = any(b.other > 0 for b in parts.values())
        names = ("compute", "waiting", "overhead", "idle") + (("other",) if overlap else ())
        lines = [f"traced step {step % len(self.steps)}: {(self.window(step)[1] - self.window(step)[0]) * 1e3:.2f} ms"
                 + (" (its window overlaps other traced steps, dispatched back to back: 'other steps' is this actor's time "
                    "on them, running or queued behind their Runs)" if overlap else ""),
                 "actor   compute          waiting for data  runtime overhead  idle" + ("              other steps" if overlap else "")]
        for a, b in parts.items():
            cells = [f"{getattr(b, n) * 1e3:8.2f} ms {b.fraction(n) * 100:4.0f}%" for n in names]
            lines.append(f"{a:5d}   " + "  ".join(cells))
        if note:
            lines.append(f"({len(self.steps)} traced step(s); {note})")
        return "\n".join(lines)

    def events(self) -> Iterator[dict[str, Any]]:
        if not self.steps:
            return
        t0 = min(a.start for s in self.steps for a in s.values())

        def us(t: float) -> float:
            return (t - t0) * 1e6

        actors = sorted({a for s in self.steps for a in s})
        for a in actors:
            yield {"ph": "M", "name": "process_name", "pid": a, "args": {"name": f"actor {a}"}}
            yield {"ph": "M", "name": "thread_name", "pid": a, "tid": 0, "args": {"name": "compute"}}
        # Runs follow one another on an actor: complete events on one track. Steps, waits and transfers overlap (every
        # receive is posted as its step starts; steps dispatched back to back overlap): complete events on one track
        # must nest, and Perfetto dropped the others (thousands of receives in a long trace; a probe), so they are
        # async events, which Perfetto lays out in rows of their own.
        ids = itertools.count(1)

        def span(a: int, cat: str, name: str, start: float, end: float, args: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
            k = next(ids)
            yield {"ph": "b", "cat": cat, "name": name, "id": k, "pid": a, "tid": 0, "ts": us(start), **({"args": args} if args else {})}
            yield {"ph": "e", "cat": cat, "name": name, "id": k, "pid": a, "tid": 0, "ts": max(us(end), us(start))}

        for s in self.steps:
            for a, x in s.items():
                yield from span(a, "step", f"step {x.step}", x.start, x.end)
                for r in x.runs:
                    yield {"ph": "X", "name": r.label, "pid": a, "tid": 0, "ts": us(r.start), "dur": max(us(r.end) - us(r.start), 0.0),
                           "cat": "run", "args": {"waited_ms": (r.ready - r.waited_from) * 1e3}}
                    until = r.ready if r.arrived is None else min(r.ready, max(r.waited_from, r.arrived))  # (for data)
                    if until > r.waited_from:
                        yield from span(a, "wait", f"wait {r.label}", r.waited_from, until)
                for t in x.transfers:
                    yield from span(a, t.kind, f"{t.kind} {t.label} {'->' if t.kind == 'send' else '<-'} a{t.peer}", t.start,
                                    t.end, {"bytes": t.nbytes, "peer": t.peer})

    def to_perfetto(self, path: str) -> None:
        """Write Chrome/Perfetto trace JSON (one process per actor; tracks for compute, waits, sends, receives)."""
        with open(path, "w") as f:
            json.dump({"traceEvents": list(self.events()), "displayTimeUnit": "ms"}, f)


# ---- what a trace says about costs, for the simulator ------------------------------------------------------
def _tasks_of(label: str) -> list[tuple[int, str]]:
    out = []
    for part in label.split("+"):
        if part and part[0].isdigit():
            i = 0
            while part[i].isdigit():
                i += 1
            out.append((int(part[:i]), part[i]))
    return out


def _check_fit_args(trace: Any, num_stages: int, step: Any, cores: int | None) -> tuple[int, list[tuple[Trace, int]]]:
    """MpmdError naming what `fit_costs` cannot fit: no traced step, a step out of range, a trace whose Runs
    compute other stages than `num_stages`, or cores not a positive int; else (num_stages, the (trace, step
    index) pairs to fit: `step` of each trace given, or each of the steps `step` lists, or every step with "all")."""
    from mpmd.errors import MpmdError
    from mpmd.schedules.validation import is_count

    traces = list(trace) if isinstance(trace, (list, tuple)) else [trace]
    if not traces or not all(isinstance(t, Trace) for t in traces):  # (None met "has no attribute 'steps'"; a probe)
        got = type(trace).__name__ if not traces or not isinstance(trace, (list, tuple)) else \
            f"a {type(trace).__name__} holding {', '.join(sorted({type(t).__name__ for t in traces}))}"
        raise MpmdError(f"fit_costs: trace must be the Trace of `with mesh.trace() as t:`, or a non-empty list of such "
                        f"Traces (of the same step), got {got}")
    if not is_count(num_stages) or num_stages < 1:
        raise MpmdError(f"fit_costs: num_stages must be a positive int (the traced schedule's num_stages), got {num_stages!r:.40}")
    if cores is not None and (not is_count(cores) or cores < 1):
        raise MpmdError(f"fit_costs: cores must be a positive int (the cores the actors shared) or None, got {cores!r:.40}")
    if getattr(step, "ndim", 0) == 1:  # (a 1-d array of indices, e.g. np.arange(3))
        step = step.tolist()
    many = isinstance(step, (list, tuple, range))
    if many and (not step or len(step) > MAX_FIT_STEPS) or not many and not (isinstance(step, str) and step == "all" or is_count(step)):
        raise MpmdError(f"fit_costs: step must be a step's index (-1: the last), a non-empty list of up to {MAX_FIT_STEPS} "
                        f"indices, or \"all\", got {step!r:.40}")
    units: list[tuple[Trace, int]] = []
    wheres: list[str] = []
    for k, t in enumerate(traces):
        n = len(t.steps)
        where = f"trace {k} of {len(traces)}" if len(traces) > 1 else "the trace"
        if n == 0:
            note = t.untraced_note() if hasattr(t, "untraced_note") else ""
            raise MpmdError(f"fit_costs: {where} holds no step: " + (
                f"{note} — fetch a step's outputs to see its error, and trace steps that finish" if note else
                "call the distributed step inside `with mesh.trace() as t:` (let it finish, e.g. fetch its outputs) and "
                "pass that trace"))
        for i in (step if many else range(n) if isinstance(step, str) else [step]):
            if not is_count(i):
                raise MpmdError(f"fit_costs: step lists {i!r:.40}, not a step's index: list ints (-1: the last)")
            if not -n <= i < n:
                which = "0 or -1" if n == 1 else f"0..{n - 1}, or -{n}..-1 from the end (-1: the last)"
                raise MpmdError(f"fit_costs: step={i!r:.40} but {where} holds {n} step{'s' if n > 1 else ''}: pass {which}")
            units.append((t, int(i) % n))
            wheres.append(f"step {int(i) % n} of {where}")
    if len(units) > MAX_FIT_STEPS:
        raise MpmdError(f"fit_costs: {len(units)} steps to fit, more than {MAX_FIT_STEPS}: pass fewer traces or steps")
    if len({id(t.steps[i]) for t, i in units}) < len(units):  # (its Runs would count twice, its gaps and hops too, and
        # the overhead's standard error shrink: [t] * 4 kept an overhead that t alone does not; a review)
        raise MpmdError("fit_costs: a traced step is listed twice (the same Trace twice, an index and its negative "
                        "twin in step=, or two Traces holding the same step): list each step once")
    for (t, i), where in zip(units, wheres):
        ran = sorted({(s, r.label) for x in t.steps[i].values() for r in x.runs for s, _ in _tasks_of(r.label)})
        top, label = ran[-1] if ran else (num_stages - 1, "")
        if top >= num_stages:
            raise MpmdError(f"fit_costs: the traced step runs stage {top} (Run {label!r}) but num_stages={num_stages}: "
                            f"pass the traced schedule's num_stages (at least {top + 1}; {where})")
        if top + 1 < num_stages:
            raise MpmdError(f"fit_costs: num_stages={num_stages} but the traced step runs {top + 1} stages: pass "
                            f"num_stages={top + 1} (a stage it never ran has no costs to fit; {where})")
    first = _run_labels(units[0][0].steps[units[0][1]])
    for (t, i), where in zip(units, wheres):
        ran = _run_labels(t.steps[i])
        if sorted(ran) != sorted(first):
            raise MpmdError(f"fit_costs: {where} holds records of actors {sorted(ran)} where {wheres[0]} holds "
                            f"{sorted(first)}: an actor's record is missing, or the steps ran on different meshes; pool only "
                            "whole steps of the same compiled step on the same mesh")
        for a in sorted(first):  # (steps of another Program on the same actors: a review)
            if ran[a] != first[a]:
                k = next((k for k, (x, y) in enumerate(zip(ran[a], first[a])) if x != y), min(len(ran[a]), len(first[a])))
                said = [r[k] if k < len(r) else "none" for r in (ran[a], first[a])]
                raise MpmdError(f"fit_costs: {where} ran other Runs on actor {a} than {wheres[0]} ({len(ran[a])} against "
                                f"{len(first[a])} Runs; its Run {k} {said[0]}, the other's {said[1]}): the steps are of "
                                "different compiled steps (another schedule, microbatch count or function); pool only steps "
                                "of the same compiled step")
    return int(num_stages), units


def _run_labels(record: dict) -> dict:
    """Per actor of a traced step, its Runs' labels in order: what a compiled step executes, the same each step."""
    return {a: [r.label for r in x.runs] for a, x in record.items()}


MAX_FIT_STEPS = 1000  # traced steps one fit pools at most


def fit_costs(trace: Trace | Sequence[Trace], num_stages: int, step: int | Sequence[int] | str = -1, per_run: bool = True,
              cores: int | None = None, own_core: bool = False) -> Any:
    """`mpmd.Costs` fitted to a traced step: per stage, the F/B/I/W times that best explain every Run's measured
    duration (least squares over all Runs of the step: a Run lasts the sum of its tasks plus, with `per_run`, one
    `overhead` that every Run pays whatever it computes — fitted only where the step has Runs of different task
    counts, e.g. 1F1B's fused B+F beside its single warm-up Fs, and where it stands 2 standard errors clear of the
    Runs' scatter, else 0 and folded into the task times), the cost of Runs that do no task (`other`), the runtime's
    `gap` before each Run (mean time from could-start to start), the step's `lead` and `tail` (idle before the first
    Run anywhere and after the last), and a transfer latency and bandwidth from the transfers. `cores`: the actors
    shared that many cores (fewer than actors): each Run's duration is first divided by how much the Runs beside it
    slowed it (mpmd.schedules.sharing), and the costs say `cores` so that the simulators slow them down again.
    `own_core`: each actor ran pinned to a core of its own (CPU), shared with its event loop alone. With either, and
    each actor's loop CPU reported, the costs' `runtime_cpu` is that CPU per Run, Send and Recv, and the Runs' own
    times are read without the loops' share. Backward kinds the traced schedule did not run are estimated from those
    it did: B as I + W, I and W as half of B each.

    Several steps fit together: `step` a list of indices (or "all": every traced step), or `trace` a list of
    Traces of the same step on the same mesh (`step` then picks in each). Their Runs, gaps, hops and samples are
    pooled, their leads and tails averaged: one traced step of this VM moves 10-30 % from the next, and a fit to
    one step predicts the next no better than that. Of three or more, a step longer than SLOW_STEP x their median
    is left out (the machine slowed all of it)."""
    import numpy as np

    from mpmd.schedules.montecarlo import Empirical
    from mpmd.schedules.simulator import Costs

    num_stages, units = _check_fit_args(trace, num_stages, step, cores)
    units = _without_slow_steps(units)
    for flag, v in (("per_run", per_run), ("own_core", own_core)):
        if not isinstance(v, (bool, np.bool_)):  # ("yes" was taken as true; a probe)
            from mpmd.errors import MpmdError

            raise MpmdError(f"fit_costs: {flag} must be True or False, got {v!r:.40}")
    kinds = ("F", "B", "I", "W")
    col = {(s, k): i for i, (s, k) in enumerate((s, k) for s in range(num_stages) for k in kinds)}
    rows, rhs, other = [], [], []
    fitted = [(t.steps[i], *_own_durations(t.steps[i], _shared(cores, t.steps[i]), t.window(i), own_core)) for t, i in units]
    for steps, own, _ in fitted:
        for a, x in steps.items():
            for r in x.runs:
                tasks = _tasks_of(r.label)
                if not tasks:
                    other.append(own[id(r)])
                    continue
                row = np.zeros(len(col))
                for t in tasks:
                    row[col[t]] += 1
                rows.append(row)
                rhs.append(own[id(r)])
    sol = np.zeros(len(col))
    overhead = 0.0
    if rows:
        a_mat, b_vec = np.array(rows), np.array(rhs)
        used = a_mat.sum(axis=0) > 0
        a_used = a_mat[:, used]
        with_run = np.hstack([a_used, np.ones((len(rows), 1))])
        fit = None
        if per_run and np.linalg.matrix_rank(with_run) > np.linalg.matrix_rank(a_used):
            fit = _robust(lambda a, b: np.linalg.lstsq(a, b, rcond=None)[0], with_run, b_vec)
            if fit[-1] < 0 or (fit[:-1] < 0).any() or not _significant(with_run, b_vec, fit):  # not a per-Run
                fit = None  # constant this trace can tell apart
        if fit is not None:
            sol[used], overhead = fit[:-1], float(fit[-1])
        else:  # (non-negative: a least-squares cost below 0, clipped to 0 after, left the others fitted for it and
            # the Runs' sums short; a probe's 16-wide model had B = 0 on both stages though its backward Runs took 0.12-0.15 ms)
            from scipy.optimize import nnls  # (a dependency of jax)

            sol[used] = _robust(lambda a, b: nnls(a, b)[0], a_used, b_vec)
    sol = np.maximum(sol, 0.0)
    if rows:
        _split_inseparable(sol, np.array(rows), col, num_stages)
        _estimate_unrun(sol, np.array(rows), col, num_stages)
    per = {k: tuple(float(sol[col[(s, k)]]) for s in range(num_stages)) for k in kinds}
    hops: list[tuple[tuple[int, int], float, int, float]] = []  # (route, time, bytes, the unit's longest Run)
    all_gaps, gap_longest = [], []  # (each gap, and its step's longest Run)
    leads, tails, factors = [], [], []
    task_samples: dict[tuple[int, str], list[float]] = {}
    for (t, i), (steps, own, _) in zip(units, fitted):
        longest = max(own.values(), default=0.0)
        # The gap: how long after it could have started (inputs there, the actor free) a Run started.
        # (From the arrival of its last input, not from when the interpreter saw it there: reaching a Run late, after
        # posting the sends before it, is the runtime's time too. Counted from when it saw them, a 1F1B step's gaps
        # were a fifth of what they were, and a replay of the step with its own Runs, gaps and hops ended 2 % early.)
        all_gaps += [g for x in steps.values() for a, b in zip(x.runs, x.runs[1:]) if (g := b.start - b.could_start(a.end)) >= 0]
        gap_longest += [longest] * (len(all_gaps) - len(gap_longest))
        hops += [((src, dst), d, nbytes, longest) for (src, dst, _), (d, nbytes) in hop_times(steps).items()]  # (see hop_times)
        leads.append(_lead(t, i, steps))
        runs = [r for x in steps.values() for r in x.runs]
        tails.append(max(0.0, t.window(i)[1] - max(r.end for r in runs)) if runs else 0.0)
        # The distributions the Monte Carlo simulator draws from: every single-task Run's duration, every gap.
        for x in steps.values():
            for r in x.runs:
                tasks = _tasks_of(r.label)
                if len(tasks) == 1:
                    task_samples.setdefault(tasks[0], []).append(own[id(r)])
        factors += _run_factors(steps, own, per, overhead)
    gaps = [g for g, stalled in zip(all_gaps, _stalls(all_gaps, gap_longest)) if not stalled]
    gap = float(np.mean(gaps)) if gaps else 0.0  # the mean: the simulator adds it to every Run, the sum must match
    # The simulators charge a `gap` before every Run, the first one too: the lead is what is left of the wait after it.
    lead = max(0.0, float(np.mean(leads)) - gap)
    first = _robust_residuals(_by_route(hops))  # (stalls found on each route's residuals from a robust line; fitted again without them)
    at = {pair: iter(_stalls(res, [w for q, _, _, w in hops if q == pair])) for pair, res in first.items()}
    hops = [h for h in hops if not next(at[h[0]])]
    routes, residuals = _fit_routes(_by_route(hops))
    empirical = Empirical.of(task_samples, gaps, residuals, factors)
    small = [(d, n) for _, d, n, _ in hops if n <= 1 << 16]
    big = [(d, n) for _, d, n, _ in hops if n > 1 << 16]
    # Means, not medians: a few slow transfers on the critical path cost the step what they cost.
    latency = float(np.mean([d for d, _ in small])) if small else 0.0
    slow = [(d - latency, n) for d, n in big if d > latency]
    bandwidth = sum(n for _, n in slow) / sum(d for d, _ in slow) if slow else float("inf")
    return Costs(F=per["F"], B=per["B"], I=per["I"], W=per["W"], other=max(0.0, float(np.median(other)) - overhead) if other else 0.0,
                 latency=max(latency, 0.0), bandwidth=bandwidth, gap=gap, overhead=overhead, lead=lead, tail=float(np.mean(tails)),
                 routes=routes, empirical=empirical, cores=_shared(cores, fitted[0][0]),
                 runtime_cpu=_mean_rate(fitted))


SLOW_STEP = 1.25  # a step this many times the median of the steps pooled with it is left out of the fit


def _without_slow_steps(units: list[tuple[Trace, int]]) -> list[tuple[Trace, int]]:
    """The (trace, step) units without those whose step took over SLOW_STEP x the median step, where there are three
    or more. A step the machine slowed throughout (another process, a page-cache flush) is not the pipeline's:
    pooled with two others, one 1F1B step's fit predicted the next steps at 1.18x, where the first alone gave 0.96x."""
    import statistics

    if len(units) < 3:
        return units
    # (each step's own Runs, first start to last end: a step dispatched behind others has a window that opens at its
    # dispatch and grows with the queue before it, and 5 of 8 such steps were left out; a review)
    spans = [max((r.end for x in t.steps[i].values() for r in x.runs), default=0.0)
             - min((r.start for x in t.steps[i].values() for r in x.runs), default=0.0) for t, i in units]
    mid = statistics.median(spans)
    slow = [f"{d * 1e3:.1f} ms" for d in spans if d > SLOW_STEP * mid]
    if slow:
        import logging

        logging.getLogger(__name__).info("fit_costs: %d of %d steps left out, slower than %.2fx their median %.1f ms: %s",
                                         len(slow), len(spans), SLOW_STEP, mid * 1e3, ", ".join(slow))
    return [u for u, d in zip(units, spans) if d <= SLOW_STEP * mid]


STALL_SPREAD = 20.0  # robust standard deviations past its kind's median a stalled gap or hop lies at least


def _stalls(xs: list[float], longest: list[float]) -> list[bool]:
    """Which of `xs` (gaps, or hops' residuals from their route's line) are stalls: longer than the longest Run of
    their step (`longest`, each its own) and past STALL_SPREAD robust standard deviations (1.4826 x the median
    absolute deviation) of their kind. An actor or the machine stopped, not the runtime's jitter: one stall of
    150 ms delayed three hops in flight at once, and drawn on their own, one replay in three met one (a ZB-V
    step predicted 2.2x its held-out steps; the 1-6 ms tails of this VM's hops, 10-70 deviations out, stay)."""
    import numpy as np

    if len(xs) < 3:
        return [False] * len(xs)
    x = np.asarray(xs, float)
    cut = float(np.median(x)) + STALL_SPREAD * _robust_sd(x)
    return [bool(v > w and v > cut) for v, w in zip(x, longest)]


def _by_route(hops: list[tuple[tuple[int, int], float, int, float]]) -> dict[tuple[int, int], list[tuple[float, int]]]:
    """Per (sender, receiver), its hops' (time, bytes) in order."""
    out: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for pair, d, nbytes, _ in hops:
        out.setdefault(pair, []).append((d, nbytes))
    return out


def _robust_sd(x: Any) -> float:
    """A robust standard deviation: 1.4826 x the median absolute deviation from the median."""
    import numpy as np

    x = np.asarray(x, float)
    return 1.4826 * float(np.median(np.abs(x - np.median(x))))


def _mean_rate(fitted: list[tuple[dict[int, ActorStep], Any, float]]) -> float:
    """The runtime's CPU per instruction over the pooled steps that reported it, weighted by their instructions (a
    step where an actor's CPU went unreported reads 0 and pulled the mean down; a review)."""
    got = [(rate, sum(len(x.runs) + len(x.transfers) for x in steps.values())) for steps, _, rate in fitted if rate > 0]
    total = sum(n for _, n in got)
    return sum(rate * n for rate, n in got) / total if total else 0.0


def _shared(cores: int | None, steps: dict[int, ActorStep]) -> int | None:
    """The cores the actors of a traced step shared: `cores` when fewer than its actors, else None (a core each:
    nothing to undo)."""
    return cores if cores is not None and cores < len(steps) else None


def _lead(trace: Trace, step: int, steps: dict[int, ActorStep]) -> float:
    """From the step's start until the first Run anywhere starts (requests and inputs arriving), the gap before
    it included. An actor still busy with earlier traced steps (dispatched back to back) could start only when it
    was done: the lead counts from then (it took in their queue: 30 ms for the 8th of 8 steps of 7 ms; a probe)."""
    # (the last of their Runs ending before this step's first: steps that do not depend on each other interleave, and
    # one ending after that left no lead at all; a review)
    firsts = {a: x.runs[0].start for a, x in steps.items() if x.runs}
    if not firsts:
        return 0.0
    w0, _ = trace.window(step)
    free = trace.queued_until(step, by=firsts)
    return max(0.0, min(first - max(w0, free[a] or w0) for a, first in firsts.items()))


def hop_times(steps: dict[int, ActorStep]) -> dict[tuple[int, int, int], tuple[float, int]]:
    """Each transfer of a traced step, by (sender, receiver, tag): from the end of the Run that made the value on
    the sender (the send's own start is later when the value had to be seen computed first) until its arrival,
    and its bytes. Transfers whose send or making Run the trace lacks are left out."""
    sends = {(a, t.peer, t.tag): t for a, x in steps.items() for t in x.transfers if t.kind == "send"}
    made = {(a, r.label): r.end for a, x in steps.items() for r in x.runs}
    out = {}
    for a, x in steps.items():
        for t in x.transfers:
            s = sends.get((t.peer, a, t.tag)) if t.kind == "recv" else None
            if s is not None and (t.peer, s.label) in made:
                out[(t.peer, a, t.tag)] = (t.end - made[(t.peer, s.label)], t.nbytes)
    return out


def _run_factors(steps: dict[int, ActorStep], own: dict[int, float], per: dict[str, tuple[float, ...]], overhead: float) -> list[float]:
    """The spread the Monte Carlo simulator draws fused Runs from: each Run's own duration over its fitted one,
    of the Runs doing several tasks and nothing else (those doing one, where none does several), without those
    past 3x the median either way. A Run that also does a step phase (``pre+0F0``) lasts its phase too, and one
    whose tasks fitted near 0 gives any ratio: as factors they made fused Runs 1.4-2x longer on average (a
    review)."""
    import statistics

    pure: list[tuple[float, int]] = []
    for x in steps.values():
        for r in x.runs:
            tasks = _tasks_of(r.label)
            want = sum(per[k][s] for s, k in tasks) + overhead
            if tasks and len(tasks) == len(r.label.split("+")) and want > 0:
                pure.append((own[id(r)] / want, len(tasks)))
    got = [f for f, n in pure if n > 1] or [f for f, _ in pure]
    if not got:
        return []
    mid = statistics.median(got)
    return [f for f in got if mid / 3 <= f <= 3 * mid]


def _significant(a_mat: Any, b_vec: Any, x: Any) -> bool:
    """Is the last coefficient of the least-squares fit `x` (the per-Run overhead) at least 2 standard errors
    above 0, the Runs' scatter taken robustly (1.4826 x the median absolute residual)? On 4 actors sharing 2
    cores, where each Run's own time is read through how the Runs beside it shared the cores, one traced step's
    overhead came out anywhere from 0 to 3 ms, and 2.2 ms pooled over three: rescaled to 8 stages, every Run paid
    it, and the interleaved schedules were predicted 1.4-1.7x their measured step."""
    import numpy as np

    r = b_vec - a_mat @ x
    n, rank = len(r), int(np.linalg.matrix_rank(a_mat))
    if n - rank < 2:  # (no scatter to judge it by)
        return False
    sigma = _robust_sd(r) * (n / (n - rank)) ** 0.5
    var = float(np.linalg.pinv(a_mat.T @ a_mat)[-1, -1])  # (pinv: two tasks that only ever ran together leave the
    # design short of full rank, the overhead still told apart)
    return bool(x[-1] >= 2 * sigma * max(var, 0.0) ** 0.5)


def _robust(solve: Any, a_mat: Any, b_vec: Any, rounds: int = 2) -> Any:
    """`solve(a, b)` refitted without the Runs it explains worst: those whose residual is past 3 robust standard
    deviations (1.4826 x the median absolute deviation) of the rest, while the Runs kept still tell every cost
    apart. A step's first Run (0.65 ms where its like took 0.15) pulled a stage's F up and its B to 0 (a probe)."""
    import numpy as np

    keep = np.ones(len(b_vec), bool)
    x = solve(a_mat, b_vec)
    rank = np.linalg.matrix_rank(a_mat)
    for _ in range(rounds):
        r = b_vec - a_mat @ x
        dev = np.abs(r - np.median(r[keep]))
        mad = _robust_sd(r[keep])
        out = keep & (dev > 3 * mad) if mad > 0 else np.zeros_like(keep)
        if not out.any() or np.linalg.matrix_rank(a_mat[keep & ~out]) < rank:
            break
        keep &= ~out
        x = solve(a_mat[keep], b_vec[keep])
    return x


_DEFAULT_RATIO = {("F", "B"): 2.0, ("F", "I"): 1.0, ("F", "W"): 1.0, ("B", "I"): 0.5, ("B", "W"): 0.5, ("I", "W"): 1.0}


def _estimate_unrun(sol: Any, a_mat: Any, col: dict[tuple[int, str], int], num_stages: int) -> None:
    """In place: the backward kinds a stage's traced schedule did not run, from the ones it did — a whole B as its
    I + W (a zero-bubble trace predicting 1F1B), and a split backward's I and W as half of B each (a 1F1B trace
    predicting a zero-bubble schedule; a stage without an I task, the first, runs I + W in its W, that is B). Left
    at 0 they read as free: ZeroBubbleH1 predicted from a 1F1B trace came out at half its measured time (a
    probe)."""
    def ran(s: int, k: str) -> bool:
        return bool(a_mat[:, col[(s, k)]].any())

    for s in range(num_stages):
        b, i, w = col[(s, "B")], col[(s, "I")], col[(s, "W")]
        if not ran(s, "B") and (ran(s, "I") or ran(s, "W")):
            sol[b] = sol[i] + sol[w]
        elif ran(s, "B") and not ran(s, "I") and not ran(s, "W"):
            sol[i] = sol[w] = sol[b] / 2


def _split_inseparable(sol: Any, a_mat: Any, col: dict[tuple[int, str], int], num_stages: int) -> None:
    """In place: two tasks of a stage that only ever ran in the same Runs (the last stage's F and B, or F and I
    under a split backward: fused by the schedule that was traced) have their sum fitted, not each: least
    squares may split it anyhow, or put all of it on one (an F of 0 would let another schedule's B start before
    the stage's forwards are done). Split the sum as the other stages split those two kinds (the median of
    their ratios), else by the unit model's ratio (F:B 1:2, F:I 1:1, ...)."""
    import numpy as np

    for (k1, k2), default in _DEFAULT_RATIO.items():
        together, ratios = [], []
        for s in range(num_stages):
            a, b = a_mat[:, col[(s, k1)]], a_mat[:, col[(s, k2)]]
            if not a.any() or not b.any():
                continue
            if np.array_equal(a, b):
                together.append(s)
            elif sol[col[(s, k1)]] > 0:
                ratios.append(sol[col[(s, k2)]] / sol[col[(s, k1)]])
        r = float(np.median(ratios)) if ratios else default
        for s in together:
            total = sol[col[(s, k1)]] + sol[col[(s, k2)]]
            sol[col[(s, k1)]], sol[col[(s, k2)]] = total / (1 + r), total * r / (1 + r)


def _own_durations(steps: dict[int, ActorStep], cores: int | None, window: tuple[float, float],
                   own_core: bool = False) -> tuple[dict[int, float], float]:
    """Each Run's duration (by id) as on a core of its own (`cores` shared by the actors; None: as measured),
    and the CPU seconds the runtime spent per instruction (0.0 unless the actors share cores or each has one of
    its own (`own_core`), and each reported its event loop's CPU): the actors' loops' CPU over the step's Runs,
    Sends and Recvs. That CPU loads the cores the Runs use (mpmd.schedules.sharing), so the Runs' own times
    are read with it: on shared cores as that many more things running, on an actor's own core as its Runs
    running at 1 / (1 + that CPU per instruction x its instructions / the step), as the simulators charge it."""
    runs = [(a, r) for a, x in steps.items() for r in x.runs]
    instructions = sum(len(x.runs) + len(x.transfers) for x in steps.values())
    span = window[1] - window[0]
    reported = all(x.cpu is not None for x in steps.values()) and instructions > 0 and span > 0
    # the actors' mean CPU per instruction, as the simulators charge it (runtime_cpu x an actor's instructions)
    rate = sum(x.cpu for x in steps.values()) / instructions if reported and (cores is not None or own_core) else 0.0
    if cores is None:
        share = {a: 1.0 + rate * (len(x.runs) + len(x.transfers)) / span for a, x in steps.items()} if rate else {}
        return {id(r): (r.end - r.start) / share.get(a, 1.0) for a, r in runs}, rate
    from mpmd.schedules.sharing import own_times

    own = own_times([(a, r.start, r.end) for a, r in runs], cores, rate * instructions / span if rate else 0.0)
    return {id(r): w for (_, r), w in zip(runs, own)}, rate


def _robust_residuals(per_route: dict[tuple[int, int], list[tuple[float, int]]]) -> dict[tuple[int, int], list[float]]:
    """Per route, each hop's time minus a robust line's (Theil-Sen: the median of the slopes between hops of
    different bytes, the median intercept; the median alone where all hops carry the same bytes), for finding
    stalls: a stall on a route's largest hop pulled a least-squares line to itself, even one refitted without
    its worst residuals, and its 103 ms residual stayed in (a review)."""
    import numpy as np
    from scipy.stats import theilslopes  # (a dependency of jax)

    out = {}
    for pair, hops in per_route.items():
        d = np.array([h[0] for h in hops])
        n = np.array([float(h[1]) for h in hops])
        pick = np.linspace(0, len(d) - 1, min(len(d), 400)).astype(int)  # (at most 80,000 pairs)
        slope = float(theilslopes(d[pick], n[pick]).slope) if len(set(n[pick].tolist())) > 1 else 0.0
        out[pair] = [float(v) for v in d - slope * n - np.median(d - slope * n)]
    return out


def _fit_routes(per_route: dict[tuple[int, int], list[tuple[float, int]]]) -> tuple[tuple, dict[tuple[int, int], list[float]]]:
    """Per (sender, receiver): hop time = latency + bytes / bandwidth by least squares over its hops (latency
    alone when all hops carry the same bytes), and each hop's residual from that line."""
    import numpy as np

    routes, residuals = [], {}
    for pair, hops in sorted(per_route.items()):
        d = np.array([h[0] for h in hops])
        n = np.array([float(h[1]) for h in hops])
        if len(set(n.tolist())) > 1:
            lat, inv_bw = np.linalg.lstsq(np.stack([np.ones_like(n), n], axis=1), d, rcond=None)[0]
            if inv_bw <= 0:  # bytes explain nothing here: a pure latency
                lat, inv_bw = float(d.mean()), 0.0
            if lat < 0:
                lat, inv_bw = 0.0, float((d * n).sum() / (n * n).sum())
        else:
            lat, inv_bw = float(d.mean()), 0.0
        lat = max(float(lat), 0.0)  # (clocks of two hosts may disagree)
        bandwidth = 1.0 / inv_bw if inv_bw > 0 else float("inf")
        routes.append((pair, (lat, bandwidth)))
        residuals[pair] = [float(x) for x in d - (lat + n * inv_bw)]
    return tuple(routes), residuals


def measured_bubbles(trace: Trace, step: int = -1) -> dict[int, float]:
    """Per actor, the fraction of the step window it was not computing, its time on other traced steps left out
    (running or queued behind their Runs, when steps were dispatched back to back: counted as bubble, 0.91 of a
    step that idled little; a probe)."""
    return {a: 1.0 - b.compute / (b.wall - b.other) if b.wall - b.other > 0 else 0.0 for a, b in trace.breakdown(step).items()}


def timeline(trace: Trace, step: int = -1) -> list[list[tuple[float, float, str]]]:
    """Per actor, its Runs as (start, end, label) from the step's start (a fused Run split evenly)."""
    w0, _ = trace.window(step)
    out = []
    for a in sorted(trace.steps[step]):
        spans = []
        for r in trace.steps[step][a].runs:
            parts = [p for p in r.label.split("+")] or [r.label]
            d = (r.end - r.start) / len(parts)
            for i, p in enumerate(parts):
                spans.append((r.start - w0 + i * d, r.start - w0 + (i + 1) * d, p))
        out.append(spans)
    return out


def as_sim_result(trace: Trace, name: str = "measured", step: int = -1) -> Any:
    """A traced step in the simulator's result form (for pictures and comparisons): seconds from its start. Its
    `peak_activations` is empty: a trace does not record what each actor held (zeros read as measured ones)."""
    from mpmd.schedules.simulator import SimResult

    w0, w1 = trace.window(step)
    bubbles = measured_bubbles(trace, step)
    return SimResult(w1 - w0, tuple(bubbles[a] for a in sorted(bubbles)), (), tuple(map(tuple, timeline(trace, step))), name=name)


async def measure_clock_offsets(conns: list[Any], pings: int = 8) -> dict[int, int]:
    """Per actor: its monotonic clock minus the controller's (ns), from the ping with the smallest round trip.
    `conns` are the mesh's actor connections (anything with an awaitable ``request("ping")``)."""
    import asyncio
    import time

    async def one(c: Any) -> int:
        best = None
        for _ in range(pings):
            t0 = time.monotonic_ns()
            msg = await c.request("ping")
            t1 = time.monotonic_ns()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, msg.header["clock"] - (t0 + t1) // 2)
        return best[1]

    got = await asyncio.gather(*(one(c) for c in conns))
    return dict(enumerate(got))


class TraceContext:
    """`with mesh.trace() as t:` — steps dispatched inside are traced (those dispatched before end first); leaving waits until they are done. `mesh` is
    the `RemoteMesh` (its `active_trace` is what the step reads, its `measure_clock_offsets` aligns the clocks).
    From a coroutine, `async with mesh.trace() as t:` does those waits off the caller's event loop."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.trace = Trace()

    def __enter__(self) -> Trace:
        from mpmd.runtime.controller import blocking

        with blocking("entering mesh.trace()"):
            return self._enter()

    def _enter(self) -> Trace:
        from mpmd.errors import MpmdError

        with _CLAIMING:  # (claimed before the wait: two tasks entering at once both traced, each clearing the other's)
            if self.mesh.active_trace is not None or getattr(self.mesh, "trace_claimed", None) is not None:
                raise MpmdError("this mesh is already tracing; nest no mesh.trace() blocks")
            self.mesh.trace_claimed = self
        try:
            # Steps dispatched before the block end first: the actors' time on them read as the traced step "waiting
            # for data" (86 of a 94 ms window, behind 6 untraced steps in flight; a probe).
            wait = getattr(self.mesh, "wait_steps_in_flight", None)
            if wait is not None:
                wait()
            self.mesh.measure_clock_offsets()
            self.mesh.active_trace = self.trace
        finally:
            self.mesh.trace_claimed = None
        return self.trace

    def _leave(self) -> None:
        with _CLAIMING:
            if self.mesh.active_trace is self.trace:  # (only its own)
                self.mesh.active_trace = None

    def __exit__(self, *exc: object) -> None:
        from mpmd.runtime.controller import blocking

        self._leave()
        with blocking("leaving mesh.trace()"):
            self.trace.wait()

    async def __aenter__(self) -> Trace:
        """`async with mesh.trace() as t:` — the waits for steps in flight and the clock measurement in a worker
        thread: `with` held the caller's loop 5.6 s behind three slow steps, silently (a probe)."""
        return await entered_off_loop(self._enter, self._leave)

    async def __aexit__(self, *exc: object) -> None:
        import asyncio

        self._leave()
        await asyncio.to_thread(self.trace.wait)


_CLAIMING = threading.Lock()


async def entered_off_loop(enter: Any, undo: Any) -> Any:
    """`enter()` in a worker thread, awaited; when the await is cancelled (a timeout) while it runs on, `undo()` once it
    has entered: the block the caller left never exits (a cancelled `async with mesh.trace()` left the mesh tracing
    for good, every later step recorded into a trace nobody read: a review)."""
    import asyncio

    task = asyncio.ensure_future(asyncio.to_thread(enter))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def entered(t: Any) -> None:
            if not t.cancelled() and t.exception() is None:
                threading.Thread(target=undo, name="mpmd-trace-undo", daemon=True).start()

        task.add_done_callback(entered)
        raise
