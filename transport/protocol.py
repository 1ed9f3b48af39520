"""Wire protocol between the controller and `mpmd-actor` daemons (and between actors).

Every message is a ZeroMQ multipart message::

    frame 0        msgpack map: the header (always has "v" and "op")
    frames 1..n    raw array payloads, one per entry of header["arrays"], C-contiguous, little-endian

`header["arrays"]` is a list of ``{"dtype": name, "shape": [..]}``; the payload frames follow in the same
order. Nothing is ever unpickled: the header is msgpack (no extension types), payloads are raw bytes
interpreted only as the numeric dtypes in `ALLOWED_DTYPES`.

Requests carry an integer ``"id"``; the reply echoes it with ``"op": "reply"`` (and ``"ok": true``) or
``"op": "error"`` (with ``"error"``: the exception class name, ``"message"``, ``"traceback"``, and ``"task"``: the
label of the Program's Run that raised it, e.g. ``"1F3"``, when one did). Every request
gets its reply within the daemon's ``request_timeout`` (an error reply if need be), counted for the requests that
wait on a session's earlier steps (`QUEUED_BEHIND_STEPS`) from when the steps running at their arrival ended. Every request but ping
and hello carries ``session`` (the controller's random id from ``hello``); a session answers only the
authenticated client (CURVE key) that opened it, and a request touches only its session's state. What every
session shares (connect_peers, nccl_ids, shutdown, profile, building the device mesh) is changed only by
the key that owns the daemon's job (the first session's key, until its last session closes; a local mesh's
key) or an operator key (``mpmd-actor --admin-key``). A key holds at most 16 sessions per daemon.

| op              | request fields                                          | reply fields                                  |
|-----------------|---------------------------------------------------------|-----------------------------------------------|
| ping            | -                                                       | actor_id, time                                |
| info            | -                                                       | actor_id, pid, platform, devices, jax_version,|
|                 |                                                         | sessions, request_timeout, compile_timeout,   |
|                 |                                                         | authenticated, insecure, p2p: {tcp, ipc, host,|
|                 |                                                         | shm, nccl, key (its data-plane public key),   |
|                 |                                                         | shm_prefix} or nil (tcp is nil: ipc only)     |
| hello           | session (opens it)                                      | as info                                       |
| bye             | - (closes the session: its buffers, programs, steps)    | closed                                        |
| put             | buf, 1 array frame                                      | nbytes                                        |
| get             | buf, or bufs: [int]                                     | 1 array frame per buffer                      |
| wait            | bufs: [int]                                             | ready: int (once they are computed)           |
| delete          | bufs: [int]                                             | deleted: int                                  |
| compile         | digest: SHA-256 hex of the blob, 1 frame (uint8):       | exe: content hash, cached: bool               |
|                 | serialized `jax.export` blob (checked in a child        |                                               |
|                 | process, custom calls against an allow-list)            |                                               |
| run             | exe, inputs: [buf], outputs: [buf]                      | outputs: [{dtype, shape}]                     |
| load_program    | program: encoded Program (see transport/program.py)          | program: its id                               |
| run_program     | program, step, inputs: [buf, -1 or -2], outputs: [buf], | outputs: [{dtype, shape}]                     |
|                 | inline: [slot] (array frames for -1 inputs),            |                                               |
|                 | shm_inputs: [{name, offset, nbytes, dtype, shape,       |                                               |
|                 | [layout]}] (one per -2 input: a segment named with the  |                                               |
|                 | session's input prefix; see actors/inputs.py),          |                                               |
|                 | prologue: [instruction], sync: bool (await each send    |                                               |
|                 | where it stands; default false)                         |                                               |
| input_shm       | prefix: /mpmd-in-<hex>-<hex>-<actor>- (the names this   | prefix                                        |
|                 | session's shared-memory inputs will have; set once)     |                                               |
| connect_peers   | peers: {actor_id: {address, route: tcp, shm or nccl,   | connected: [actor_id], routes: {id: route}    |
|                 | key: the peer's data-plane public key, shm_prefix,      |                                               |
|                 | [max_message: its --max-message-mb in bytes],           |                                               |
|                 | [nccl_out, nccl_in: NCCL unique ids]}},                 |                                               |
|                 | timeout: seconds a receive may wait                     |                                               |
| nccl_ids        | count (0-4096)                                          | ids: [NCCL unique id as 128 ints]             |
| abort           | program, step; or neither (every step of the session)  | aborted: bool, steps: int (cancels them)      |
| stats           | -                                                       | buffers, bytes, executables, compiles, hits,  |
|                 |                                                         | programs, requests, errors, running, p2p,     |
|                 |                                                         | shm_inputs, shm_input_bytes                   |
| shutdown        | - (the owner's or an operator's session)                | - (the daemon exits after replying)           |

Actor-to-actor data-plane messages (transport/p2p/plane.py) use the same framing, with ``src`` (sender actor
id; when the data plane is authenticated the receiver takes the sender from its CURVE key and refuses a
``src`` that disagrees) and ``key`` (the transfer key, a list of ints): ``data`` (one array frame), ``shm``
(seg, name, size and the array's metadata; the payload is in shared memory; name must be the sender's
``shm_prefix`` + receiver id + ``-`` + seg; size covers the payload and the control page after it, where the
receiver marks the segment released once its last view is gone), ``shm_ack`` (seg: released; accepted, no
longer sent), ``nccl``
(seq and the array's metadata; the payload goes over NCCL), ``refused`` (reason: the receiver dropped that
arrival, e.g. its sender is over its unclaimed-arrival limit).
"""

