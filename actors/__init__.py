"""The `mpmd-actor` daemon: serves one node's devices to an mpmd controller.

Its rooms, from the top down (a room imports only rooms below it; none imports `mpmd`):

| module         | what it is for                                                                              |
|----------------|---------------------------------------------------------------------------------------------|
| daemon.py      | the process: `mpmd-actor` flags, control and data-plane sockets, requests served within a bound |
| cluster.py     | where a daemon started by a scheduler finds its place: SLURM's environment and the rendezvous |
| handlers.py    | the request API: `Actor.handle` and one method per request op, over the caller's `Session`    |
| checkpoint.py  | the `save` and `restore` ops: the arrays an actor holds, written and read with orbax         |
| profiler.py    | the `profile` op: a `jax.profiler` trace of this process, sent back as files                 |
| interpreter.py | the Program interpreter: the short, dumb loop over a step's Run/Send/Recv/Delete            |
| transfers.py   | how a Send or Recv moves its bytes on the data plane (shards, fast paths, timeouts, checks)  |
| request.py     | `RequestError` and the checked field getters every handler reads a request with             |
| cache.py       | the executable cache: checked, bounded compiles keyed by content hash                        |
| sandbox.py     | the compile checker: a blob is taken apart in a child process before the daemon touches it   |
| signatures.py  | the custom-call table: each kernel's operand and result types, checked in the checker's child |
| buffers.py     | the buffer table: buffer id -> array, or a future while it is produced or received          |
| stream.py      | in-order execution of Runs (the order token) and the per-instruction trace of a step        |
| spmd.py        | the actor's own device mesh, and arrays laid out over it                                     |

The wire form of every request is in transport/protocol.py; the Program's instructions and their codec
are in transport/program.py, shared with the controller.
"""
