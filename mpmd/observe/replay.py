"""A traced step replayed over its own Programs with its own measured times: the check that the simulators'
model of what waits for what is the runtime's.

Every Run takes the time it took and waits, after it could have started (the Run before it ended and its last
received input arrived), the gap it waited; every transfer takes from its value's Run ending to its arrival.
`replay_trace` returns the replayed step over the measured one: 1.0 when the Programs' dependencies (Runs in
order on an actor, a Run after the arrival of what it reads) explain the step, as the simulators assume; a
shortfall is time the model has no place for. (A 2-actor 1F1B step of the GPT: 0.997-0.999 with each Run's
gap counted from its last input's arrival, 0.977-0.981 counted from when the interpreter saw the inputs there.)

    with mesh.trace() as t:
        step(*args)
    replay_trace(t, step.compile(*args).plan.programs)      # ~1.0
"""

from __future__ import annotations

from typing import Any

from mpmd.errors import MpmdError
from mpmd.observe.trace import Trace
from transport.program import Recv, Run


def replay_trace(trace: Trace, programs: list[Any], step: int = -1) -> float:
    """The step `step` of `trace` replayed over `programs` (its compiled Programs, one per actor) with its own
    Runs' durations, gaps and hops, as a fraction of the measured step (from its first Run's start to its last
    Run's end). Raises MpmdError when the trace is not of these Programs (another number of Runs or labels)."""
    from mpmd.schedules.validation import replay_programs

    steps = trace.steps[step]
    if sorted(steps) != list(range(len(programs))):
        raise MpmdError(f"replay_trace: the trace's step has actors {sorted(steps)}, the programs {len(programs)}")
    took: dict[tuple[int, int], float] = {}
    made: dict[tuple[int, str], float] = {}
    first = min((r.start for x in steps.values() for r in x.runs), default=0.0)
    for a, x in steps.items():
        runs = [i for i, ins in enumerate(programs[a].instructions) if isinstance(ins, Run)]
        labels = [str(programs[a].instructions[i].label) for i in runs]
        if labels != [r.label for r in x.runs]:
            raise MpmdError(f"replay_trace: actor {a} ran {[r.label for r in x.runs][:6]}..., its program has "
                            f"{labels[:6]}...: not the trace of these programs")
        prev = first
        for i, r in zip(runs, x.runs):
            took[(a, i)] = r.end - r.start + max(0.0, r.start - r.could_start(prev))  # its gap, then its compute
            made[(a, r.label)] = r.end
            prev = r.end
    sends = {(a, t.tag): t for a, x in steps.items() for t in x.transfers if t.kind == "send"}
    hop: dict[tuple[int, int], float] = {}
    for a, x in steps.items():
        for t in x.transfers:
            s = sends.get((t.peer, t.tag)) if t.kind == "recv" else None
            if s is not None and (t.peer, s.label) in made:
                hop[(a, t.tag)] = max(0.0, t.end - made[(t.peer, s.label)])
    index = {(a, id(ins)): i for a, p in enumerate(programs) for i, ins in enumerate(p.instructions)}

    def transfer(a: int, r: Recv) -> float:
        return hop.get((a, r.tag), 0.0)

    rep = replay_programs(programs, lambda a, r: took[(a, index[(a, id(r))])], transfer)
    last = max((r.end for x in steps.values() for r in x.runs), default=first)
    return max(rep.end.values(), default=0.0) / (last - first) if last > first else 1.0


__all__ = ["replay_trace"]
