"""A traced step replayed over its own Programs with its own measured times: the check that a trace and the
Programs agree, and that the gaps `fit_costs` reads are measured where the simulators charge them.

Every Run takes the time it took and waits, after it could have started (the Run before it ended and its last
received input arrived), the gap it waited; every transfer takes from its value's Run ending to its arrival.
With each gap counted from the arrival, a step replays to itself by construction (1.000 on every schedule of
`benchmarks/schedules.py`): the replay then checks the record (every Run's last input's arrival reported, the
trace's transfers matched to the Programs'), not the model, which the fitted and Monte Carlo predictions test.
Counted from when the interpreter saw the inputs there (as `fit_costs` did before the actors reported the
arrival), the same steps replayed to 0.72-0.98 of themselves: that time was in no gap.

    with mesh.trace() as t:
        step(*args)
    replay_trace(t, step.compile(*args).plan.programs)      # 1.0
"""

from __future__ import annotations

from typing import Any

from mpmd.errors import MpmdError, PipelineError
from mpmd.observe.trace import Trace, hop_times
from transport.program import Recv, Run


def replay_trace(trace: Trace, programs: list[Any], step: int = -1) -> float:
    """The step `step` of `trace` replayed over `programs` (its compiled Programs, one per actor) with its own
    Runs' durations, gaps and hops, as a fraction of the measured step (from its first Run's start to its last
    Run's end). Raises MpmdError when the trace is not of these Programs (other actors, Runs or labels)."""
    from mpmd.schedules.validation import replay_programs

    steps = trace._step(step)  # (an MpmdError naming what the trace holds)
    if sorted(steps) != list(range(len(programs))):
        raise MpmdError(f"replay_trace: the trace's step has actors {sorted(steps)}, the programs {len(programs)}")
    took: dict[int, float] = {}  # id of a Run instruction -> its gap and its compute
    first = min((r.start for x in steps.values() for r in x.runs), default=0.0)
    for a, x in steps.items():
        runs = [ins for ins in programs[a].instructions if isinstance(ins, Run)]
        if [str(ins.label) for ins in runs] != [r.label for r in x.runs]:
            raise MpmdError(f"replay_trace: actor {a} ran {[r.label for r in x.runs][:6]}..., its program has "
                            f"{[str(ins.label) for ins in runs][:6]}...: not the trace of these programs")
        prev = first
        for ins, r in zip(runs, x.runs):
            took[id(ins)] = r.end - r.start + max(0.0, r.start - r.could_start(prev))
            prev = r.end
    hops = hop_times(steps)

    def transfer(a: int, r: Recv) -> float:
        return max(0.0, hops[(r.from_actor, a, r.tag)][0]) if (r.from_actor, a, r.tag) in hops else 0.0

    rep = replay_programs(programs, lambda a, r: took[id(r)], transfer)
    if rep.stuck:
        raise PipelineError(f"replay_trace: the programs cannot run to the end (actors {sorted(rep.stuck)} stuck)")
    last = max((r.end for x in steps.values() for r in x.runs), default=first)
    return max(rep.end.values(), default=0.0) / (last - first) if last > first else 1.0


__all__ = ["replay_trace"]
