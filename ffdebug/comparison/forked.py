"""Whole stage units compared in forked worker processes (docs/benchmarks.md "Benchmarks").

Why processes: each 64 Ki-element kernel of the chunk loop takes 5-20 µs, about what handing
the GIL from one thread to another costs on a busy core, so worker threads gained 1.1-1.2 x on two
cores; forked workers each have their own interpreter and gained 1.9-2 x (bench/README.md).
Forked, not spawned: a child starts as a copy of the parent after its imports (numpy; torch too
where the calling program has it) and the store reading, so it pays neither again and needs
nothing pickled but unit indices and results. BLAS's one-thread setting (`_chunks.one_blas_thread`,
set before the fork) is inherited.

`ForkPool(fn, workers)` forks `workers` children at once; `map(n, done)` hands indices 0..n-1 to
whichever child is free (two queued per child, so none waits on the round trip) and returns
[fn(0), ..., fn(n-1)] in index order, calling `done(i)` in the parent as each result arrives; the
first error in index order is raised once the children in flight have answered. A child that dies
(killed, out of memory) is reported in one line naming the unit it held, never waited for.
`close()` ends every child, killing any that does not stop. Each child ignores SIGINT (held back
across the fork, so a Ctrl-C cannot unwind a new child into the caller's code; the parent, told to
stop, kills them), is killed if the parent dies, and leaves with `os._exit` whatever happens, so
no parent cleanup or buffered output runs twice. An exception that would not unpickle in the
parent travels as a RuntimeError naming it.

Used only where `fork_usable()`: Linux (fork after `import torch`, where a program has it, is how
torch's data loaders start workers there), no CUDA context (a forked child cannot use it), and no other Python thread, whose
locks a child could inherit held — except threads marked fork-safe (`FORK_SAFE` set on the
thread: the CLI's progress ticker and bar, which a child never calls into; logging re-creates its
locks in a child itself).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Callable

from ffdebug.errors import FFDebugError
from ffdebug.progress_hook import FORK_SAFE

_STOP_SECONDS = 2.0  # a child told to stop gets this long before it is killed
QUEUED_PER_CHILD = 2  # indices sent to a child ahead of its results


def fork_usable() -> bool:
    """Forking is safe and cheap here: Linux, no CUDA context, no Python thread but fork-safe ones."""
    if not (sys.platform.startswith("linux") and hasattr(os, "fork")):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child cannot use CUDA
        return False
    me = threading.current_thread()
    return all(t is me or getattr(t, FORK_SAFE, False) for t in threading.enumerate())


class ForkPool:
    """`workers` forked children running `fn(i)` for the indices sent to them."""

    def __init__(self, fn: Callable[[int], object], workers: int, what: Callable[[int], str] = str) -> None:
        from multiprocessing.connection import Pipe

        self._what = what  # names index i in a dead child's message
        self._children: dict = {}  # parent end of the pipe -> child pid
        sys.stdout.flush()  # a child must not inherit (and later write) unflushed output
        sys.stderr.flush()
        parent = os.getpid()
        try:
            for _ in range(workers):
                mine, theirs = Pipe()
                # SIGINT is held back across the fork: a Ctrl-C landing in a child before it
                # ignores SIGINT would unwind it into the caller's code as a second compare
                held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                try:
                    pid = os.fork()
                    if pid == 0:  # the child: never returns
                        _child(fn, theirs, [mine, *self._children], parent, held)
                except BaseException:  # fork refused (EAGAIN, ENOMEM): this pipe is nobody's
                    mine.close()
                    theirs.close()
                    raise
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, held)
                theirs.close()
                self._children[mine] = pid
        except BaseException:
            self.close()
            raise

    def map(self, n: int, done: Callable[[int], None] = lambda i: None) -> list:
        from collections import deque
        from multiprocessing.connection import wait

        results: list = [None] * n
        errors: dict[int, BaseException] = {}
        queued: dict = {conn: deque() for conn in self._children}  # parent end -> its indices, in order
        todo = iter(range(n))

        def hand_out(conn) -> None:
            i = next(todo, None) if not errors else None
            if i is not None:
                conn.send(i)
                queued[conn].append(i)

        for _ in range(QUEUED_PER_CHILD):  # the next index waits in the pipe: a child never idles
            for conn in self._children:  # on the round trip, which is as long as a small unit
                hand_out(conn)
        while any(queued.values()):
            for conn in wait([c for c, q in queued.items() if q]):
                i = queued[conn].popleft()
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    raise self._died(conn, i) from None
                except Exception as err:  # a reply that does not unpickle here
                    kind, value = "error", RuntimeError(f"a worker's reply could not be read: {err!r}")
                if kind == "done":
                    results[i] = value
                    done(i)
                else:
                    errors[i] = value
                hand_out(conn)
        if errors:
            raise errors[min(errors)]
        return results

    def _died(self, conn, i: int) -> FFDebugError:
        pid = self._children.pop(conn)
        conn.close()
        try:
            _, status = os.waitpid(pid, 0)
            how = _ending(status)
        except ChildProcessError:
            how = "ended"
        return FFDebugError(
            f"a worker process {how} while comparing {self._what(i)} (out of memory?); "
            "re-run with --workers 1 to compare in this process alone"
        )

    def close(self) -> None:
        """Stop every child (a stop message, then SIGKILL after `_STOP_SECONDS`) and reap it."""
        import time

        for conn in self._children:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + _STOP_SECONDS
        for conn, pid in list(self._children.items()):
            conn.close()
            while True:
                try:
                    got, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if got:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.005)
        self._children.clear()

    def __enter__(self) -> ForkPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ending(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _child(fn: Callable[[int], object], conn, inherited: list, parent: int, mask) -> None:
    """The child's whole life: nothing raised here can leave it (it ends in `os._exit`)."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent, told to stop, stops the children
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _die_with(parent)
        for other in inherited:
            other.close()
        _serve(fn, conn)
        code = 0
    except BaseException:  # never back into the caller's stack
        pass
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