from __future__ import annotations

import gc
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

# Requests that may wait on a session's steps dispatched before them (a step for its inputs and its turn, a get or
# wait for the buffers a step makes): the daemon's --request-timeout counts for them from when the session's steps
# running at their arrival ended, not from their arrival, and the controller's watchdog counts the same way (a loop
# 45 steps ahead, or behind a loader of 1 s, failed healthy steps as timed out: a probe).
QUEUED_BEHIND_STEPS = ("run_program", "get", "wait")

# Set in a daemon's environment while it imports a loader's module (actors/daemon.py): RemoteMesh.local and .ray refuse
# to start then (mpmd/runtime/mesh.py), or a script naming itself as the loader module would start actors without end.
IMPORTING_LOADER = "MPMD_ACTOR_IMPORTING_LOADER"

PROTOCOL_VERSION = 6  # 2: an shm notice's size includes the segment's control page (no shm_ack sent); 3: compact
# data headers on same-host links (transport/p2p/link.py), their dtype numbered by link.COMPACT_DTYPES; 4: a big reply
# is announced by a 'coming' message first (transport/control.py); 5: an actor's share of a failed step is named by
# what it is (StepAborted, HeldByLoader, WaitedInVain, NothingCame; StillComputing since: mpmd/step.py `_echo_rank` reads the names); 6: an
# actor adds a random part of its own to the shared-memory input prefix a session names ('input_shm' replies with it;
# the controller names its segments with the reply's prefix: actors/inputs.py)
MAX_HEADER_BYTES = 16 * 1024 * 1024
# What ZeroMQ counts against MAXMSGSIZE beyond a frame's own bytes: CURVE checks the encrypted frame, 33 bytes longer
# (a MESSAGE command's name, flags, nonce and box). A router's MAXMSGSIZE is its limit plus this margin, so that a
# frame of exactly --max-message-mb, which the senders let through, is not dropped unseen (a review).
FRAME_MARGIN_BYTES = 64
MAX_IDS = 65536  # ids one list of a request may name ('get', 'wait', 'delete', 'run': a daemon walks it on its event loop)
MAX_DIMS, MAX_BYTES = 32, 2**60  # an array's rank and bytes (a zero-size one's nonzero dimensions too) numpy can hold

ALLOWED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
ALLOWED_DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
# ml_dtypes' narrow types, as JAX takes them: one byte per element in numpy (the 4- and 2-bit ones too), so they
# travel as bytes like int8 (quantized weights, fp8 and fp4 activations); those this ml_dtypes lacks are left out.
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e3m4", "float8_e4m3fnuz", "float8_e4m3b11fnuz",
              "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn", "int4", "uint4", "int2", "uint2"):
    if hasattr(ml_dtypes, _name) and np.dtype(getattr(ml_dtypes, _name)).itemsize == 1:
        ALLOWED_DTYPES[_name] = np.dtype(getattr(ml_dtypes, _name))


