"""Compiled-executable cache keyed by the content hash of a serialized `jax.export` blob.

The same blob compiles once per actor; JAX's persistent compilation cache (when the daemon is given a
cache directory) also makes a restarted daemon skip XLA compilation.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import jax
from jax import export

from actors.stream import TOKEN_AVAL, ordered

log = logging.getLogger(__name__)


class UnknownExecutableError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown executable"


def content_hash(blob: bytes | memoryview) -> str:
    return hashlib.sha256(blob).hexdigest()[:32]


class ExecutableCache:
    def __init__(self, device: Any, ordered: bool = False) -> None:
        """With `ordered`, every executable takes and returns an order token first (see actors/stream.py)."""
        self._device = device
        self._ordered = ordered
        self._compiled: dict[str, Any] = {}
        self._compiling: dict[str, asyncio.Future[Any]] = {}
        self.compiles = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def _compile(self, blob: bytes, donate: tuple[int, ...]) -> Any:
        exp = export.deserialize(bytearray(blob))
        fn, avals = exp.call, list(exp.in_avals)
        if self._ordered:
            fn, avals, donate = ordered(fn), [TOKEN_AVAL, *avals], tuple(d + 1 for d in donate)
        with jax.default_device(self._device):
            return jax.jit(fn, donate_argnums=donate).lower(*avals).compile()

    async def compile(self, blob: bytes | memoryview, donate: tuple[int, ...] = ()) -> tuple[str, bool]:
        """Compile `blob` (or find it cached), letting the inputs at `donate` share buffers with outputs.
        Returns (key, was_cached)."""
        key = content_hash(blob) + ("-d" + ".".join(map(str, donate)) if donate else "")
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
            compiled = await asyncio.to_thread(self._compile, bytes(blob), tuple(donate))
            self._compiled[key] = compiled
            self.compiles += 1
            fut.set_result(compiled)
            log.debug("compiled executable %s", key)
            return key, False
        except BaseException as e:
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
