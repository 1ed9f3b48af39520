"""`mpmd.tune`: measure a step's segment costs once, predict every candidate pipeline, return the best ready to run.

    result = mpmd.tune(train_step, params, opt_state, batch, mesh=mesh, memory_limit=2 << 30)
    print(result)                        # the table: predicted step time, bubble, peak bytes, why rejected
    step = result.step                   # the winner, an mpmd.distributed step
    batch = result.reshape_batch(batch)  # the winner's number of microbatches
    result.verify(3)                     # run the top 3 for real: predicted vs measured side by side

How the step is varied without changing its code: the step names a schedule inside
(`accumulate_grads(..., schedule=...)`); tune traces it under `mpmd.schedules.override.use_schedule(s)`,
which replaces that schedule (the same mechanism as `step.with_schedule(s)`), so any step written for
`mpmd.distributed` can be tuned as it is. The number of microbatches is varied by re-splitting the batch
argument (by default the last one): every leaf [m, b, ...] becomes [m', m*b/m', ...], so m' runs over the
divisors of the m*b rows. A batch that cannot be re-split so (one the actors load, a leaf without the rows
such as a PRNG key per microbatch, leaves with different rows) is tried at the step's own count only, and the
table says why. A loss that sums over microbatches changes scale with m' (divide by m, as
examples/gpt.py does, to keep it the same).

Candidates: every built-in schedule that fits the mesh's p actors and the step's n marker segments
(GPipe, 1F1B, eager 1F1B, ZB-H1 with p stages; interleaved 1F1B and interleaved zero bubble with v*p stages
for each v in `virtual_stages`; ZB-V and DualPipeV with 2p), times each number of microbatches, each with
its best grouping of segments into stages (`mpmd.schedules.balance`). Each is compiled to Programs here (no
actor is contacted) and timed by `simulate_programs` on the grouped costs, scaled with the rows per
microbatch (as rows ** exponent beyond each Run's own overhead: measured costs are also measured at the
largest microbatch considered, and the exponent fitted from the two); peak bytes per actor come from the same
simulation (parameters, optimizer state, activations).
A candidate above `memory_limit` on any actor is rejected with its peak in the table; with `remat=True` it
is also tried with remat of stages of the actors over the limit (their backward recomputes their forward:
`remat=` on the schedule; those backward tasks then also pay the forward's time), as a row of its own: the set
of stages that recomputes the least forward time and fits (`balance.remat_sets`), else all of those actors'
stages. With measured costs the
three best predicted candidates are then run for real once each, and every prediction scaled by the median of
their measured / simulated times (`TuneResult.calibrate`; the ranking stays, the absolute times become what
`verify` should find).
"""

from __future__ import annotations

import inspect
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np

from mpmd.compiler.eqns import aval_nbytes
from mpmd.compiler.plan import plan_step
from mpmd.errors import MpmdError, PipelineError, ScheduleError
from mpmd.runtime.loader import LoadedLeaf
from mpmd.schedules import builtin
from mpmd.schedules.balance import SegmentCosts, group_costs, ranked_groupings, remat_costs, remat_sets, resolve_grouping
from mpmd.schedules.builtin import Schedule
from mpmd.schedules.simulator import simulate_programs
from mpmd.step import DistributedFunction, ShallowCopyOnly

log = logging.getLogger(__name__)

__all__ = ["Candidate", "TuneResult", "candidate_schedules", "tune"]


@dataclass
class Candidate:
    """One pipeline tune considered: `schedule` (with `balance=` its grouping), `num_microbatches`, the
    prediction (seconds per step, mean bubble, peak bytes per actor) or why it was `rejected`, and, once
    `TuneResult.calibrate` (which tune runs with measured costs) or `verify` ran it, the `measured` seconds per step."""

    schedule: Schedule
    num_microbatches: int
    grouping: tuple[int, ...] = ()
    predicted: float | None = None
    bubble: float | None = None
    peak_bytes: tuple[int, ...] = ()
    rejected: str = ""
    measured: float | None = None
    twin_of: Candidate | None = field(default=None, repr=False, compare=False)  # the candidate it is with fuse=False
    # (made by `calibrate` for its predicted winner, and measured beside it)
    borrowed: bool = field(default=False, repr=False, compare=False)  # its prediction is its twin's (no costs to simulate it)

    @property
    def name(self) -> str:
        """The schedule's repr with its balance, remat and fuse (a subclass's own dataclass repr leaves them out: its
        fuse=False twin read as the candidate itself; a probe)."""
        shown, tail = repr(self.schedule), builtin.options_tail(self.schedule)
        if tail and tail not in shown:
            shown = shown[:-1] + tail + ")" if shown.endswith(")") else shown + tail
        return shown

    def row(self, width: int = 50) -> str:
        """The candidate's line of the table, its schedule in a column `width` wide (wider names widen the table)."""
        pred = f"{'-':>9s}" if self.predicted is None else _ms(self.predicted)
        bub = f"{self.bubble:6.3f}" if self.bubble is not None else f"{'-':>6s}"
        peak = f"{max(self.peak_bytes) / 2**20:9.1f}" if self.peak_bytes else f"{'-':>9s}"
        meas = f"{self.measured * 1e3:9.2f}  {self.measured / self.predicted:5.2f}" if self.measured and self.predicted else ""
        if meas and self.borrowed:
            meas += "  (pred: its merged twin's)"
        grouping = ",".join(map(str, self.grouping))
        return f"{self.name:{width}s} {self.num_microbatches:4d} {grouping:>16s} {pred} {bub} {peak}  {self.rejected or meas}"


def _ms(seconds: float) -> str:
    """A time in ms, 9 wide: 2 decimals, or 3 significant digits below 1 ms (XLA's estimates of small models were all
    "0.01": the rows could not be told apart; a probe)."""
    ms = seconds * 1e3
    return f"{ms:9.2f}" if ms >= 1 or ms == 0 else f"{ms:9.3g}"


def header(width: int = 50) -> str:
    """The table's column names, the schedule's column `width` wide."""
    return (f"{'schedule':{width}s} {'m':>4s} {'grouping':>16s} {'pred ms':>9s} {'bubble':>6s} {'peak MiB':>9s}  "
            "measured ms / measured:predicted, or why rejected")


def _width(candidates: Sequence[Candidate]) -> int:
    """The schedule column's width: 50, or the longest name's (a long one pushed every later column out of line)."""
    return max([50, *(len(c.name) for c in candidates)])



