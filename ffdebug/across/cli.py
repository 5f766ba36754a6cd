"""`ffdebug compare` / `ffdebug bisect` under torchrun (WORLD_SIZE > 1): join the group, run the
command across it, render on rank 0 (docs/across-nodes.md). The other processes print nothing
and exit 0 once the comparison is done; rank 0 exits with the command's code."""

from __future__ import annotations

import sys
from collections.abc import Callable


def run_command(command: Callable, sides, directory, options: dict, render: Callable[[object], int]) -> int:
    """`command` (compare or bisect) on the sides given, in this process, or across the group when
    torchrun launched it (`group.launched`); `render(result)` prints and gives the exit code."""
    from ffdebug.across.group import launched
    from ffdebug.cli.common import resolve_sides
    from ffdebug.errors import FFDebugError
    from ffdebug.report.progress import Progress

    if launched():
        if options.get("model_ref") or options.get("model_target"):
            raise FFDebugError(
                "--model-ref / --model-target: not supported across nodes (the blocks re-run on one "
                "process); run this bisect on one node"
            )
        ref, tgt = resolve_sides(sides, directory, check=False)
        return run_across(command, ref, tgt, options, render)
    ref, tgt = resolve_sides(sides, directory)
    with Progress(command.__name__, "stages") as progress:
        result = command(ref, tgt, progress=progress, **options)
    return render(result)


def run_across(command: Callable, ref: str, tgt: str, options: dict, render: Callable[[object], int]) -> int:
    """`command(ref, tgt, group=…, progress=…, **options)` on every process of the group; rank 0
    renders the result with `render(result)` (its exit code is returned), the others return 0."""
    from ffdebug.across.group import join
    from ffdebug.report.progress import Progress

    group = join()  # --noise is refused by the engine (`Across.open`)
    try:
        if group.rank == 0:
            with Progress(command.__name__, "stages") as progress:
                result = command(ref, tgt, group=group, progress=progress, **options)
        else:
            result = command(ref, tgt, group=group, **options)
    finally:
        from ffdebug.across.run import RECEIVED

        RECEIVED.clear()  # the spill directory goes, whatever ended the run
        group.close()
    if group.rank != 0:
        return 0
    if group.moved is not None:
        print(group.moved.sentence(group.size), file=sys.stderr)
    return render(result)
