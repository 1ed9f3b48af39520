"""The Program IR and its wire codec: the one definition the compiler, the actors' interpreter, the
simulator and the traces share.

A compiled step is, per actor, an ordered list of instructions over local buffer ids:

| instruction                          | text form                             | wire form (msgpack array)                          |
|--------------------------------------|---------------------------------------|----------------------------------------------------|
| Run(exe, inputs, outputs, donate)    | ``RUN 1F3+1B3  [1, 2] -> [7]  (exe 0)``| ``["run", exe key, [in], [out], label, [donate]]`` |
| Send(buf, to_actor, tag)             | ``SEND b7 -> a1 #12 (0F3)``           | ``["send", buf, to, tag, label(, layout)]``        |
| Recv(buf, from_actor, tag, aval)     | ``RECV b9 <- a0 #12 float32[4, 8] (0F3)``| ``["recv", buf, from, tag, dtype, shape, label(, layout)]`` |
| Delete(bufs)                         | ``DEL b1 b2``                         | ``["del", [bufs], label]``                         |

* `Run` calls executable `exe` on `inputs` and stores its results as `outputs`; `donate` lists the input
  positions whose buffers the executable may reuse (each is the input's last use).
* `Send` / `Recv` are asynchronous point-to-point transfers matched by (peer, tag); the runtime widens a tag
  to (session, program, step, tag) so steps never mix. A later instruction that reads a received buffer
  waits for it; a send never blocks the next instruction.
* `Delete` frees buffers after their last use.

Every instruction carries a `Label`: the schedule tasks it does (``0F3`` is stage 0's forward of
microbatch 3; ``B`` a fused backward, ``I`` / ``W`` its input- and weight-gradient halves, as in
torch.distributed.pipelining; a fused Run lists several, ``1F3+1B3``) or the step phase it belongs to
(``pre``, ``post``, ``stack``, ``xfer``).
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field
from typing import Any

from transport.protocol import ALLOWED_DTYPES

TASK_KINDS = ("F", "B", "I", "W")
_TASK_RE = re.compile(r"^([0-9]{1,9})([FBIW])([0-9]{1,9})$")  # (ASCII digits: Unicode ones, "٠F٠", read as 0F0; a probe)


@dataclass(frozen=True, order=True)
class Task:
    """One schedule task: stage `stage`'s `kind` (F, B, I or W) for microbatch `mb`. Text form ``0F3``."""

    stage: int
    kind: str
    mb: int

    def __post_init__(self) -> None:
        # numpy integers (a user's table built with np.arange) as Python ints: they cross the wire in Programs
        for name in ("stage", "mb"):
            v = getattr(self, name)
            if type(v) is not int and isinstance(v, numbers.Integral) and not isinstance(v, bool):
                object.__setattr__(self, name, int(v))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Task:
        m = _TASK_RE.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"{text!r:.60} is not a task: write stage, kind (F, B, I or W), microbatch, e.g. '0F3' or '2W0'")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


PHASES = ("pre", "post", "slice", "stack", "xfer", "arg")


@dataclass(frozen=True)
class Label:
    """What an instruction belongs to: the schedule tasks it does, or a step phase; a fused Run lists its
    parts in order (`parts`, e.g. ("pre", "0F0") or ("1F3", "1B3"))."""

    kind: str = "task"  # "task" or one of PHASES
    tasks: tuple[Task, ...] = ()
    parts: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.parts:
            return "+".join(self.parts)
        return "+".join(map(str, self.tasks)) if self.tasks else self.kind

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(p for p in self.parts if p in PHASES) or ((self.kind,) if self.kind != "task" else ())

    @classmethod
    def of(cls, *tasks: Task) -> Label:
        return cls("task", tuple(tasks))

    @classmethod
    def fused(cls, labels: tuple[Label, ...]) -> Label:
        if len(labels) == 1:
            return labels[0]
        parts = tuple(p for lab in labels for p in str(lab).split("+"))
        return cls.parse("+".join(parts))

    @classmethod
    def parse(cls, text: str) -> Label:
        if text in PHASES:
            return cls(text)
        tokens = text.split("+")
        try:
            tasks = tuple(Task.parse(t) for t in tokens if t not in PHASES)
        except ValueError:
            return cls(text)  # free text (hand-written programs): kept for messages only
        if len(tokens) == len(tasks):
            return cls("task", tasks)
        return cls("task" if tasks else tokens[0], tasks, tuple(tokens))


@dataclass(frozen=True)
class Run:
    exe: Any  # index into the program's executables (compiler side) or the actor's executable key (wire side)
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    label: Label = Label()
    donate: tuple[int, ...] = ()

    def __str__(self) -> str:
        d = f" donate {list(self.donate)}" if self.donate else ""
        return f"RUN {self.label}  {list(self.inputs)} -> {list(self.outputs)}  (exe {self.exe}){d}"