@dataclass
class TuneResult(ShallowCopyOnly):
    """What `mpmd.tune` found: `candidates`, the feasible ones first by predicted step time, then the rejected;
    `best`, the winner — the fastest of the top candidates measured while tuning (`calibrate`: predict, then
    prove), or the top predicted one when none was measured; `step`, the winner as a ready `mpmd.distributed`
    step; `costs`, the segment costs every prediction used. `reshape_batch(batch)` re-splits a batch to the winner's microbatches;
    `verify(k)` runs the top k for real and prints predicted and measured side by side."""

    candidates: list[Candidate]
    costs: SegmentCosts
    base: DistributedFunction
    args: tuple[Any, ...]
    batch_argnum: int | None
    memory_limit: int | None = None
    verified: list[Candidate] = field(default_factory=list)
    calibration: float = 1.0  # measured / simulated step time of the candidate measured while tuning (1.0: none)
    chosen: Candidate | None = None  # the fastest of the candidates `calibrate` measured
    calibrated: dict[int, float] = field(default_factory=dict)  # id(candidate) -> seconds per step `calibrate` measured
    drift: float | None = None  # after `verify`: now / then for the candidates `calibrate` measured (the machine's drift)
    _steps: dict[int, tuple[Candidate, DistributedFunction]] = field(default_factory=dict, repr=False)  # id -> (it, the step measured)
    _handed: dict[int, tuple[Candidate, DistributedFunction]] = field(default_factory=dict, repr=False)  # id -> (it, the user's step)
    remat: bool = False  # whether tune was asked to try remat (remat=True): a candidate over the limit has a remat row
    note: str = ""  # what tune could not try and why (e.g. a batch it cannot re-split: the step's own microbatch count only)
    scaled_costs: dict[int, SegmentCosts] = field(default_factory=dict, repr=False)  # m -> the costs its predictions used

    def _not_pickled(self) -> str:
        return ("a TuneResult holds the distributed steps it measured (their mesh: running daemons) and cannot be pickled "
                "or deep-copied; keep what it chose: result.best (schedule, num_microbatches), or str(result)")

    @property
    def feasible(self) -> list[Candidate]:
        return [c for c in self.candidates if not c.rejected]

    @property
    def best(self) -> Candidate:
        if not self.feasible:
            over = [c for c in self.candidates if "memory_limit" in (c.rejected or "")]
            memory = len(over)
            if over and all(FLOOR in c.rejected for c in over):  # the arguments alone: nothing but room helps
                advice = ["raise memory_limit or use more actors (the step's arguments alone are over it: neither remat nor "
                          "more stage boundaries can help)"]
            else:
                advice = [("raise memory_limit or mark more stage boundaries (remat=True was tried: the remat rows are "
                           "over the limit too)") if self.remat else "raise memory_limit, pass remat=True or mark more stage "
                          "boundaries"] if memory else []
            if memory < len(self.candidates):
                advice.append("pass microbatches=[...] and schedules=[...] that fit the batch and the mesh")
            reasons = list(dict.fromkeys((c.rejected or "").split(" (")[0] for c in self.candidates))
            more = len(reasons) - 3
            said = "; ".join(reasons[:3]) + (f"; and {more} other reason{'s' if more > 1 else ''}" if more > 0 else "")
            memory_said = f"{memory} over memory_limit; " if self.memory_limit is not None else ""
            raise MpmdError(f"no candidate fits: all {len(self.candidates)} were rejected ({memory_said}each row of the "
                            f"table says why: {said}); {' or '.join(advice)}\n" + self.table())
        if self.chosen is not None and not self.chosen.rejected:
            return self.chosen
        return self.feasible[0]

    @property
    def step(self) -> DistributedFunction:
        """The winner as a distributed step on the same mesh (the same step object every time; see `step_for`)."""
        return self.step_for(self.best)

    def step_for(self, candidate: Candidate) -> DistributedFunction:
        """`candidate` as a distributed step on the same mesh (one per candidate, kept). It is not the step object
        `verify` and `calibrate` run, whose calls count on (a `loaded_by_actors` batch is loaded for the call's
        number: a training loop on that one started at the loader's step 14), so its first call loads the step the tuned
        step would have loaded next (0 for a fresh one), and it shares the tuned step's count: a loop going on with
        either loads each step once; it compiles on its first call (the measured one's Programs carry that step's
        step numbers on the actors)."""
        got = self._handed.get(id(candidate))
        if got is None or got[0] is not candidate:  # (held with its candidate: an id is reused once an object is gone)
            got = self._handed[id(candidate)] = (candidate, self.base.with_schedule(candidate.schedule))
        return got[1]

    def _measured_step(self, candidate: Candidate) -> DistributedFunction:
        """`candidate` as the distributed step `verify` and `calibrate` run (one per candidate, kept)."""
        got = self._steps.get(id(candidate))
        if got is None or got[0] is not candidate:
            got = self._steps[id(candidate)] = (candidate, self.base._variant(candidate.schedule))  # (a count of its own)
        return got[1]

    def reshape_batch(self, batch: Any, candidate: Candidate | None = None) -> Any:
        """`batch` re-split into the winner's (or `candidate`'s) number of microbatches."""
        return resplit(batch, (candidate or self.best).num_microbatches)

    def table(self) -> str:
        lim = f", memory limit {_size(self.memory_limit)}" if self.memory_limit is not None else ""
        head = f"mpmd.tune: {len(self.feasible)} of {len(self.candidates)} candidates fit{lim}; costs {self.costs.source}"
        if self.calibration != 1.0:
            head += f"; predictions x {self.calibration:.3f} (the median measured / simulated of the top candidates, run while tuning)"
        elif self.costs.source.startswith("xla"):
            head += ("\n(pred ms: XLA's estimate of the compute alone, without the runtime's per-Run and per-transfer costs —"
                     " it ranks candidates of one microbatch count; across counts it favours the most microbatches, whose"
                     " per-Run costs it leaves out (a probe saw the order reversed); result.calibrate() or verify(k) measures"
                     " them)")
        if self.chosen is not None and not self.chosen.rejected:
            head += f"\nwinner: {self.chosen.name} m={self.chosen.num_microbatches} (the fastest measured of those)"
        if self.note:
            head += f"\n{self.note}"
        width = _width(self.candidates)
        return "\n".join([head, header(width), *(c.row(width) for c in self.candidates)])

    def __str__(self) -> str:
        return self.table()

    def verify(self, k: int = 3, steps: int = 3, warmup: int = 2, rounds: int = 3) -> list[Candidate]:
        """Run the winner and the next best predicted, `k` candidates in all, for real (`warmup` steps, then
        `rounds` x `steps` timed ones; the median round counts: with three, one slow spell of a shared machine —
        2x for a few hundred ms is common here — decides no candidate's time), print predicted and measured step times side
        by side and return those candidates (the winner first). The fastest of them measured becomes the
        winner (`best`, `step`), as in `calibrate`: the measurement decides among the candidates it measured.
        Rounds are interleaved (candidate 1, 2, ..., k, then 2, ..., k, 1: each round starts one later), so a slow spell of a shared machine
        lands on several candidates rather than on one; one candidate's state is on the actors at a time."""
        _check_counts("TuneResult.verify", k=(k, 1), steps=(steps, 1), warmup=(warmup, 0), rounds=(rounds, 1))
        winner = self.best  # (with no feasible candidate: the MpmdError saying why, as `best` and `step` raise)
        # (the winner's twin, when it is the winner's, beside it; other twins have their own measured already)
        out = ([winner] + [c for c in self.feasible if c is not winner and (c.twin_of is None or c.twin_of is winner)])[:k]
        times = measure_interleaved([(self._measured_step(c), self._args_for(c)) for c in out],
                                    self.batch_argnum, steps, warmup, rounds)
        for c, t in zip(out, times):
            c.measured = t
            log.info("measured %s", c.row())
        self.verified = out
        self.chosen = min(out, key=lambda c: c.measured)
        again = [c.measured / self.calibrated[id(c)] for c in out if id(c) in self.calibrated]
        self.drift = statistics.median(again) if again else None
        width = _width(out)
        print(header(width))
        for c in out:
            print(c.row(width))
        if self.chosen is not winner:
            print(f"winner now {self.chosen.name} m={self.chosen.num_microbatches}: the fastest measured (predicted "
                  f"{winner.name} m={winner.num_microbatches} measured {winner.measured / self.chosen.measured:.2f}x "
                  "as long); result.best and result.step are it")
        if self.drift is not None:
            which = "the candidate" if len(again) == 1 else f"the {len(again)} candidates"
            print(f"{which} verified here that calibration had measured too ran {self.drift:.2f}x as long now as then "
                  "(the machine's drift since the predictions were scaled: measured/predicted moves by as much)")
        return out

    def calibrate(self, steps: int = 3, warmup: int = 3, rounds: int = 3, top: int = 3) -> float:
        """Run `top` candidates for real (`calibration_candidates`: the predicted winner, the best of other
        microbatch counts predicted near it, the next best) and scale every prediction by the median of their
        measured / simulated (a uniform factor: it keeps the ranking and fixes what the simulator misses
        everywhere alike, e.g. compute slowed by the runtime's own threads on the same cores; the median of a
        few, because one candidate's run moves 10-30 % on a busy machine). The fastest of them measured becomes
        `best`: the simulator ranks, the measurement decides among its top few. Returns the factor."""
        _check_counts("TuneResult.calibrate", steps=(steps, 1), warmup=(warmup, 0), rounds=(rounds, 1), top=(top, 1))
        if not self.feasible:
            return self.calibration
        refs = self.calibration_candidates(top)
        if not any(r.predicted for r in refs):
            raise MpmdError(f"TuneResult.calibrate: the {len(refs)} candidates it runs are predicted to take 0 s per step (the "
                            "costs give their tasks no time), so no measured / predicted factor exists; tune with measured "
                            "costs (costs=None), costs='xla', or SegmentCosts with the segments' positive times")
        try:
            twin = self._unmerged_twin(refs[0])
        except Exception as e:  # noqa: BLE001 - (its plan could not be made: the candidates are measured without it)
            log.warning("tune: the fuse=False twin of %s was not tried: %s: %.200s", refs[0].name, type(e).__name__, e)
            twin = None
        known = twin is not None and any(c is twin for c in self.candidates)  # (a second calibrate: measured again)
        runs = refs + [twin] * (twin is not None and all(r is not twin for r in refs))
        measured = measure_interleaved([(self._measured_step(r), self._args_for(r)) for r in runs],
                                       self.batch_argnum, steps, warmup, rounds)
        # (a candidate predicted at 0 s has no ratio: the others' set the factor; the twin is the winner's prediction)
        factor = statistics.median(m / (r.predicted / self.calibration) for m, r in zip(measured, refs) if r.predicted)
        if twin is not None and not known:
            self.candidates.insert(self.candidates.index(refs[0]) + 1, twin)
        self.chosen = runs[min(range(len(runs)), key=measured.__getitem__)]  # the winner: the fastest measured
        self.calibrated = {id(r): m for r, m in zip(runs, measured)}
        for r, m in zip(runs, measured):  # (shown in the table beside the scaled prediction; verify measures again)
            r.measured = m
        for c in self.candidates:
            if c.predicted is not None:
                c.predicted = c.predicted / self.calibration * factor
        self.calibration = factor
        return factor

    def _unmerged_twin(self, c: Candidate) -> Candidate | None:
        """`c` with its schedule's `fuse=False`, when its plan merges tasks into one Run (else None): XLA compiles
        merged tasks as one program, which may run faster or slower than apart (a softmax-head stage's F+B 25 %
        slower merged on CPU, MLP stages faster: measured 2026-12-06) and the simulator does not tell them apart,
        so `calibrate` measures the predicted winner both ways. Its prediction is its own plan's (None: over the
        memory limit apart, or a schedule tune cannot re-make)."""
        if getattr(c.schedule, "fuse", False) is not True:
            return None
        try:
            twin = remade(c.schedule, fuse=False)
        except (ScheduleError, ValueError):  # (a schedule class tune cannot re-make: not tried)
            return None
        for other in self.candidates:
            if other.schedule == twin and other.num_microbatches == c.num_microbatches:
                return other if not other.rejected else None  # (one given, and rejected: not run)
        outer, _ = self._measured_step(c).trace(*self._args_for(c))  # (the plan only: nothing compiled)
        plan = plan_step(outer, len(self.base.mesh))
        if not plan.merges_tasks:
            return None
        made = Candidate(twin, c.num_microbatches, c.grouping, c.predicted, c.bubble, c.peak_bytes, twin_of=c)
        costs = self.scaled_costs.get(c.num_microbatches)
        if costs is None:  # (a result made without them: its candidate's prediction, said so in its row)
            made.borrowed = True
            return made
        # Its own prediction: the simulator charges each Run its overhead (not what XLA does to a merged one), as
        # when the schedule is given with fuse=False (it was the candidate's own: ZB-V 9.08 ms where 9.64; a probe).
        outer, _ = self.base.with_schedule(twin).trace(*self._args_for(c))
        unmerged = simulate_programs(plan_step(outer, len(self.base.mesh)).programs, _stage_costs(costs, c.grouping, twin),
                                     name=repr(twin))
        if _record(made, unmerged, self.memory_limit):
            return None  # (over the limit apart: not run)
        made.predicted *= self.calibration  # (in the units of the other predictions: calibrate rescales them all)
        return made

    def calibration_candidates(self, top: int = 3) -> list[Candidate]:
        """The `top` candidates `calibrate` runs, in predicted order: the predicted winner; then the best predicted of
        each other microbatch count among those predicted within `SPREAD` of it; then the next best predicted. When
        the top few share one count (they often do: a schedule's variants are a few % apart), an error of the
        simulator that grows or shrinks with the count — the compute of a smaller microbatch, the runtime's cost per
        task — went unmeasured, and the winner was chosen among candidates the error moved alike (GPT, 2026-12-05:
        the top three all at m=2, predicted 169-172 ms; m=4 measured 128 against their 137-160)."""
        feasible = [c for c in self.feasible if c.twin_of is None]  # (a twin is run beside its own, not in its place)
        if not feasible:
            return []
        picked, counts = [feasible[0]], {feasible[0].num_microbatches}
        near = [c for c in feasible[1:] if c.predicted is None or feasible[0].predicted is None
                or c.predicted <= SPREAD * feasible[0].predicted]
        for c in near:
            if len(picked) < top and c.num_microbatches not in counts:
                picked.append(c)
                counts.add(c.num_microbatches)
        chosen = {id(c) for c in picked}
        picked += [c for c in feasible[1:] if id(c) not in chosen][:max(0, top - len(picked))]
        order = {id(c): i for i, c in enumerate(feasible)}
        return sorted(picked, key=lambda c: order[id(c)])

    def _args_for(self, c: Candidate) -> tuple[Any, ...]:
        args = list(self.args)
        if self.batch_argnum is None:  # every candidate has the microbatches the batch is given with
            return tuple(args)
        batch = args[self.batch_argnum]
        if not _is_batch(batch, c.num_microbatches):  # (already split so: as given)
            args[self.batch_argnum] = resplit(batch, c.num_microbatches)
        return tuple(args)


