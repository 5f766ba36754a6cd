"""`ffdebug compare` under torchrun (WORLD_SIZE > 1): join the group, compare across it, render
on rank 0 (docs/across-nodes.md). The other processes print nothing and exit 0 once the
comparison is done; rank 0 exits with the comparison's code."""

from __future__ import annotations


def compare_across(ref: str, tgt: str, options: dict, json_out: bool, problems: bool) -> int:
    from ffdebug.across.group import join
    from ffdebug.comparison.engine import compare
    from ffdebug.report.progress import Progress

    group = join()
    try:
        if group.rank == 0:
            with Progress("compare", "stages") as progress:
                result = compare(ref, tgt, group=group, progress=progress, **options)
        else:
            result = compare(ref, tgt, group=group, **options)
    finally:
        group.close()
    if group.rank != 0:
        return 0
    from ffdebug.report.sink import Output
    from ffdebug.report.text import print_compare

    Output(json=json_out).show(result, print_compare, only_problems=problems)
    return result.exit_code()