# Of those, the ones a device holds packed (two or four to a byte; one byte each in numpy).
PACKED_DTYPES = frozenset(n for n in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn") if n in ALLOWED_DTYPES)


class ProtocolError(ValueError):
    """A message that does not follow this protocol (bad header, unknown dtype, wrong payload size)."""


@dataclass
class Message:
    """A decoded message: its msgpack header and its array payloads (read-only numpy views)."""

    header: dict[str, Any]
    arrays: list[np.ndarray] = field(default_factory=list)

    @property
    def op(self) -> str:
        return self.header["op"]


_WIRE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in ALLOWED_DTYPES.items()}  # (dtype.name costs ~2 us a call)


LOADER_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # a data loader, "package.module:function"


def leaf_name_problem(name: str) -> str | None:
    """Why `name` cannot name a leaf an actor loads (a loader builds a path of it, as README's f"/data/{leaf}/..." does:
    "../x" read a file outside its directory; a probe), or None. Both sides check it: the controller as the step is
    made, the actor for whatever a request says."""
    if any(c in name for c in "/\\\0") or name in (".", ".."):
        return (f"leaf name {name!r:.80} could name a file outside a loader's directory (it holds '/', '\\' or a NUL, "
                "or is '.' or '..'): give the batch's leaves plain keys")
    return None


def dtype_name(dtype: Any) -> str:
    """The wire name of a dtype, or ProtocolError if it cannot travel."""
    name = _WIRE_NAMES.get(dtype) if isinstance(dtype, np.dtype) else None
    if name is None:
        name = np.dtype(dtype).name
        if name not in ALLOWED_DTYPES:
            raise ProtocolError(f"dtype {name!r} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
    return name


def dtype_from_name(name: Any) -> np.dtype:
    if not isinstance(name, str) or name not in ALLOWED_DTYPES:
        raise ProtocolError(f"unknown dtype {name!r}; allowed: {sorted(ALLOWED_DTYPES)}")
    return ALLOWED_DTYPES[name]


def aval_header(shape: Sequence[int], dtype: Any) -> dict[str, Any]:
    return {"dtype": dtype_name(dtype), "shape": [int(d) for d in shape]}


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list[Any]:
    """Header plus arrays -> list of frames. Payload frames are zero-copy views when contiguous."""
    metas = []
    payloads: list[Any] = []
    for a in arrays:
        a = np.asarray(a)
        metas.append({"dtype": dtype_name(a.dtype), "shape": list(a.shape)})
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        # 0-d and empty arrays still get a frame (possibly empty) so counts always match.
        payloads.append(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
    full = {**header, "v": PROTOCOL_VERSION}
    if metas:
        full["arrays"] = metas
    return [msgpack.packb(full, use_bin_type=True), *payloads]


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    return memoryview(buf)


BIG_HEADER_BYTES = 256 * 1024  # a header this long is unpacked with the cyclic GC paused (see _unpack)


def _unpack(head: memoryview) -> Any:
    """msgpack -> objects. A long header is unpacked with the cyclic GC paused (msgpack's own advice for large
    data): its millions of fresh lists each counted toward a collection, and the collections walked the whole heap —
    a guest's 8 MB header of a million tiny instructions took a daemon 1.2-1.5 s on its event loop (8 s once in the
    full suite, its heap grown) against 0.36 with the GC paused; 16 MiB of empty lists 6.8-8.4 s against 1.5-1.7,
    near the owner's 10 s heartbeat. Unpacking makes no cycles: nothing is left for the GC to find."""
    pause = head.nbytes >= BIG_HEADER_BYTES and gc.isenabled()
    if pause:
        gc.disable()
    try:
        return msgpack.unpackb(head, raw=False, strict_map_key=False)
    finally:
        if pause:
            gc.enable()


def parse_header(frame: Any) -> dict[str, Any]:
    """Frame 0 -> the header map, validating size, msgpack, version and op."""
    head = _buffer(frame)
    if head.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {head.nbytes} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        header = _unpack(head)
    except Exception as e:  # msgpack raises several types for garbage (some without a message)
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}{': ' if str(e) else ''}{e}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    if header.get("v") != PROTOCOL_VERSION or type(header.get("v")) is not int:
        raise ProtocolError(f"protocol version {header.get('v')!r} is not supported (expected {PROTOCOL_VERSION})")
    if not isinstance(header.get("op"), str):
        raise ProtocolError("header has no string 'op'")
    rid = header.get("id")
    # (every reply echoes it: a 15 MiB id in each ping a client never reads queued 15 MiB per reply on the daemon)
    if rid is not None and not (type(rid) is int and -2**63 <= rid < 2**64):
        raise ProtocolError(f"header 'id' must be an integer (a request number) or absent, got {type(rid).__name__} {rid!r:.40}")
    return header


def message_id(frames: Sequence[Any]) -> int | None:
    """The integer 'id' a message's header names even when the message is refused (another protocol version,
    a bad field), so that the error reply can answer it; None when the header cannot be read at all."""
    try:
        head = _buffer(frames[0])
        if head.nbytes > MAX_HEADER_BYTES:
            return None
        header = _unpack(head)
    except Exception:
        return None
    rid = header.get("id") if isinstance(header, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) and -2**63 <= rid < 2**64 else None


def array_spec(meta: Any, i: int = 0) -> tuple[np.dtype, list[int], int]:
    """One entry of header["arrays"] -> (dtype, shape, payload bytes), or ProtocolError."""
    if not isinstance(meta, dict) or not isinstance(meta.get("shape"), list):
        raise ProtocolError(f"array {i}: metadata must be a map with 'dtype' and 'shape'")
    dtype = dtype_from_name(meta.get("dtype"))
    shape = meta["shape"]
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"array {i}: bad shape {shape!r:.200} (a shape is a list of non-negative ints)")
    if len(shape) > MAX_DIMS or math.prod(d for d in shape if d) * dtype.itemsize > MAX_BYTES:  # (what numpy could not make)
        raise ProtocolError(f"array {i}: {dtype.name}{shape!r:.200} has more than {MAX_DIMS} dimensions or would take more "
                            f"than {MAX_BYTES} bytes (a zero-size one counts its other dimensions)")
    return dtype, shape, math.prod(shape) * dtype.itemsize


