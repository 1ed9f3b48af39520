"""Ctrl-C that CPython would drop, delivered again (the controller process; installed when a mesh is made).

A SIGINT raises KeyboardInterrupt in the main thread at the next bytecode it runs. When that bytecode belongs to a
garbage-collection callback (JAX registers one, `_xla_gc_callback`, run at every collection) or to a `__del__`,
CPython cannot raise it there: it prints "Exception ignored in ..." and drops it, and the training loop goes on as
if the key had not been pressed — about 1 press in 12 in a probe of a loop dispatching steps (which allocates
enough to collect often). Plain JAX does the same; a user presses again. Here `sys.unraisablehook` is chained:
a KeyboardInterrupt dropped so in the main thread is raised again: a timer thread sends the main thread SIGINT 10 ms
later, when the collection is over (one that lands in a callback again is dropped and sent again), and the drop is
not printed. Everything else goes to the hook there was.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

REDELIVER_AFTER = 0.01  # seconds: the collection (or finalizer) that dropped it is over by then


def _interrupt_main() -> None:
    """A real SIGINT to the main thread, from another: raised again as KeyboardInterrupt there (a wait it is blocked
    in wakes for it), not in the hook — `_thread.interrupt_main()` called from the hook itself was raised at once
    inside the hook, and dropped again."""
    if not callable(signal.getsignal(signal.SIGINT)):  # (set to SIG_DFL or SIG_IGN meanwhile: nobody raises it now)
        return
    try:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    except (OSError, ValueError, TypeError):  # (the main thread gone: the process is ending)
        pass


def install() -> None:
    """Chain the re-delivering hook onto `sys.unraisablehook` as it is now, unless that is one of ours already
    (a hook set over ours later, e.g. pytest's for each test, gets ours chained onto it on the next call)."""
    previous = sys.unraisablehook
    if getattr(previous, "mpmd_redelivers_interrupts", False):
        return

    def redeliver(args: Any) -> None:
        if isinstance(args.exc_value, KeyboardInterrupt) and threading.current_thread() is threading.main_thread() \
                and not sys.is_finalizing():
            timer = threading.Timer(REDELIVER_AFTER, _interrupt_main)
            timer.daemon = True
            timer.start()
            return
        previous(args)

    redeliver.mpmd_redelivers_interrupts = True  # type: ignore[attr-defined]
    sys.unraisablehook = redeliver
