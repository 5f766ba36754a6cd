"""Capture state, one owner: the step tags, the layer stack, the process session and the explicit
sessions (docs/architecture.md, "Layers", the capture row).

Step tags and the layer stack are context variables: `ffdebug.step(...)` and a block's forward set
them for the code they wrap. They are read at forward time; whatever runs later on another thread
(a backward hook, the background writer) gets the values the forward saw, taken by the session
when it queued the work (`Session.capture_later`). The sessions are process-wide: the env session
is read from `FFDEBUG_FWD_DUMP_*` at first use, and `ffdebug.capture(...)` pushes an explicit one
for the duration of its `with` block. `reset()` forgets all of it (tests).
"""

from __future__ import annotations

import atexit
import contextlib
from contextvars import ContextVar
from typing import TYPE_CHECKING

from ffdebug import _env

if TYPE_CHECKING:
    from ffdebug.capture.session import Session

# Outermost first. Tuples: a context's value is never mutated in place, only replaced.
_tags: ContextVar[tuple[dict, ...]] = ContextVar("ffdebug_step_tags", default=())
_layers: ContextVar[tuple[int, ...]] = ContextVar("ffdebug_layers", default=())
# the `ExecutionOrder` (capture/order.py) of each entered block, parallel to `_layers` (None when
# its model's blocks are numbered in registration order)
_orders: ContextVar[tuple] = ContextVar("ffdebug_orders", default=())


def current_tags() -> dict:
    """The step tags in force here, inner ones over outer ones."""
    merged: dict = {}
    for t in _tags.get():
        merged.update(t)
    return merged


@contextlib.contextmanager
def tagged(tags: dict):
    """Add `tags` to the step tags of the code inside."""
    token = _tags.set((*_tags.get(), dict(tags)))
    try:
        yield
    finally:
        _tags.reset(token)


def current_layer() -> int | None:
    """The layer of the innermost block being run, if any."""
    stack = _layers.get()
    return stack[-1] if stack else None


def current_order():
    """The `ExecutionOrder` (capture/order.py) of the block now running, or None."""
    stack = _orders.get()
    return stack[-1] if stack else None


def push_layer(layer: int, order=None) -> None:
    """Enter block `layer`; `order` renumbers it when its model's blocks run out of order."""
    _layers.set((*_layers.get(), layer))
    _orders.set((*_orders.get(), order))


def pop_layer() -> None:
    stack = _layers.get()
    if stack:
        _layers.set(stack[:-1])
        _orders.set(_orders.get()[:-1])


class _Sessions:
    """The env session (read once) and the stack of explicit `capture()` sessions."""

    def __init__(self) -> None:
        self.env: Session | None = None
        self.env_read = False
        self.explicit: list[Session] = []

    def env_session(self) -> Session | None:
        if not self.env_read:
            self.env_read = True
            config = _env.dump_config()
            if config is not None:
                from ffdebug.capture.session import Session

                self.env = Session(config)
                _close_at_exit()
        return self.env


_sessions = _Sessions()
_at_exit_registered = False


def _close_at_exit() -> None:
    global _at_exit_registered
    if not _at_exit_registered:
        _at_exit_registered = True
        atexit.register(_close_env)


def _close_env() -> None:
    """At exit: the env session says what it missed (`Session.report_problems`) and closes."""
    if _sessions.env is not None:
        _sessions.env.report_problems()
        _sessions.env.close()


def env_session() -> Session | None:
    """The session of the `FFDEBUG_FWD_DUMP_*` environment (None when dumps are off)."""
    return _sessions.env_session()


def active_session() -> Session | None:
    """The innermost explicit `capture()` session, else the env session."""
    if _sessions.explicit:
        return _sessions.explicit[-1]
    return env_session()


def push_explicit(session: Session) -> None:
    _sessions.explicit.append(session)


def pop_explicit(session: Session) -> None:
    if session in _sessions.explicit:
        _sessions.explicit.remove(session)


def reset() -> None:
    """Forget every piece of capture state: close the env session, drop the explicit ones, clear
    the step tags and layers of this context, re-read the environment at the next use."""
    global _sessions
    if _sessions.env is not None:
        _sessions.env.close()
    _sessions = _Sessions()
    _tags.set(())
    _layers.set(())
    _orders.set(())
    _env.forget_dump_config()