@dataclass(frozen=True)
class Send:
    buf: int
    to_actor: int
    tag: int
    label: Label = Label("xfer")
    layout: tuple | None = None  # as Recv's: when set, the value goes shard by shard (the receiver expects that layout)

    def __str__(self) -> str:
        lay = f" layout {list(self.layout)}" if self.layout is not None else ""
        return f"SEND b{self.buf} -> a{self.to_actor} #{self.tag}{lay} ({self.label})"


@dataclass(frozen=True)
class Recv:
    buf: int
    from_actor: int
    tag: int
    dtype: str
    shape: tuple[int, ...]
    label: Label = Label("xfer")
    layout: tuple | None = None  # a PartitionSpec over the actor mesh, as a tuple (None: unsharded); it arrives shard by shard

    def __str__(self) -> str:
        lay = f" layout {list(self.layout)}" if self.layout is not None else ""
        return f"RECV b{self.buf} <- a{self.from_actor} #{self.tag} {self.dtype}{list(self.shape)}{lay} ({self.label})"


@dataclass(frozen=True)
class Delete:
    bufs: tuple[int, ...]
    label: Label = Label()

    def __str__(self) -> str:
        return "DEL " + " ".join(f"b{b}" for b in self.bufs)


Instruction = Run | Send | Recv | Delete


@dataclass
class Program:
    """One actor's part of a compiled step: `inputs`/`outputs` are the local buffer ids bound to the step's
    arguments and results on this actor; `consts` are small arrays (local buffer id -> numpy array) the
    actor keeps for the program's lifetime."""

    actor: int
    inputs: list[int]
    outputs: list[int]
    instructions: list[Instruction] = field(default_factory=list)
    consts: dict[int, Any] = field(default_factory=dict)
    executables: list[Any] = field(default_factory=list)  # what the Runs' exe indices name (compiler: templates)
    buffer_bytes: dict[int, int] = field(default_factory=dict)  # bytes of each local buffer (compiler side; not sent)
    buffer_keys: dict[int, Any] = field(default_factory=dict)  # the value each local buffer holds (compiler side; not sent)

    def __str__(self) -> str:
        head = f"actor {self.actor}: inputs {self.inputs} outputs {self.outputs}"
        if self.consts:
            head += f" consts {sorted(self.consts)}"
        return "\n".join([head, *(f"  {i:3d}  {ins}" for i, ins in enumerate(self.instructions))])

    def count(self, kind: type) -> int:
        return sum(isinstance(i, kind) for i in self.instructions)


def format_programs(programs: list[Program]) -> str:
    return "\n\n".join(str(p) for p in programs)


class ProgramError(ValueError):
    """A program's wire form is malformed."""


def encode_instruction(ins: Instruction, exe_keys: list[str] | None = None) -> list[Any]:
    label = str(ins.label)
    if isinstance(ins, Run):
        exe = exe_keys[ins.exe] if exe_keys is not None else ins.exe
        return ["run", exe, list(ins.inputs), list(ins.outputs), label, list(ins.donate)]
    if isinstance(ins, Send):
        wire = ["send", ins.buf, ins.to_actor, ins.tag, label]
        return wire + [[e if e is None or isinstance(e, str) else list(e) for e in ins.layout]] if ins.layout is not None else wire
    if isinstance(ins, Recv):
        wire = ["recv", ins.buf, ins.from_actor, ins.tag, ins.dtype, list(ins.shape), label]
        return wire + [[e if e is None or isinstance(e, str) else list(e) for e in ins.layout]] if ins.layout is not None else wire
    return ["del", list(ins.bufs), label]