def resplit(batch: Any, num_microbatches: int) -> Any:
    """Every leaf [m, b, ...] of `batch` as [num_microbatches, m*b/num_microbatches, ...] (a leaf already of
    `num_microbatches` as it is); a PipelineError naming the leaf that cannot be (`why_not_resplit`)."""
    def one(path: Any, x: Any) -> Any:
        if isinstance(x, LoadedLeaf) or np.shape(x)[:1] == (num_microbatches,):  # (already so; a loaded leaf only so)
            if isinstance(x, LoadedLeaf) and x.shape[:1] != (num_microbatches,):
                raise PipelineError(f"{LOADED}; pass microbatches=[{x.shape[0] if x.shape else 1}]")
            return x
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim < 2:
            raise PipelineError(f"tune re-splits the batch's leaves [m, rows, ...] into other microbatch counts; the leaf "
                                f"batch{jax.tree_util.keystr(path)} of shape {x.shape} has no row axis")
        rows = x.shape[0] * x.shape[1]
        if rows % num_microbatches:
            raise PipelineError(f"{num_microbatches} microbatches do not divide the batch's {rows} rows")
        return x.reshape(num_microbatches, rows // num_microbatches, *x.shape[2:])

    return jax.tree_util.tree_map_with_path(one, batch)


LOADED = "a batch the actors load (loaded_by_actors) cannot be re-split into other microbatch counts"
FIXED = "the batch cannot be re-split into other microbatch counts"


def why_not_resplit(batch: Any) -> str:
    """Why `batch` cannot be re-split into other microbatch counts, naming the leaf: it is loaded by the actors,
    a leaf has no row axis (a PRNG key per microbatch, [m]), or two leaves have different rows per microbatch (a
    key [m, 2] or a context [m, 1, d] beside x [m, rows, d]: a re-split would cut them elsewhere than the rows);
    "" when every leaf is [m, rows, ...] with the same rows."""
    first = None
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        name, shape = f"batch{jax.tree_util.keystr(path)}", tuple(np.shape(x))
        if isinstance(x, LoadedLeaf):
            return LOADED
        if len(shape) < 2:
            return f"{FIXED}: its leaf {name} of shape {shape} has no row axis (the second: [m, rows, ...])"
        if first is None:
            first = name, shape
        elif shape[1] != first[1][1]:
            return (f"{FIXED}: its leaves {first[0]} of shape {first[1]} and {name} of shape {shape} have different rows "
                    "per microbatch (the second axis)")
    return ""


def measure_interleaved(runs: Sequence[tuple[DistributedFunction, tuple[Any, ...]]], batch_argnum: int, steps: int,
                        warmup: int, rounds: int) -> list[float]:
    """Seconds per step of each (step, args), threading state when a step returns its non-batch arguments
    first (params, opt_state, ... -> params, opt_state, ..., aux): the median of `rounds` rounds of `steps`,
    taken round by round: in each round every step in turn runs from its
    own `args` (the first round after `warmup` steps, later ones after one untimed step that puts the state on
    the actors again), so only one step's state is held at a time and a slow spell is shared out. Round r starts
    at step r (mod their number): no step always runs first (verify's winner did, in every round: a machine
    drifting one way over the rounds was charged to it alone; a review)."""
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        order = [(i + r) % len(runs) for i in range(len(runs))]
        for i in order:
            step, args = runs[i]
            times[i].append(_timed_round(step, args, batch_argnum, steps, warmup if r == 0 else min(warmup, 1)))
    return [statistics.median(t) for t in times]


def _timed_round(step: DistributedFunction, args: tuple[Any, ...], batch_argnum: int, steps: int, warmup: int) -> float:
    from mpmd.runtime.array import wait_ready

    args = list(args)
    batch_at = (batch_argnum if batch_argnum is not None else -1) % len(args)
    state_at = [i for i in range(len(args)) if i != batch_at]

    def call() -> Any:
        out = step.call_bound(tuple(args))
        if isinstance(out, tuple) and len(out) > len(state_at) and all(
                jax.tree.structure(out[j], is_leaf=_remote) == jax.tree.structure(args[i], is_leaf=_remote)
                for j, i in enumerate(state_at)):
            for j, i in enumerate(state_at):
                args[i] = out[j]
        return out

    for _ in range(warmup):
        wait_ready(call())
    if not warmup:  # (the first call of a step not yet compiled for these arguments would time its compile)
        step.compile_bound(tuple(args))
    t = time.perf_counter()
    for _ in range(steps):
        out = call()
    wait_ready(out)
    return (time.perf_counter() - t) / steps


def _remote(x: Any) -> bool:
    return type(x).__name__ == "RemoteArray"


def candidate_schedules(num_actors: int, num_segments: int, virtual_stages: Sequence[int] = (2,)) -> list[Schedule]:
    """Every built-in schedule that fits `num_actors` actors and `num_segments` marker segments."""
    p, n = num_actors, num_segments
    out: list[Schedule] = []
    if p <= n:
        out += [builtin.GPipe(p), builtin.OneFOneB(p), builtin.EagerOneFOneB(p), builtin.ZeroBubbleH1(p)]
    for v in virtual_stages:
        if v >= 2 and v * p <= n:
            out += [builtin.InterleavedOneFOneB(v * p, p), builtin.InterleavedZeroBubble(v * p, p)]
    if 2 * p <= n and p > 1:
        out += [builtin.ZeroBubbleV(p), builtin.DualPipeV(p)]
    return out


def _with_balance(schedule: Schedule, grouping: tuple[int, ...], remat: tuple[int, ...] = ()) -> Schedule:
    if isinstance(schedule, (builtin.ZeroBubbleV, builtin.DualPipeV)):
        return type(schedule)(schedule.num_actors, balance=grouping, remat=remat, fuse=schedule.fuse)
    return remade(schedule, balance=grouping, remat=remat)


def remade(schedule: Schedule, **options: Any) -> Schedule:
    """`schedule` with other `balance` / `remat` / `fuse` (`dataclasses.replace`), refused (ScheduleError) when that
    makes another schedule: a subclass whose own __init__ keeps state outside its dataclass fields came back with
    that state at its default, its task table another, and tune measured and returned that one without a word (a
    probe); one whose __init__ takes none of these options failed as 'tracing it raised TypeError'."""
    how = (f"tune re-makes a schedule with dataclasses.replace(schedule, {', '.join(f'{k}=...' for k in options)}): "
           f"{type(schedule).__name__}")
    try:
        new = replace(schedule, **options)
    except TypeError as e:
        raise ScheduleError(f"{how}.__init__ must take num_stages and {', '.join(options)} as keywords, or be a frozen "
                            f"dataclass ({e})") from None
    probe = max(getattr(schedule, "min_microbatches", 1), 2 * getattr(schedule, "num_actors", 1))
    try:
        same = (new.num_actors == schedule.num_actors and [new.actor_of(s) for s in range(new.num_stages)]
                == [schedule.actor_of(s) for s in range(schedule.num_stages)] and new.tasks(probe) == schedule.tasks(probe))
    except Exception:  # noqa: BLE001 - (a table of one count: compared by its own length)
        same = new.tasks(schedule.min_microbatches) == schedule.tasks(schedule.min_microbatches)
    if not same:
        raise ScheduleError(f"{how} came back as another schedule (its stage placement or task table differs): keep "
                            "everything its tasks depend on in dataclass fields")
    return new


def _size(nbytes: float) -> str:
    if nbytes >= 2**60:  # (memory_limit=1e30 read "909494701772928256.0 TiB"; a probe)
        return f"{nbytes:.3g} bytes"
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} byte{'s' * (int(nbytes) != 1)}"