def array_specs(header: dict[str, Any]) -> list[tuple[np.dtype, list[int], int]]:
    metas = header.get("arrays", [])
    if not isinstance(metas, list):
        raise ProtocolError("header field 'arrays' must be a list")
    if len(metas) > MAX_IDS:  # (600,000 empty ones held a daemon's loop for 20 s: a probe; a pytree's leaves go in one)
        raise ProtocolError(f"a message carries at most {MAX_IDS} arrays, this one announces {len(metas)}; send them in "
                            "several requests")
    return [array_spec(m, i) for i, m in enumerate(metas)]


def decode(frames: Sequence[Any]) -> Message:
    """Frames -> Message, validating version, op, array metadata and payload sizes."""
    if not frames:
        raise ProtocolError("empty message: expected a msgpack header frame")
    header = parse_header(frames[0])
    specs = array_specs(header)
    if len(specs) != len(frames) - 1:
        raise ProtocolError(f"header announces {len(specs)} arrays but {len(frames) - 1} payload frames came")
    arrays = []
    for i, ((dtype, shape, expected), frame) in enumerate(zip(specs, frames[1:])):
        buf = _buffer(frame)
        if buf.nbytes != expected:
            raise ProtocolError(f"array {i}: payload has {buf.nbytes} bytes, {dtype.name}{shape} needs {expected}")
        try:
            arrays.append(np.frombuffer(buf, dtype=dtype).reshape(shape) if expected else np.zeros(shape, dtype))
        except (ValueError, TypeError, MemoryError) as e:  # (whatever numpy refuses is the sender's fault, said as such)
            raise ProtocolError(f"array {i}: cannot make {dtype.name}{shape!r:.200}: {e}") from None
    return Message(header, arrays)


MAX_ERROR_TEXT = 8192  # characters of an error reply's message, and of its traceback's end (a request's echo is bounded)


def error_reply(req_id: Any, exc: BaseException, tb: str, **extra: Any) -> dict[str, Any]:
    message = str(exc)
    if len(message) > MAX_ERROR_TEXT:
        message = f"{message[:MAX_ERROR_TEXT]}... ({len(message) - MAX_ERROR_TEXT} more characters)"
    if len(tb) > MAX_ERROR_TEXT:
        tb = f"...\n{tb[-MAX_ERROR_TEXT:]}"
    return {"op": "error", "id": req_id, "error": type(exc).__name__, "message": message, "traceback": tb, **extra}