def _die_with(parent: int) -> None:
    """Linux: SIGKILL this child when its parent dies (a parent killed by SIGTERM would otherwise
    leave it finishing a unit nobody reads)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)


def _serve(fn: Callable[[int], object], conn) -> None:
    """The child's loop: an index in, ("done", fn(i)) or ("error", exception) out, until None."""
    while True:
        i = conn.recv()
        if i is None:
            return
        try:
            reply = ("done", fn(i))
        except BaseException as err:  # raised in the parent, in index order
            reply = ("error", _portable(err))
        try:
            conn.send(reply)
        except Exception as err:  # a result that does not pickle
            conn.send(("error", RuntimeError(f"a worker process could not return its result: {err!r}")))


def _portable(err: BaseException) -> BaseException:
    """`err` if it survives pickling both ways, else a RuntimeError saying what it was (an
    exception whose constructor takes other arguments than its `args` unpickles as a TypeError)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


@dataclasses.dataclass(frozen=True)
class FoldRef:
    """A record a child folded from the unit's own records: the plan and the parts' indices."""

    plan: object
    parts: tuple[int, ...]


def record_refs(own: list, pairs: list[tuple]) -> list[tuple]:
    """The record pairs as a child sends them back: each of the unit's own records (`own`) by its
    index, a record folded from them as its plan and their indices (`CompareResult.records` must
    hold the parent's own objects, and a part's source need not pickle); any other record whole."""
    from ffdebug.io.ranks import Folded

    index = {id(rec): k for k, rec in enumerate(own)}

    def ref(rec):
        if id(rec) in index:
            return index[id(rec)]
        source = rec.source
        if isinstance(source, Folded) and all(id(p) in index for p in source.parts):
            return FoldRef(source.plan, tuple(index[id(p)] for p in source.parts))
        return rec

    return [tuple(ref(rec) for rec in pair) for pair in pairs]


def resolve_refs(own: list, refs: list[tuple]) -> list[tuple]:
    """`record_refs` undone in the parent, against the unit's own records `own`."""
    from ffdebug.io.ranks import fold

    def record(x):
        if isinstance(x, int):
            return own[x]
        if isinstance(x, FoldRef):
            return fold([own[k] for k in x.parts], x.plan)
        return x

    return [tuple(record(x) for x in pair) for pair in refs]
