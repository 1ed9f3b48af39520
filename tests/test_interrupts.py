"""Ctrl-C that CPython drops — raised while a garbage-collection callback (JAX's `_xla_gc_callback` runs at every
collection) or a `__del__` runs — is delivered again to the controller's main thread (`mpmd.runtime.interrupts`,
installed when a mesh is made). The callback and finalizer here raise KeyboardInterrupt as a SIGINT landing in them
would (a real SIGINT cannot be aimed at that bytecode); the re-delivery is a real SIGINT."""

import gc
import sys
import time

import pytest

from mpmd.runtime import interrupts


def _run_until_interrupted(start, seconds=5.0):
    start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # (a training loop going on)
        time.sleep(0.001)


def test_a_keyboard_interrupt_dropped_in_a_gc_callback_is_raised_again_in_the_main_thread():
    interrupts.install()
    fired = []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(phase)
            raise KeyboardInterrupt

    gc.callbacks.append(callback)
    try:
        t = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            _run_until_interrupted(gc.collect)
        assert fired and time.monotonic() - t < 2.0  # (raised again 10 ms on, not when the loop ended by itself)
    finally:
        gc.callbacks.remove(callback)


def test_a_keyboard_interrupt_dropped_in_a_finalizer_is_raised_again_and_other_errors_go_to_the_hook_before(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: seen.append(args.exc_type))
    interrupts.install()
    interrupts.install()  # (once is enough: a second call chains nothing more)
    assert getattr(sys.unraisablehook, "mpmd_redelivers_interrupts", False)

    class Interrupted:
        def __del__(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run_until_interrupted(lambda: Interrupted())

    class Broken:
        def __del__(self):
            raise ValueError("an ordinary error in a finalizer")

    Broken()
    assert seen == [ValueError]  # (the interrupt not reported as dropped; the ordinary error reported as before)
