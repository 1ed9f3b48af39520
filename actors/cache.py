"""Compiled-executable cache keyed by the content hash of a serialized `jax.export` blob and how it is
compiled (donated inputs; with a device mesh, its inputs' and outputs' layouts).

The same blob compiles once per actor and way; JAX's persistent compilation cache (when the daemon is given a
cache directory) also makes a restarted daemon skip XLA compilation.

Only checked bytes reach the compiler: a blob must come with the SHA-256 digest of its bytes (checked before
anything else), is taken apart and its custom calls checked in a child process first (`actors.sandbox`),
and its compile is bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from typing import Any

import jax
from jax import export

from actors import spmd
from actors.sandbox import BlobChecker, BlobRefused
from actors.stream import TOKEN_AVAL, ordered

log = logging.getLogger(__name__)


class UnknownExecutableError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown executable"


def content_hash(blob: bytes | memoryview) -> str:
    return hashlib.sha256(blob).hexdigest()[:32]


def digest(blob: bytes | memoryview) -> str:
    """What a `compile` request carries beside its blob: the SHA-256 of the bytes, in hex."""
    return hashlib.sha256(blob).hexdigest()


class ExecutableCache:
    """`ordered`: every executable takes and returns an order token first (see actors/stream.py)."""

    def __init__(self, device: Any, checker: BlobChecker | None = None, compile_timeout: float = 600.0, ordered: bool = False) -> None:
        self._device = device
        self._checker = checker
        self._ordered = ordered
        self.mesh: Any = None  # the actor's device mesh, once the controller names one
        self.compile_timeout = compile_timeout
        self._compiled: dict[str, Any] = {}
        self._compiling: dict[str, asyncio.Future[Any]] = {}
        self.compiles = 0
        self.hits = 0
        self.refused = 0
        self.check_seconds = 0.0

    def __len__(self) -> int:
        return len(self._compiled)

    def _compile(self, blob: bytes, donate: tuple[int, ...], in_layouts: list | None, out_layouts: list | None) -> Any:
        exp = export.deserialize(bytearray(blob))
        fn, avals = exp.call, list(exp.in_avals)
        kwargs: dict[str, Any] = {}
        if self.mesh is not None:  # on a device mesh every input has a layout (replicated unless said otherwise)
            shard = lambda w: spmd.sharding_of(self.mesh, spmd.spec_from_wire(w), self._device)  # noqa: E731
            kwargs["in_shardings"] = tuple(shard(w) for w in (in_layouts if in_layouts is not None else [None] * len(avals)))
            if out_layouts is not None and any(w is not None for w in out_layouts):
                kwargs["out_shardings"] = tuple(None if w is None else shard(w) for w in out_layouts)  # None: XLA chooses
        if self._ordered:
            fn, avals, donate = ordered(fn), [TOKEN_AVAL, *avals], tuple(d + 1 for d in donate)
            for name in ("in_shardings", "out_shardings"):
                if name in kwargs:
                    kwargs[name] = (spmd.sharding_of(self.mesh, None, self._device), *kwargs[name])
        with jax.default_device(self._device):
            return jax.jit(fn, donate_argnums=donate, **kwargs).lower(*avals).compile()

    def out_layouts(self, key: str) -> list[Any]:
        """The layouts XLA chose for an executable's outputs (wire form), without the order token."""
        outs = list(self.get(key).output_shardings)
        if self._ordered:
            outs = outs[1:]
        return [spmd.spec_to_wire(getattr(s, "spec", None)) or [] for s in outs]

    async def compile(self, blob: bytes | memoryview, expected_digest: str | None = None, donate: tuple[int, ...] = (),
                      in_layouts: list | None = None, out_layouts: list | None = None) -> tuple[str, bool]:
        """Compile `blob` (or find it cached), letting the inputs at `donate` share buffers with outputs and, on a
        device mesh, taking inputs laid out as `in_layouts` (outputs as `out_layouts` where given, else as XLA
        chooses). Returns (key, was_cached). With a checker, `expected_digest` must be the blob's `digest`."""
        if self._checker is not None or expected_digest is not None:
            got = hashlib.sha256(blob).hexdigest()
            if expected_digest != got:
                self.refused += 1
                raise BlobRefused(f"the executable's digest does not match its bytes ('digest' {expected_digest!r:.80}, "
                                  f"the {len(blob)} bytes hash to {got}); a compile request carries the SHA-256 of its blob")
        how = ""
        if donate:
            how += "-d" + ".".join(map(str, donate))
        if in_layouts is not None or out_layouts is not None:
            how += "-l" + hashlib.sha256(json.dumps([in_layouts, out_layouts]).encode()).hexdigest()[:16]
        key = content_hash(blob) + how
        if key in self._compiled:
            self.hits += 1
            return key, True
        if key in self._compiling:
            self.hits += 1
            await asyncio.shield(self._compiling[key])
            return key, True
        fut = asyncio.get_running_loop().create_future()
        self._compiling[key] = fut
        try:
            data = bytes(blob)
            if self._checker is not None:
                try:
                    result = await self._checker.check(data)
                except BlobRefused:
                    self.refused += 1
                    raise
                self.check_seconds += result.seconds
            try:
                compiled = await asyncio.wait_for(asyncio.to_thread(self._compile, data, tuple(donate), in_layouts, out_layouts),
                                                  self.compile_timeout)
            except TimeoutError:
                log.warning("executable %s did not compile within %g s; its compile thread is left running", key, self.compile_timeout)
                raise BlobRefused(f"the executable did not compile within {self.compile_timeout:g} s (mpmd-actor "
                                  "--compile-timeout); XLA is still working on it in the background") from None
            self._compiled[key] = compiled
            self.compiles += 1
            fut.set_result(compiled)
            log.debug("compiled executable %s", key)
            return key, False
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                fut.cancel()  # whoever waits for the same blob learns its compile was abandoned
            else:
                fut.set_exception(e)
                fut.exception()
            raise
        finally:
            self._compiling.pop(key, None)

    def get(self, key: str) -> Any:
        try:
            return self._compiled[key]
        except KeyError:
            raise UnknownExecutableError(
                f"no executable {key!r} on this actor ({len(self._compiled)} cached); send it with 'compile' first"
            ) from None