def _sizes(a: float, b: float) -> tuple[str, str]:
    """`_size` of both, with their exact bytes when the two read the same ("4.6 MiB > 4.6 MiB" said nothing)."""
    x, y = _size(a), _size(b)
    return (f"{x} ({int(a)} bytes)", f"{y} ({int(b)} bytes)") if x == y else (x, y)


FLOOR = "no grouping can fit"  # said of a candidate whose step arguments alone are over memory_limit on every actor
GROUPINGS_TRIED = 16  # groupings, fastest first, a candidate over memory_limit is simulated with before it is rejected


def _divisors(rows: int, low: int, high: int) -> list[int]:
    return [d for d in range(max(1, low), min(rows, high) + 1) if rows % d == 0]


def tune(step_fn: Any, *args: Any, mesh: Any = None, memory_limit: int | None = None, schedules: Sequence[Any] | None = None,
         microbatches: Sequence[int] | None = None, costs: SegmentCosts | str | None = None, virtual_stages: Sequence[int] = (2,),
         batch_argnum: int | None = None, profile_steps: int = 2, calibrate: bool | None = None, remat: bool = False,
         step_kwargs: dict[str, Any] | None = None) -> TuneResult:
    """Choose the schedule, number of microbatches and stage grouping with the shortest predicted step that fits
    `memory_limit` (bytes per actor; None: no limit), for `step_fn(*args)` on `mesh`.

    `step_fn` is the undecorated step or an `mpmd.distributed` one (then `mesh` defaults to its own). It is
    varied without changing its code (see the module docstring). `schedules`: schedules or built-in names to
    consider (default: every built-in that fits); `microbatches`: counts to consider (default: the divisors
    of the batch's rows from p to 4 * p * v_max, and the step's own count); `costs`: per-segment costs (SegmentCosts; without `microbatch_rows`, taken to be the step's own microbatch's), "xla" for XLA's cost analysis
    (deterministic, no actor runs), or None to measure them on the actors (`step.profile_costs`).
    A candidate whose fastest grouping is over `memory_limit` takes the fastest of the next GROUPINGS_TRIED that fits.
    `remat=True`: a candidate still over `memory_limit` is also tried with remat of the cheapest set of stages of the
    actors over it that fits (else all their stages)
    (a row of its own: "... remat 0,2"). `calibrate` (default: when the costs are measured): run three near the top for real once (the winner and the
    best of other microbatch counts predicted near it: `TuneResult.calibration_candidates`) and scale every
    prediction by the median of their measured / simulated (`TuneResult.calibrate`). `batch_argnum`: the
    position of the batch tune re-splits (default: the one argument, not static, whose leaves all lead with
    the step's microbatch count, then its rows), counted in `args` followed by the step's keyword-only
    parameters in signature order. `step_kwargs`: the step's keyword arguments, as `step(*args, **step_kwargs)`.
    `virtual_stages`: the stages per actor the interleaved schedules are tried with. `profile_steps`: warm-up steps
    of each variant `profile_costs` runs before the three it traces (each figure is the median of those three).

        result = mpmd.tune(train_step, params, opt_state, batch, mesh=mesh, memory_limit=1 << 30)
        print(result); result.verify(3)
    """
    memory_limit, schedules, microbatches, virtual_stages = _check_choices(memory_limit, schedules, microbatches,
                                                                          virtual_stages)  # before anything is measured
    from mpmd.observe.segments import check_steps, profile_costs, segment_layout

    check_steps("tune", "profile_steps", profile_steps)
    for name, flag in (("calibrate", calibrate), ("remat", remat)):
        if not isinstance(flag, (bool, np.bool_)) and not (flag is None and name == "calibrate"):
            raise TypeError(f"tune: {name} must be True or False{' (or None: when the costs are measured)' * (name == 'calibrate')}, "
                            f"got {type(flag).__name__} {flag!r:.40}")
    if isinstance(step_fn, DistributedFunction):  # its static arguments and shardings too
        mesh = mesh if mesh is not None else step_fn.mesh
        # (donating as the user's step does: what tune measures runs through call_bound, which never donates)
        base = DistributedFunction(step_fn.fn, mesh, step_fn.in_shardings, step_fn.out_shardings, step_fn.static_argnums,
                                   donate_argnums=step_fn.donate_argnums)
        base._count = step_fn._count  # (one count: the winner's first call loads what the loop would load next, and a
        # loop going on with either step after tuning loads each step once; a copy made the other load them again)
    elif mesh is None:
        raise PipelineError("mpmd.tune needs mesh= (the RemoteMesh the step will run on)")
    else:
        base = DistributedFunction(step_fn, mesh)
    if getattr(mesh, "closed", False):  # (costs="xla" contacts no actor: its table came, and the winner failed later)
        raise MpmdError("tune: this RemoteMesh is closed: tune the step on the mesh it will run on, open (a new mesh, and "
                        "mpmd.distributed(fn, mesh=new_mesh))")
    if step_kwargs is not None and not isinstance(step_kwargs, dict):
        raise PipelineError(f"tune: step_kwargs is a dict of the step's keyword arguments, got {type(step_kwargs).__name__}")
    try:  # (a missing or extra argument: said here, not by a TypeError from deep inside the first trace)
        inspect.signature(base.fn).bind(*args, **(step_kwargs or {}))
    except TypeError as e:
        raise PipelineError(f"tune: cannot call {getattr(base.fn, '__name__', 'the step')} with these arguments: {e}; pass "
                            "every argument the step takes after it (the batch included), or its keyword arguments in "
                            "step_kwargs") from None
    except ValueError:  # no signature to read (a builtin or C callable): the trace says what is wrong
        pass
    args = base.bind(args, step_kwargs or {})  # from here on one tuple, as a compiled step takes it
    p = len(mesh)
    n, out_bytes, m0, rows = segment_layout(base, *args)
    # (virtual stages too many for the step's segments: not tried, and said so in the table's note and any error)
    unfit = [v for v in virtual_stages if v * p > n]
    skipped = (f"the interleaved schedules with virtual_stages={unfit[0] if len(unfit) == 1 else unfit} not tried: "
               f"{unfit[0]} virtual stages on {p} actors need {unfit[0] * p} segments and the step has {n}"
               + (f"; nor ZeroBubbleV and DualPipeV, which need {2 * p}" if 2 * p > n and p > 1 and schedules is None else "")
               + "; mark more stage boundaries to try them") if unfit else ""
    if schedules is None:  # (before anything is measured: a step that cannot pipeline is told so at once)
        cands = candidate_schedules(p, n, virtual_stages)
    else:  # (names checked by _check_choices)
        cands = []
        for s in schedules:
            if isinstance(s, str):
                cands += [c for c in candidate_schedules(p, n, virtual_stages) if type(c).__name__ == s]
            elif s.num_actors > p:  # (said now, not as every row of a table whose .best then fails)
                raise PipelineError(f"tune: the schedule {s!r:.120} needs {s.num_actors} actors and the mesh has {p}; give "
                                    f"schedules for {p} actors, or names (tune sizes built-ins to the mesh)")
            else:
                cands.append(s)
    if not cands:
        raise PipelineError(f"tune: no schedule to try: the step has {n} segment{'s' * (n != 1)} (mpmd.pipeline_yield markers + 1) "
                            f"and the mesh {p} actors; every built-in needs a stage per actor (mark at least {p} stages)"
                            if schedules is None else f"tune: none of the schedules {schedules} fits {p} actors and {n} segments"
                            + (f" ({skipped})" if skipped and any("Interleaved" in str(s) for s in schedules) else ""))
    total_rows = m0 * rows if rows else m0
    vmax = max([*virtual_stages, 2])
    counts = list(microbatches) if microbatches is not None else (
        sorted({*_divisors(total_rows, p, 4 * p * vmax), m0}) if rows else [m0])  # (the step's own count too, always)
    # (0 rows: the loop's batch leaves have no rows per microbatch in common)
    why = "" if rows else f"{FIXED}: the step's batch leaves have no rows per microbatch (second axis) in common"
    if batch_argnum is not None or any(m != m0 for m in counts):  # (only a re-split needs to know the batch)
        batch_argnum = _batch_argnum(args, batch_argnum, m0, base.static_argnums, rows)
        why = why_not_resplit(args[batch_argnum]) or why
    elif why:  # (only the step's own count to try anyway: the batch is looked for to say which leaf)
        try:
            why = why_not_resplit(args[_batch_argnum(args, None, m0, base.static_argnums)]) or why
        except PipelineError:
            pass
    note = skipped if skipped and (schedules is None or any("Interleaved" in str(s) for s in schedules)) else ""
    if why and any(m != m0 for m in counts):
        if microbatches is not None:  # (asked for: said before anything is measured)
            raise PipelineError(f"tune: {why}; pass microbatches=[{m0}] (the step's own count)")
        counts = [m0]
    if why:
        note = "; ".join(x for x in (f"only the step's own {m0} microbatches tried: {why}", note) if x)
        log.info("tune: %s", note)
    if rows and not any(total_rows % m == 0 for m in counts):  # (asked for: said before anything is measured)
        ok = _divisors(total_rows, p, total_rows)[:8] or [m0]
        raise PipelineError(f"tune: microbatches={list(counts)}: none divides the batch's {total_rows} rows ({m0} microbatches "
                            f"of {rows}); pass counts that do, e.g. microbatches={ok}")
    if costs is None:
        seg = profile_costs(base, *args, steps=profile_steps)
    elif costs == "xla":
        seg = _xla_costs(base, args)
    elif isinstance(costs, SegmentCosts):
        seg = costs
    else:
        raise PipelineError(f"tune: costs must be None (measure), 'xla' or SegmentCosts, got {costs!r}")
    if seg.num_segments != n:
        raise PipelineError(f"tune: the costs have {seg.num_segments} segments but the step has {n}")
    if not any(seg.F) and not any(seg.B):
        raise PipelineError(f"tune: the segment costs ({seg.source or 'given'}) are all zero (F={seg.F}, B={seg.B}): every "
                            "candidate would be predicted to take no compute and none could be ranked above another (nor "
                            "calibrated: measured / 0); give SegmentCosts with the segments' positive times, costs='xla', or "
                            "costs=None to measure them")
    fits = [m for m in counts if not rows or total_rows % m == 0]
    # Also measured at the largest and the smallest microbatch considered: how the compute grows and shrinks with
    # the rows (rarely linearly, and not as one power on both sides).
    for other in sorted({min(fits), max(fits)} - {m0}) if costs is None and rows and fits else ():
        call_args = list(args)
        try:
            call_args[batch_argnum] = resplit(args[batch_argnum], other)
            seg = seg.with_rows_exponent(profile_costs(base, *call_args, steps=profile_steps, split_backward=False))
        except MpmdError as e:  # e.g. the larger microbatch does not fit: keep the linear model
            log.warning("tune: could not measure the costs at %d microbatches (%s); scaling them linearly with the rows",
                        other, str(e).splitlines()[0])
    found: list[Candidate] = []
    scaled_costs: dict[int, SegmentCosts] = {}
    for m in counts:
        if rows and total_rows % m:
            found.extend(Candidate(sched, m, rejected=f"{m} microbatches do not divide the batch's {total_rows} rows")
                         for sched in cands)
            continue
        b = total_rows // m if rows else 0
        # task times scale with the rows of a microbatch; the runtime's per-Run and per-transfer costs do not
        # (costs given without their rows are taken to be the step's own microbatch's)
        scaled = scaled_costs[m] = seg.scaled(b / (seg.microbatch_rows or rows)) if rows else seg
        call_args = list(args)
        try:
            if m != m0:
                call_args[batch_argnum] = resplit(args[batch_argnum], m)
        except PipelineError as e:
            found.extend(Candidate(sched, m, rejected=_reason(str(e))) for sched in cands)
            continue
        for sched in cands:
            found.extend(_predict(base, tuple(call_args), sched, m, scaled, p, memory_limit, remat, m0 if m != m0 else None))
    found.sort(key=lambda c: (bool(c.rejected), c.predicted if c.predicted is not None else float("inf")))
    result = TuneResult(found, seg, base, args, batch_argnum, memory_limit, remat=bool(remat), note=note,
                        scaled_costs=scaled_costs)  # (None: the batch is never re-split)
    if calibrate if calibrate is not None else costs is None:
        result.calibrate()
    return result


