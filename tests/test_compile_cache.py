"""The bound on a daemon's persistent compilation cache while it lives (actors/compile_cache.py)."""

import asyncio
import os

import jax
import jax.numpy as jnp
import pytest
from jax import export

from actors.cache import ExecutableCache
from actors.compile_cache import CompileCacheBound, prune_compile_cache

HOURS = 3600.0


@pytest.fixture
def jax_compile_cache(tmp_path):
    """JAX's persistent compilation cache in `tmp_path`, as the daemon sets it up (every entry written)."""
    from jax._src import compilation_cache

    settings = {"jax_compilation_cache_dir": str(tmp_path), "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    saved = {name: getattr(jax.config, name) for name in settings}
    compilation_cache.reset_cache()
    for name, value in settings.items():
        jax.config.update(name, value)
    try:
        yield tmp_path
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def _files(path) -> dict[str, int]:
    return {e.name: e.stat().st_size for e in os.scandir(path) if e.is_file()}


def _two_hours_pass(path) -> None:
    """Every entry's last use moves two hours back: a daemon's life compressed (entries used within the last hour
    are never pruned: another daemon may be reading them)."""
    for e in os.scandir(path):
        st = e.stat()
        os.utime(e.path, (st.st_atime - 2 * HOURS, st.st_mtime - 2 * HOURS))


def test_a_long_lived_daemons_compile_cache_stays_within_its_bound_as_it_compiles(jax_compile_cache):
    """The cache was pruned only at a daemon's start: one serving job after job for days grew it by every new
    executable until it restarted (a review). Real compiles through `ExecutableCache` into JAX's persistent cache,
    hours apart: after each new executable the daemon's bound (`CompileCacheBound`, every=1 here) prunes the least
    recently used entries, so the directory stays within its bound and the newest entries stay."""
    path = jax_compile_cache
    cache = ExecutableCache(jax.devices()[0])
    written: list[set[str]] = []  # the files each compile added, oldest first
    arg = jax.ShapeDtypeStruct((4,), jnp.float32)

    async def go(bound: CompileCacheBound) -> None:
        cache.on_compiled = bound.wrote
        for i in range(8):
            before = set(_files(path))
            blob = export.export(jax.jit(lambda a, i=i: a * (i + 2) + i), platforms=["cpu"])(arg).serialize()
            key, cached = await cache.compile(blob)
            assert not cached
            bound.join(30)  # (the prune runs in a thread of its own: done before time moves on)
            written.append(set(_files(path)) - before)
            assert written[-1], "the compile wrote no entry: is JAX's persistent cache set up?"
            _two_hours_pass(path)

    try:
        first = export.export(jax.jit(lambda a: a - 1), platforms=["cpu"])(arg).serialize()
        asyncio.run(cache.compile(first))
        limit = 3 * sum(_files(path).values())  # about three executables' entries
        assert limit > 0, "the compile wrote no entry: is JAX's persistent cache set up?"
        _two_hours_pass(path)
        bound = CompileCacheBound(str(path), limit, every=1)
        asyncio.run(go(bound))
    finally:
        cache._threads.shutdown(wait=True)
    left = _files(path)
    assert sum(left.values()) <= limit, (sum(left.values()), limit, sorted(left))
    assert bound.removed > 0
    assert written[-1] <= set(left) and written[-2] <= set(left), "the newest entries were pruned"
    assert not written[0] & set(left), "the oldest entry outlived newer ones"


def test_a_prune_every_few_executables_leaves_entries_in_use_and_the_lock(tmp_path):
    """`every`: one prune per so many new executables, counting from the last; an entry used within the last hour
    (being written or read now) and the private directory's lock file stay whatever the bound."""
    now = os.stat(tmp_path).st_mtime
    for i in range(6):
        f = tmp_path / f"entry{i}-cache"
        f.write_bytes(b"x" * 1024)
        used = now - (10 - i) * HOURS if i < 4 else now  # entries 4 and 5 in use now
        os.utime(f, (used, used))
    (tmp_path / ".held").write_bytes(b"")
    os.utime(tmp_path / ".held", (now - 100 * HOURS, now - 100 * HOURS))
    bound = CompileCacheBound(str(tmp_path), 0, every=3)
    bound.wrote()
    bound.wrote()
    bound.join(30)
    assert len(_files(tmp_path)) == 7  # (two new executables: no prune yet)
    bound.wrote()
    bound.join(30)
    assert sorted(_files(tmp_path)) == [".held", "entry4-cache", "entry5-cache"] and bound.removed == 4 * 1024
    assert prune_compile_cache(str(tmp_path), 0) == 0
    with pytest.raises(ValueError, match="every"):
        CompileCacheBound(str(tmp_path), 0, every=0)


def test_a_failing_hook_after_a_compile_does_not_fail_the_compile():
    """The hook ran inside the compile's try, after its future was set: a hook that raised (a prune thread that could
    not start) made the compile raise InvalidStateError though the executable was compiled and cached (a review).
    The compile returns as compiled; the hook's failure is only logged."""
    cache = ExecutableCache(jax.devices()[0])
    calls = []

    def boom() -> None:
        calls.append(1)
        raise RuntimeError("can't start new thread")

    cache.on_compiled = boom
    blob = export.export(jax.jit(lambda a: a + 1), platforms=["cpu"])(jax.ShapeDtypeStruct((4,), jnp.float32)).serialize()

    async def go() -> tuple:
        return await cache.compile(blob), await cache.compile(blob)

    try:
        (key, cached), again = asyncio.run(go())
    finally:
        cache._threads.shutdown()
    assert not cached and again == (key, True) and cache.compiles == 1 and calls == [1]


def test_empty_entries_a_failed_write_left_go_at_the_next_prune_whatever_their_age_and_the_bound(tmp_path):
    """A full disk left empty entries (JAX's write failed): every later read of one failed and recompiled, and being
    young they outlived the hour's protection for good (a probe). An empty file untouched for a minute goes at the
    next prune even under the bound; one just made (a write in progress) and every non-empty young entry stay."""
    import time

    now = time.time()
    for name, size, age in (("left", 0, 120.0), ("writing", 0, 5.0), ("young", 100, 120.0), (".held", 0, 10 * HOURS)):
        p = tmp_path / name
        p.write_bytes(b"x" * size)
        os.utime(p, (now - age, now - age))
    assert prune_compile_cache(str(tmp_path), max_bytes=1 << 30, now=now) == 0
    assert sorted(os.listdir(tmp_path)) == [".held", "writing", "young"]
