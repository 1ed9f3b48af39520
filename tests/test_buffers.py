"""The actor's buffer table: what a reader learns about a buffer that is coming, came, failed or was deleted."""

import asyncio

import numpy as np
import pytest

from actors.buffers import BufferTable, UnknownBufferError


async def test_a_reader_that_comes_after_a_receive_failed_gets_the_failure_not_unknown_buffer():
    """The race CI hit: a receive times out before the Run that reads its buffer asks for it. The late reader
    must get the receive's error (naming the peer), never "holds no buffer"."""
    table = BufferTable("actor 0 program 1 step 0", remember_failures=True)
    table.reserve(3)
    early = asyncio.ensure_future(table.get(3))
    await asyncio.sleep(0)
    why = TimeoutError("actor 0 waited 0.3 s for g from actor 1")
    table.fail(3, why)
    with pytest.raises(TimeoutError, match="from actor 1"):
        await early
    with pytest.raises(TimeoutError, match="from actor 1"):
        await table.get(3)
    with pytest.raises(TimeoutError, match="from actor 1"):
        await table.ref(3)
    assert table.delete([3]) == 1  # a failed buffer is deleted like any other ...
    with pytest.raises(UnknownBufferError, match="holds no buffer 3"):
        await table.get(3)  # ... and is unknown after


async def test_a_failed_buffer_put_again_holds_the_new_value_and_a_cleared_table_forgets_failures():
    table = BufferTable(remember_failures=True)
    table.reserve(1)
    table.fail(1, RuntimeError("lost"))
    table.put(1, np.arange(3))
    np.testing.assert_array_equal(await table.get(1), np.arange(3))
    table.reserve(2)
    table.fail(2, RuntimeError("lost"))
    table.clear()
    with pytest.raises(UnknownBufferError):
        table.ref(2)


async def test_failing_a_buffer_deleted_while_pending_tells_its_waiters_and_leaves_nothing_behind():
    table = BufferTable()
    table.reserve(5)
    waiter = asyncio.ensure_future(table.get(5))
    await asyncio.sleep(0)
    table.delete([5])
    table.fail(5, RuntimeError("never came"))
    with pytest.raises(RuntimeError, match="never came"):
        await waiter
    with pytest.raises(UnknownBufferError):
        await table.get(5)


async def test_the_sessions_table_forgets_a_failed_entry_so_no_traceback_is_kept_alive():
    """The session's table (no `remember_failures`): a failure goes to the waiters of that moment only."""
    table = BufferTable("actor 0 (session 1)")
    table.reserve(7)
    table.fail(7, RuntimeError("aborted"))
    with pytest.raises(UnknownBufferError, match="holds no buffer 7"):
        await table.get(7)


async def test_all_of_waits_for_every_transfer_and_fails_as_the_first_failure_at_once():
    """actors.interpreter.all_of, the interpreter's wait for a step's transfers, against asyncio.gather's contract."""
    import gc
    import warnings

    from actors.interpreter import all_of

    loop = asyncio.get_running_loop()
    done = loop.create_future()
    done.set_result(1)
    await all_of([])
    await all_of([done])
    b, c = loop.create_future(), loop.create_future()
    w = all_of([done, b, c])
    b.set_result(None)
    await asyncio.sleep(0)
    assert not w.done()  # one still going
    c.set_result(None)
    await asyncio.sleep(0)
    assert w.done() and w.result() is None
    slow, failing = loop.create_future(), loop.create_future()
    w = all_of([slow, failing])
    failing.set_exception(ValueError("a receive timed out"))
    await asyncio.sleep(0)
    assert isinstance(w.exception(), ValueError)  # at once, not after the slow one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        slow.set_exception(KeyError("late"))  # marked retrieved: no "never retrieved" noise when collected
        await asyncio.sleep(0)
        assert slow._log_traceback is False
        del slow
        gc.collect()
    cancelled = loop.create_future()
    w = all_of([cancelled])
    cancelled.cancel()
    await asyncio.sleep(0)
    assert isinstance(w.exception(), asyncio.CancelledError)
    going = [loop.create_future(), loop.create_future()]

    async def step() -> None:
        await all_of(going)

    waiter = asyncio.create_task(step())
    await asyncio.sleep(0)
    waiter.cancel()  # the step was aborted while waiting: its transfers are cancelled with it, as under gather
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.sleep(0)
    assert all(f.cancelled() for f in going)