def _is_batch(arg: Any, m0: int) -> bool:
    leaves = jax.tree.leaves(arg)
    return bool(leaves) and all(len(np.shape(x)) >= 1 and np.shape(x)[0] == m0 for x in leaves)


def _batch_argnum(args: tuple[Any, ...], batch_argnum: Any, m0: int, static: Any = (), rows: int = 0) -> int:
    """The position of the batch the step splits into its `m0` microbatches (every leaf [m0, rows, ...]): tune
    re-splits it for each microbatch count it tries. None: the one argument, not static, that looks so."""
    if batch_argnum is None:
        found = [i for i in range(len(args)) if i not in static and _is_batch(args[i], m0)]
        if len(found) > 1 and rows:  # (parameters may lead with m0 too; the batch's leaves also have the rows next)
            found = [i for i in found if all(np.shape(x)[1:2] == (rows,) for x in jax.tree.leaves(args[i]))] or found
        if not found:
            raise PipelineError(f"tune: no argument is a batch of {m0} microbatches (every leaf [{m0}, rows, ...]); pass "
                                "batch_argnum= the batch's position")
        if len(found) > 1:
            raise PipelineError(f"tune: arguments {found} could each be the batch of {m0} microbatches; pass batch_argnum= "
                                "the batch's position")
        return found[0]
    if isinstance(batch_argnum, bool) or not isinstance(batch_argnum, (int, np.integer)) or not -len(args) <= batch_argnum < len(args):
        raise PipelineError(f"tune: batch_argnum={batch_argnum!r:.40} names no argument of the {len(args)} given; it is the "
                            "position of the batch (default None: the one argument that looks like it)")
    if not _is_batch(args[batch_argnum], m0):
        shapes = ", ".join(str(tuple(np.shape(x))) for x in jax.tree.leaves(args[batch_argnum])[:4]) or "no array leaves"
        raise PipelineError(f"tune: argument {batch_argnum} is not the step's batch: its leaves ({shapes}) must all lead with "
                            f"the {m0} microbatches that accumulate_grads splits it into; pass batch_argnum= the batch's position")
    return int(batch_argnum) % len(args)


