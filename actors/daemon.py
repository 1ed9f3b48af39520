"""`mpmd-actor`: the per-node daemon.

    mpmd-actor --listen tcp://0.0.0.0:5555 --actor-id 0            # one per node, e.g. under srun
    mpmd-actor --listen ipc:///tmp/a0.sock --cpu-devices 4          # a local actor with 4 CPU devices

On start it prints one line ``MPMD_ACTOR_READY <endpoint> <p2p endpoint>`` to stdout (``:0`` binds a free
port, and the line says which). It serves requests until a ``shutdown`` request, SIGTERM or SIGINT, or
(with ``--parent-pid``) until that process is gone. A bad request gets an error reply; it never stops the
daemon. ``kill -USR1 <pid>`` writes every thread's stack to stderr (the controller of a local mesh does this
for an actor that stops answering, and shows the stacks in the error). With ``MPMD_ACTOR_PROFILE=<prefix>``
in its environment, a daemon profiles its event-loop thread (cProfile) into ``<prefix>.<actor id>`` on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpmd-actor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="tcp://127.0.0.1:5555", help="control endpoint (tcp://host:port, ipc://path); port 0 picks one")
    p.add_argument("--actor-id", type=int, default=0, help="this actor's index in the mesh")
    p.add_argument("--cpu-devices", type=int, default=None, help="give this actor N host (CPU) devices")
    p.add_argument("--cpus", default=None,
                   help="comma-separated cores to pin this daemon to (XLA's CPU thread pool is sized to them; one core "
                        "also turns off Eigen's multi-threading)")
    p.add_argument("--platform", default=None, help="JAX platform to use (cpu, cuda); default: JAX's choice")
    p.add_argument("--devices", default=None, help="comma-separated visible GPU indices (sets CUDA_VISIBLE_DEVICES)")
    p.add_argument("--p2p", default="tcp", choices=["tcp", "none"],
                   help="data plane to other actors: 'tcp' opens ZeroMQ endpoints (the controller then picks tcp, shm or "
                        "nccl per peer); 'none' has no data plane")
    p.add_argument("--ipc-dir", default=None, help="also bind the data plane on an ipc socket in this directory (same-host peers use it)")
    p.add_argument("--transfer-timeout", type=float, default=300.0,
                   help="seconds a receive waits for its peer before the step fails (the controller may change it)")
    p.add_argument("--p2p-host", default=None, help="address peers reach this actor's data plane on (default: the --listen host)")
    p.add_argument("--cache-dir", default=None, help="JAX persistent compilation cache directory")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--max-message-mb", type=int, default=8192, help="drop connections that send larger messages")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def configure_environment(args: argparse.Namespace) -> None:
    """Must run before JAX is imported: XLA reads these at start-up."""
    if args.cpus:
        try:
            cores = {int(c) for c in args.cpus.split(",") if c.strip()}
            os.sched_setaffinity(0, cores)
        except (ValueError, OSError) as e:
            raise SystemExit(f"mpmd-actor: cannot pin to cores {args.cpus!r}: {e}") from None
        if len(cores) == 1:
            flags = os.environ.get("XLA_FLAGS", "")
            os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1".strip()
    if args.cpu_devices:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.platform:
        os.environ["JAX_PLATFORMS"] = args.platform
    if args.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.devices


async def serve(args: argparse.Namespace) -> None:
    import jax
    import zmq
    import zmq.asyncio

    # Exported executables carry explicit dtypes, so 64-bit support only stops put() from narrowing
    # float64/int64 arrays; it changes nothing the controller lowered.
    jax.config.update("jax_enable_x64", True)
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    from actors.actor import Actor, format_exception
    from transport.control import bind_router
    from transport.p2p import DataPlane
    from transport.protocol import ProtocolError, decode, encode, error_reply

    log = logging.getLogger("mpmd.actor")
    ctx = zmq.asyncio.Context.instance()
    sock, endpoint = bind_router(ctx, args.listen, args.max_message_mb * 1024 * 1024)
    p2p = None
    if args.p2p != "none":
        host = args.p2p_host or (args.listen.split("://", 1)[1].rsplit(":", 1)[0] if args.listen.startswith("tcp://") else "127.0.0.1")
        if host in ("*", "0.0.0.0"):
            host = "127.0.0.1"
        device = jax.devices()[0]
        from actors.buffers import release_host_memory

        p2p = DataPlane(args.actor_id, host, args.ipc_dir, nccl_device=device if device.platform == "gpu" else None,
                        release_hook=release_host_memory)
        await p2p.start()
    actor = Actor(args.actor_id, p2p, transfer_timeout=args.transfer_timeout)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def reply(identity: bytes, frames: list) -> None:
        try:
            await sock.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as e:  # the controller went away (ROUTER_MANDATORY: host unreachable)
            log.warning("could not reply to %r: %s", identity, e)

    async def handle(identity: bytes, frames: list) -> None:
        req_id = None
        try:
            msg = decode(frames)
            req_id = msg.header.get("id")
            if msg.op == "shutdown":
                await reply(identity, encode({"op": "reply", "id": req_id, "ok": True}))
                stop.set()
                return
            header, arrays = await actor.handle(msg)
            await reply(identity, encode({"op": "reply", "id": req_id, "ok": True, **header}, arrays))
        except asyncio.CancelledError:
            return
        except Exception as e:  # every failure becomes an error reply; the daemon keeps serving
            actor.errors += 1
            if not isinstance(e, ProtocolError):
                log.info("request %s failed: %s", req_id, e)
            try:
                await reply(identity, encode(error_reply(req_id, e, format_exception(e), actor_id=args.actor_id)))
            except Exception:  # an unencodable id or message: say it plainly
                await reply(identity, encode({"op": "error", "id": None, "error": "ProtocolError", "message": str(e)[:1000]}))

    tasks: set[asyncio.Task[None]] = set()

    async def receive() -> None:
        while True:
            identity, *frames = await sock.recv_multipart(copy=False)
            t = loop.create_task(handle(identity.bytes, frames))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    async def watch_parent() -> None:
        while args.parent_pid:
            try:
                os.kill(args.parent_pid, 0)
            except ProcessLookupError:
                log.warning("parent process %d is gone; shutting down", args.parent_pid)
                stop.set()
                return
            await asyncio.sleep(0.5)

    print(f"MPMD_ACTOR_READY {endpoint} {p2p.endpoint()['tcp'] if p2p else '-'}", flush=True)
    receiver = loop.create_task(receive())
    watcher = loop.create_task(watch_parent())
    await stop.wait()
    receiver.cancel()
    watcher.cancel()
    for t in list(tasks):
        t.cancel()
    await asyncio.sleep(0)
    if p2p is not None:
        p2p.close()
    sock.close(linger=0)
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://") :])
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_environment(args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format=f"[actor {args.actor_id}] %(levelname)s %(name)s: %(message)s")
    profile_to = os.environ.get("MPMD_ACTOR_PROFILE")  # a path prefix: cProfile the event loop thread into <prefix>.<id>
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        import uvloop

        uvloop.run(serve(args))
    except ImportError:
        asyncio.run(serve(args))
    if profile_to:
        profiler.disable()
        profiler.dump_stats(f"{profile_to}.{args.actor_id}")
    # Exit now, even if XLA is still running a computation nobody will read (the controller is gone or
    # asked us to stop): a normal interpreter exit would wait for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
