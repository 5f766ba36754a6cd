"""SIGTERM drains the background dump writers, then does what it did before.

Installed by the first `BackgroundWriter` (so only when dumping is enabled and something was
captured), from the main thread only, and never over `SIG_IGN` (a process told to ignore SIGTERM
keeps ignoring it) or over a handler set outside Python (`getsignal` returns None). On SIGTERM every
open writer is drained (its queued captures written), then the previous handler runs: a Python
handler is called; the default action is restored and the signal re-raised, so the process still
dies of SIGTERM. When the last writer closes, the previous handler is put back (unless someone
replaced ours meanwhile).
"""

from __future__ import annotations

import os
import signal
import threading
import weakref

from ffdebug.logs import get_logger

_live: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
_previous = None
_installed = False


def register(writer) -> None:
    """Track `writer`; install the handler if it is not installed yet and may be."""
    global _previous, _installed
    with _lock:
        _live.add(writer)
        if _installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None or previous is signal.SIG_IGN or previous is _on_sigterm:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
        _previous, _installed = previous, True


def unregister(writer) -> None:
    """Forget `writer`; the last one out restores the previous handler."""
    global _previous, _installed
    with _lock:
        _live.discard(writer)
        if _live or not _installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _previous)
        _previous, _installed = None, False


def installed() -> bool:
    return _installed


def _on_sigterm(signum, frame) -> None:
    for writer in list(_live):
        try:
            writer.drain()
        except Exception as err:  # the signal must still reach the previous handler
            get_logger("store").warning("dump writer failed while draining on SIGTERM: %s", err)
    previous = _previous
    if callable(previous):
        previous(signum, frame)
        return
    # SIG_DFL: terminate as if we had never been here
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
