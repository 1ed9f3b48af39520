"""The Program IR: per actor, an ordered list of instructions over local buffer ids.

| instruction                         | text form                         | wire form (msgpack array)                      |
|-------------------------------------|-----------------------------------|------------------------------------------------|
| Run(exe, inputs, outputs)           | ``RUN fwd s0 mb3  [1,2] -> [7]``  | ``["run", exe key, [in], [out], label]``       |
| Send(buf, to_actor, tag)            | ``SEND b7 -> a1 #12 (fwd s0 mb3)``| ``["send", buf, to, tag, label]``              |
| Recv(buf, from_actor, tag, aval)    | ``RECV b9 <- a0 #12 f32[4,8]``    | ``["recv", buf, from, tag, dtype, shape, label]`` |
| Delete(bufs)                        | ``DEL b1 b2``                     | ``["del", [bufs], label]``                     |

Every instruction carries a `Label` (stage, microbatch, kind), so the same Program is what the actor
interprets, what the simulator times, what the validator checks and what a timeline shows. Transfers are
matched by (peer, tag); the runtime widens each tag to (program, step, tag) so steps never mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Label:
    """What an instruction belongs to: kind is fwd, bwd, slice, stack, pre, post or xfer."""

    kind: str
    stage: int | None = None
    mb: int | None = None

    def __str__(self) -> str:
        parts = [self.kind]
        if self.stage is not None:
            parts.append(f"s{self.stage}")
        if self.mb is not None:
            parts.append(f"mb{self.mb}")
        return " ".join(parts)


@dataclass(frozen=True)
class Run:
    exe: int  # index into Program.executables
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    label: Label

    def __str__(self) -> str:
        return f"RUN {self.label}  {list(self.inputs)} -> {list(self.outputs)}  (exe {self.exe})"


@dataclass(frozen=True)
class Send:
    buf: int
    to_actor: int
    tag: int
    label: Label

    def __str__(self) -> str:
        return f"SEND b{self.buf} -> a{self.to_actor} #{self.tag} ({self.label})"


@dataclass(frozen=True)
class Recv:
    buf: int
    from_actor: int
    tag: int
    dtype: str
    shape: tuple[int, ...]
    label: Label

    def __str__(self) -> str:
        return f"RECV b{self.buf} <- a{self.from_actor} #{self.tag} {self.dtype}{list(self.shape)} ({self.label})"


@dataclass(frozen=True)
class Delete:
    bufs: tuple[int, ...]
    label: Label

    def __str__(self) -> str:
        return "DEL " + " ".join(f"b{b}" for b in self.bufs)


Instruction = Run | Send | Recv | Delete


@dataclass
class Program:
    """One actor's part of a compiled step.

    `inputs`/`outputs` are the local buffer ids bound to the step's arguments and results on this actor;
    `executables` are the serialized `jax.export` blobs its `Run`s index.
    """

    actor: int
    inputs: list[int]
    outputs: list[int]
    instructions: list[Instruction] = field(default_factory=list)
    executables: list[bytes] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"actor {self.actor}: inputs {self.inputs} outputs {self.outputs}"
        return "\n".join([head, *(f"  {i:3d}  {ins}" for i, ins in enumerate(self.instructions))])

    def encode(self, program_id: int, exe_keys: list[str]) -> dict[str, Any]:
        """The msgpack-able form the actor interprets; `exe_keys[i]` is the actor's key of executable i."""
        out = []
        for ins in self.instructions:
            label = str(ins.label)
            if isinstance(ins, Run):
                out.append(["run", exe_keys[ins.exe], list(ins.inputs), list(ins.outputs), label])
            elif isinstance(ins, Send):
                out.append(["send", ins.buf, ins.to_actor, ins.tag, label])
            elif isinstance(ins, Recv):
                out.append(["recv", ins.buf, ins.from_actor, ins.tag, ins.dtype, list(ins.shape), label])
            else:
                out.append(["del", list(ins.bufs), label])
        return {"id": program_id, "actor": self.actor, "inputs": self.inputs, "outputs": self.outputs, "instrs": out}

    def count(self, kind: type) -> int:
        return sum(isinstance(i, kind) for i in self.instructions)


def format_programs(programs: list[Program]) -> str:
    return "\n\n".join(str(p) for p in programs)