def _ints(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        raise ProgramError(f"{what} must be a list of ints, got {x!r:.80}")
    return tuple(x)


def _int(x: Any, what: str) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise ProgramError(f"{what} must be an int, got {x!r:.80}")
    return x


def _layout(x: Any) -> tuple:
    if not isinstance(x, list) or not all(e is None or isinstance(e, str) or (isinstance(e, list) and all(isinstance(n, str) for n in e))
                                          for e in x):
        raise ProgramError(f"a recv layout is a list of None, axis names or lists of axis names, got {x!r:.80}")
    return tuple(tuple(e) if isinstance(e, list) else e for e in x)


def _label(x: Any) -> Label:
    if not isinstance(x, str):
        raise ProgramError(f"an instruction label must be a string, got {x!r:.80}")
    return Label.parse(x)


def decode_instruction(w: Any) -> Instruction:
    """The wire form back to an instruction (Run.exe is then the actor's executable key)."""
    if not isinstance(w, list) or not w or not isinstance(w[0], str):
        raise ProgramError(f"an instruction must be a list starting with its op, got {w!r:.80}")
    op = w[0]
    try:
        if op == "run":
            if len(w) not in (5, 6) or not isinstance(w[1], str):
                raise ProgramError("run needs [op, exe key, inputs, outputs, label(, donate)]")
            donate = _ints(w[5], "run donate") if len(w) == 6 else ()
            ins, outs = _ints(w[2], "run inputs"), _ints(w[3], "run outputs")
            if any(not 0 <= d < len(ins) for d in donate):
                raise ProgramError(f"run donates input positions {list(donate)} of {len(ins)} inputs")
            return Run(w[1], ins, outs, _label(w[4]), donate)
        if op == "send":
            if len(w) not in (5, 6):
                raise ProgramError("send needs [op, buf, to, tag, label(, layout)]")
            layout = _layout(w[5]) if len(w) == 6 else None
            return Send(_int(w[1], "send buf"), _int(w[2], "send peer"), _int(w[3], "send tag"), _label(w[4]), layout)
        if op == "recv":
            if len(w) not in (7, 8) or not isinstance(w[4], str):
                raise ProgramError("recv needs [op, buf, from, tag, dtype, shape, label(, layout)]")
            layout = _layout(w[7]) if len(w) == 8 else None
            shape = _ints(w[5], "recv shape")
            if w[4] not in ALLOWED_DTYPES or any(d < 0 for d in shape):  # (refused at load, not when the step runs)
                raise ProgramError(f"recv of dtype {w[4]!r:.40} and shape {list(shape)!r:.80}: the dtype must be one of "
                                   f"{sorted(ALLOWED_DTYPES)} and every dimension at least 0")
            return Recv(_int(w[1], "recv buf"), _int(w[2], "recv peer"), _int(w[3], "recv tag"), w[4], shape, _label(w[6]), layout)
        if op == "del":
            if len(w) != 3:
                raise ProgramError("del needs [op, bufs, label]")
            return Delete(_ints(w[1], "del bufs"), _label(w[2]))
    except IndexError:
        raise ProgramError(f"instruction {w!r:.80} is too short") from None
    raise ProgramError(f"unknown instruction {op!r}; known: run, send, recv, del")


def encode_program(prog: Program, program_id: int, exe_keys: list[str]) -> dict[str, Any]:
    """The msgpack-able form an actor loads; `exe_keys[i]` is the actor's key of executable i. Constants travel
    as array frames (their ids listed under "consts" in frame order)."""
    return {"id": program_id, "actor": prog.actor, "inputs": list(prog.inputs), "outputs": list(prog.outputs),
            "consts": sorted(prog.consts), "instrs": [encode_instruction(i, exe_keys) for i in prog.instructions]}


def decode_program(w: Any, const_arrays: list[Any] = ()) -> tuple[int, Program]:
    """The wire form back to (program id, Program) with `Run.exe` holding executable keys."""
    if not isinstance(w, dict):
        raise ProgramError("a program must be a map")
    pid = _int(w.get("id"), "program id")
    actor = _int(w.get("actor", 0), "program actor")
    instrs = w.get("instrs")
    if not isinstance(instrs, list):
        raise ProgramError("a program needs a list 'instrs'")
    const_ids = _ints(w.get("consts", []), "program consts")
    if len(const_ids) != len(const_arrays):
        raise ProgramError(f"program lists {len(const_ids)} constants but {len(const_arrays)} arrays came")
    inputs = list(_ints(w.get("inputs", []), "program inputs"))
    if len(set(const_ids)) != len(const_ids) or set(const_ids) & set(inputs):
        raise ProgramError(f"program constants need ids of their own, named once: {sorted(const_ids)[:20]} against inputs "
                           f"{sorted(inputs)[:20]} (a constant under an input's id was silently never read)")
    decoded = [decode_instruction(i) for i in instrs]
    seen: set[tuple[str, int, int]] = set()
    for ins in decoded:  # (two sends under one tag: the peer's receive took one, the other waited out the transfer
        # timeout; a probe)
        if isinstance(ins, (Send, Recv)):
            key = ("send", ins.to_actor, ins.tag) if isinstance(ins, Send) else ("recv", ins.from_actor, ins.tag)
            if key in seen:
                raise ProgramError(f"program {pid} has two {key[0]}s {'to' if key[0] == 'send' else 'from'} actor {key[1]} with tag "
                                   f"{key[2]}: a transfer's tag names it once per program and peer")
            seen.add(key)
    prog = Program(actor, inputs, list(_ints(w.get("outputs", []), "program outputs")), decoded, dict(zip(const_ids, const_arrays)))
    return pid, prog
