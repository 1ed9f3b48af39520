"""From per-actor unit lists to Programs: infer every transfer, number the buffers, free them after their last
use, and let executables reuse the buffers of inputs they read last (donation). Pure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpmd.compiler.avals import wire_shape_dtype
from mpmd.compiler.program import Delete, Label, Program, Recv, Run, Send
from mpmd.compiler.units import Key, MbIndex, Unit
from mpmd.errors import PipelineError
from transport.protocol import dtype_name


@dataclass
class Transfers:
    """Which actor sends each value each other actor reads: `source[(key, dst)] = src`."""

    source: dict[tuple[Key, int], int]
    producers: dict[Key, list[int]]

    def received(self, key: Key, actor: int) -> bool:
        return (key, actor) in self.source

    def sent_from(self, key: Key, actor: int) -> list[int]:
        return [dst for (k, dst), src in self.source.items() if k == key and src == actor]


def infer_transfers(per_actor: dict[int, list[Unit]], arg_homes: dict[Key, set[int]], consts: set[Key]) -> Transfers:
    producers: dict[Key, list[int]] = defaultdict(list)
    for k, homes in arg_homes.items():
        producers[k].extend(sorted(homes))
    for a, us in sorted(per_actor.items()):
        for u in us:
            for p in u.parts:
                for k in p.outputs:
                    if a not in producers[k]:
                        producers[k].append(a)
    source: dict[tuple[Key, int], int] = {}
    for a, us in per_actor.items():
        for u in us:
            for p in u.parts:
                for k in p.inputs:
                    if k in consts or a in producers[k] or (k, a) in source:
                        continue
                    if not producers[k]:
                        raise PipelineError(f"internal: value {k} read by {p.label} on actor {a} is produced nowhere")
                    source[(k, a)] = producers[k][0]
    return Transfers(source, dict(producers))


def wire_bytes(aval: Any) -> int:
    shape, dtype = wire_shape_dtype(tuple(aval.shape), aval.dtype)
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def build_programs(per_actor: dict[int, list[Unit]], num_actors: int, arg_keys: list[Key], arg_homes: dict[Key, set[int]],
                   output_keys: dict[int, list[Key]], avals: dict[Key, Any], transfers: Transfers,
                   templates: dict[Hashable, int]) -> list[Program]:
    """One Program per actor. `templates[unit template] = executable index`, shared by every actor."""
    tags: dict[tuple[Key, int], int] = {kd: t for t, kd in enumerate(transfers.source)}
    made_by: dict[tuple[int, Key], Label] = {}  # a received value's label: the Run that makes it on the actor that sends
    for a, us in per_actor.items():  # it (every RECV said "xfer": a probe)
        for u in us:
            for k in u.outputs:
                made_by.setdefault((a, k), u.label)
    programs = []
    for a in range(num_actors):
        local: dict[Key, int] = {}

        def buf(k: Key) -> int:
            if k not in local:
                local[k] = len(local)
            return local[k]

        inputs = [buf(k) for k in arg_keys if a in arg_homes.get(k, ())]
        instrs: list[Any] = []
        for (k, dst), src in transfers.source.items():
            if dst == a:
                shape, dtype = wire_shape_dtype(tuple(avals[k].shape), avals[k].dtype)
                instrs.append(Recv(buf(k), src, tags[(k, dst)], dtype_name(dtype), tuple(shape), made_by.get((src, k), Label("xfer"))))
        for k in arg_keys:
            if a in arg_homes.get(k, ()):
                for dst in transfers.sent_from(k, a):
                    instrs.append(Send(buf(k), dst, tags[(k, dst)], Label("xfer")))
        exes: dict[Hashable, int] = {}
        consts: dict[int, Any] = {}
        for u in per_actor.get(a, []):
            for k in u.inputs:
                if isinstance(k, MbIndex) and k not in local:
                    consts[buf(k)] = np.asarray(k.mb, np.int32)
            exe = exes.setdefault(u.template(), len(exes))
            instrs.append(Run(exe, tuple(buf(k) for k in u.inputs), tuple(buf(k) for k in u.outputs), u.label, u.donate))
            for k in u.outputs:
                for dst in transfers.sent_from(k, a):
                    instrs.append(Send(buf(k), dst, tags[(k, dst)], u.label))
        outputs = [buf(k) for k in output_keys.get(a, [])]
        prog = Program(a, inputs, outputs, _with_deletes(instrs, set(outputs)), consts)
        prog.executables = list(exes)
        prog.buffer_bytes = {b: (wire_bytes(avals[k]) if k in avals else 4) for k, b in local.items()}
        prog.buffer_keys = {b: k for k, b in local.items()}
        programs.append(prog)
    return programs


def _with_deletes(instrs: list[Any], keep: set[int]) -> list[Any]:
    """Insert a Delete after the last read of every buffer that is not a program output."""
    last: dict[int, int] = {}
    for i, ins in enumerate(instrs):
        if isinstance(ins, Run):
            for b in (*ins.inputs, *ins.outputs):
                last[b] = i
        elif isinstance(ins, (Send, Recv)):
            last[ins.buf] = max(last.get(ins.buf, -1), i)
    after: dict[int, list[int]] = defaultdict(list)
    for b, i in last.items():
        if b not in keep:
            after[i].append(b)
    out: list[Any] = []
    for i, ins in enumerate(instrs):
        out.append(ins)
        if after.get(i):
            out.append(Delete(tuple(sorted(after[i])), ins.label))
    return out


def choose_donations(per_actor: dict[int, list[Unit]], avals: dict[Key, Any], protected: dict[int, set[Key]]) -> None:
    """Let each Run reuse the buffer of an input it reads last on its actor, when an output has the same shape
    and dtype (XLA aliases them). Never a step input or output, a received value, a sent one or a constant
    (`protected[actor]`). In place: sets `unit.donate`."""
    for a, us in per_actor.items():
        last_use: dict[Key, int] = {}
        for i, u in enumerate(us):
            for k in u.inputs:
                last_use[k] = i
        for i, u in enumerate(us):
            free_outs = defaultdict(int)
            for k in u.outputs:
                av = avals.get(k)
                if av is not None:
                    free_outs[(tuple(av.shape), str(av.dtype))] += 1
            donate = []
            for pos, k in enumerate(u.inputs):
                av = avals.get(k)
                if av is None or k in protected.get(a, ()) or last_use.get(k) != i or isinstance(k, MbIndex):
                    continue
                sig = (tuple(av.shape), str(av.dtype))
                if free_outs[sig] > 0:
                    free_outs[sig] -= 1
                    donate.append(pos)
            u.donate = tuple(donate)
