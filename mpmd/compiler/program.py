"""The Program IR (defined with its wire codec in `transport/program.py`, which the actors import too)."""

from transport.program import (
    Delete,
    Instruction,
    Label,
    Program,
    Recv,
    Run,
    Send,
    Task,
    decode_program,
    encode_program,
    format_programs,
)

__all__ = ["Delete", "Instruction", "Label", "Program", "Recv", "Run", "Send", "Task", "decode_program", "encode_program",
           "format_programs"]