def _reason(message: str, limit: int = 800) -> str:
    """A rejection's reason for the table: the message's first line, cut at its last space before `limit`
    characters when longer."""
    line = (message.splitlines() or [""])[0]
    if len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit)
    return line[:cut if cut > limit // 2 else limit].rstrip(" ,;:(") + " ..."


SPREAD = 1.3  # calibrate measures other microbatch counts' best when predicted within this factor of the winner


def _check_counts(where: str, **counts: Any) -> None:
    for name, (value, low) in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise PipelineError(f"{where}: {name} must be an int >= {low}, got {value!r:.40}")


def _check_choices(memory_limit: Any, schedules: Any, microbatches: Any, virtual_stages: Any) -> tuple[Any, Any, Any, Any]:
    """tune's choices as lists and an int limit; a PipelineError naming the first that makes no sense."""
    import math

    from mpmd.schedules.builtin import BUILTINS

    def positive_int(x: Any) -> bool:
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x > 0

    def as_list(x: Any) -> list[Any] | None:
        if isinstance(x, (str, bytes, Schedule)) or not hasattr(x, "__iter__"):
            return None
        return list(x.tolist() if isinstance(x, np.ndarray) else x)

    if memory_limit is not None:
        if (isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float, np.integer, np.floating))
                or not math.isfinite(memory_limit) or memory_limit < 1):
            raise PipelineError(f"tune: memory_limit is bytes per actor (a number, at least 1) or None for no limit, got "
                                f"{memory_limit!r:.80}")
        memory_limit = int(memory_limit)  # (whole bytes, rounded down: a peak of at most 1.5 bytes is one of at most 1)
    lists = {}
    for name, counts in (("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if counts is None and name == "microbatches":
            lists[name] = None
            continue
        got = as_list(counts)
        if not got or not all(map(positive_int, got)):
            raise PipelineError(f"tune: {name} must be a non-empty list of positive ints, got {counts!r:.80}")
        if name == "virtual_stages" and min(got) < 2:
            raise PipelineError(f"tune: virtual_stages are the stages per actor of the interleaved schedules (at least 2: "
                                f"one stage per actor is what the other schedules try), got {counts!r:.80}")
        lists[name] = list(dict.fromkeys(int(c) for c in got))  # each once, in the order given
    if schedules is not None:
        got = as_list(schedules)
        if not got:
            raise PipelineError(f"tune: schedules must be a non-empty list of schedules or built-in names (e.g. ['OneFOneB', "
                                f"'ZeroBubbleH1']), or None for every built-in; got {schedules!r:.80}")
        for s in got:
            if isinstance(s, str) and s not in BUILTINS:
                raise PipelineError(f"tune: unknown schedule {s!r}; built-ins are {', '.join(BUILTINS)}")
            if isinstance(s, type) and issubclass(s, Schedule):
                raise PipelineError(f"tune: schedules lists the class {s.__name__}; give its name {s.__name__!r} (tune picks "
                                    f"the stages and actors) or a schedule such as {s.__name__}(num_stages=2)")
            if not isinstance(s, (str, Schedule)):
                raise PipelineError(f"tune: schedules holds {type(s).__name__} {s!r:.80}; give built-in names or mpmd.Schedule "
                                    "objects (tune re-makes each with other balance= and remat= by dataclasses.replace: write "
                                    "your own as a frozen dataclass subclassing mpmd.Schedule, or an mpmd.Custom table)")
        schedules = got
    return memory_limit, schedules, lists["microbatches"], lists["virtual_stages"]


def _predict(base: DistributedFunction, args: tuple[Any, ...], schedule: Schedule, m: int, seg: SegmentCosts, p: int,
             memory_limit: int | None, remat: bool = False, resplit_from: int | None = None) -> list[Candidate]:
    """The candidate (rejected when over `memory_limit`), and with `remat` then also its remat variant
    (`resplit_from`: the step's own microbatch count, when `args` holds its batch re-split into `m`)."""
    c = Candidate(schedule, m)
    static: list[int] = []  # bytes of the step's arguments the actors read (parameters, optimizer state, inputs)
    try:
        if schedule.num_actors > p:
            raise ScheduleError(f"needs {schedule.num_actors} actors, the mesh has {p}")
        if getattr(schedule, "written_table", False) and m != schedule.min_microbatches:  # (a table names its microbatches)
            raise ScheduleError(f"a table written for exactly {schedule.min_microbatches} microbatches")
        if m < schedule.min_microbatches:
            raise ScheduleError(f"needs at least {schedule.min_microbatches} microbatches")
        own = getattr(schedule, "balance", None)  # a grouping the user fixed ((1, 3) or "even") is kept; else tune's
        kept = resolve_grouping(schedule, seg.num_segments, m, seg) if isinstance(own, tuple) or own == "even" else None
        ranked = [kept] if kept else ranked_groupings(schedule, m, seg)
        c.grouping = ranked[0]
        c.schedule = _with_balance(schedule, c.grouping, tuple(getattr(schedule, "remat", ())))
        sim = _simulate(base, args, c.schedule, _stage_costs(seg, c.grouping, c.schedule), p, static)
    except (ScheduleError, PipelineError) as e:
        c.rejected = _reason(str(e))
        return [c]
    except Exception as e:  # (tracing the step with this schedule or count failed in JAX or in the user's code)
        # (one line each: the reason is in the table; the traceback, 40 lines a candidate, only on DEBUG)
        log.warning("tune: %s m=%d rejected: tracing it raised %s: %.200s", c.name, c.num_microbatches, type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "")
        log.debug("tune: %s m=%d: the trace's traceback", c.name, c.num_microbatches, exc_info=True)
        again = (f" (its batch re-split from {resplit_from} microbatches: the second axis of every batch leaf was taken for "
                 f"the rows of a microbatch; if it is not, pass microbatches=[{resplit_from}])") if resplit_from else ""
        c.rejected = _reason(f"tracing it raised {type(e).__name__}: {str(e)}") + again
        return [c]
    over = _record(c, sim, memory_limit)
    floor = -(-sum(static) // p)
    if over and memory_limit is not None and floor > memory_limit:
        # What every grouping holds from start to end (parameters, optimizer state, the step's inputs) is more than
        # the mesh has under the limit: no other grouping (nor remat) can fit, so none is simulated.
        c.rejected += (f" ({FLOOR}: the step's parameters, optimizer state and inputs alone take "
                       f"{_size(sum(static))}, {_size(floor)} per actor at best)")
        return [c]
    if over:  # the fastest grouping is over the limit: the fastest of the next ones that fits, if one does
        for g in ranked[1:GROUPINGS_TRIED]:
            alt = Candidate(_with_balance(schedule, g, tuple(getattr(schedule, "remat", ()))), m, g)
            if not _record(alt, _simulate(base, args, alt.schedule, _stage_costs(seg, g, alt.schedule), p), memory_limit):
                c, over = alt, set()
                break
        else:
            if len(ranked) > 1:
                c.rejected += f" (and in the next {min(len(ranked), GROUPINGS_TRIED) - 1} groupings by predicted time)"
    if not over or not remat:
        return [c]
    # Another candidate: remat of stages of the actors over the limit (their backward recomputes their forward),
    # the set that recomputes the least forward time and brings every actor under the limit (all of them if none does).
    costs = group_costs(seg, c.grouping)
    for stages in remat_sets(c.schedule, over, costs.F):
        stages = tuple(sorted({*getattr(c.schedule, "remat", ()), *stages}))
        r = Candidate(_with_balance(c.schedule, c.grouping, stages), m, c.grouping)
        if not _record(r, _simulate(base, args, r.schedule, _stage_costs(seg, c.grouping, r.schedule), p), memory_limit):
            break
    return [c, r]


def _stage_costs(seg: SegmentCosts, grouping: tuple[int, ...], schedule: Schedule) -> Any:
    """The per-stage costs of `grouping`, the backward of the schedule's `remat` stages also paying their forward
    (as `mpmd.simulate` counts them)."""
    costs = group_costs(seg, grouping)
    remat = tuple(getattr(schedule, "remat", ()) or ())
    return remat_costs(costs, remat, schedule.split_backward) if remat else costs


def _record(c: Candidate, sim: Any, memory_limit: int | None) -> set[int]:
    """Put the simulation's figures on `c`, rejecting it when an actor's peak is over `memory_limit`; returns
    the actors over it."""
    c.predicted, c.bubble, c.peak_bytes = sim.step_time, sim.bubble, tuple(sim.peak_bytes or ())
    over = {a for a, b in enumerate(c.peak_bytes) if memory_limit is not None and b > memory_limit}
    if over:
        a = max(over, key=lambda x: c.peak_bytes[x])
        peak, limit = _sizes(c.peak_bytes[a], memory_limit)
        c.rejected = f"peak {peak} on actor {a} > memory_limit {limit}"
    return over


def _simulate(base: DistributedFunction, args: tuple[Any, ...], schedule: Schedule, costs: Any, p: int,
              static: list[int] | None = None) -> Any:
    """`simulate_programs` of the step compiled with `schedule`; `static` gets the bytes of every step argument some
    actor reads, each counted once (held by at least one actor all step long, whatever the grouping: a leaf two
    stages read is held twice by some groupings, once by others)."""
    outer, _ = base.with_schedule(schedule).trace(*args)
    plan = plan_step(outer, p)
    if static is not None:
        static[:] = [aval_nbytes(plan.avals[k]) for k, homes in zip(plan.arg_keys, plan.arg_homes) if homes]
    return simulate_programs(plan.programs, costs, name=repr(schedule))


def _xla_costs(base: DistributedFunction, args: tuple[Any, ...]) -> SegmentCosts:
    from mpmd.compiler.grouping import xla_segment_costs
    from mpmd.compiler.loop_tasks import analyse_loop_body, find_step_loop
    from mpmd.compiler.stages import split_stages
    from mpmd.observe.segments import batch_rows

    outer, _ = base.trace(*args)
    loop = find_step_loop(outer)
    body = analyse_loop_body(loop)
    return replace(xla_segment_costs(split_stages(body), body), microbatch_rows=batch_rows(loop))
