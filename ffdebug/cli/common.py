"""Shared CLI conventions: option declarations, side resolution, option parsing (errors end at
`ffdebug.cli.boundary`, results at `ffdebug.report.sink`)."""

from __future__ import annotations

import os

import typer

from ffdebug.errors import FFDebugError
from ffdebug.verdict import parse_fail_on as check_fail_on  # noqa: F401 (the commands import it from here)

FAIL_ON_HELP = "Exit 1 when a stage is at or above this severity: drift, diverge, bug, scramble."

# Options shared by the commands that read two sides (compare, bisect) or filter records
# (slot-invariance): one definition each, so names and help stay identical everywhere.
SIDES_ARG = typer.Argument(None, help="'ref-vs-target' (with --dir) or REF_SIDE_DIR TARGET_SIDE_DIR")
DIR_OPT = typer.Option(None, "--dir", help="Dump directory holding the side folders.")
LAYERS_OPT = typer.Option(None, "--layers", help="Layers to use: '0,2,5-7,-1'.")
STAGES_OPT = typer.Option(None, "--stages", help="Glob over stage keys (repeatable).")
EXCLUDE_OPT = typer.Option(
    None,
    "--exclude",
    help="Glob over stage keys to leave out, e.g. 'loss.*' (repeatable; listed as selected out).",
)
STEP_OPT = typer.Option(None, "--step", help="Keep records tagged key=value (repeatable).")
THRESHOLD_OPT = typer.Option(
    None,
    "--threshold",
    help="'GLOB:cos>=X,rel<=Y' ok band per stage (repeatable); also elem<=E, max_abs<=M, atol=A "
    "(every element within A passes): 'L*:rel<=0.01,atol=1e-4'.",
)
NOISE_OPT = typer.Option(
    None, "--noise", help="A noise side: the reference run twice, or in the target's dtype."
)
JSON_OPT = typer.Option(False, "--json", help="Machine-readable output with the stable keys.")
MAP_OPT = typer.Option(
    None,
    "--map",
    help="Rename stage kinds on both sides before pairing: 'OLD=NEW' (regular expression over the key "
    "without its L{NNN}. prefix, {L}/{N} carry a number; weights-diff's syntax), e.g. 'mix.out=attn_out'. Repeatable.",
)
ALIAS_FILE_OPT = typer.Option(
    None, "--alias-file", help="A file of OLD=NEW lines (or a YAML / JSON mapping) applied like --map."
)
ALLOW_PARTIAL_OPT = typer.Option(
    False,
    "--allow-partial",
    help="Exit 0 (not 4) when everything compared is fine but something was left out; the output still says what.",
)


def check_noise(noise: str | None) -> None:
    """`--noise PATH` names an existing side (a directory, or a peer dump an importer reads): said
    with the option, before any store is opened."""
    if noise is not None and not os.path.exists(noise):
        raise FFDebugError(
            f"--noise {noise}: no such file or directory; give the side directory of a noise run "
            "(the reference run again with one benign change, e.g. another dtype or thread count)"
        )


def resolve_sides(args: list[str] | None, directory: str | None, check: bool = True) -> tuple[str, str]:
    """`ref-vs-target --dir D` (any `A-vs-B`), `--dir D` alone, or two side directories.
    `check=False`: the paths only, nothing looked up here (a compare across nodes, where this
    node may hold none of a side)."""
    from ffdebug.io.registry import find_importer, peer_sides
    from ffdebug.store.reader import sides_in

    args = list(args or [])
    if len(args) == 2:
        if directory is not None:
            raise FFDebugError("give either two side directories or --dir, not both")
        return args[0], args[1]
    if len(args) > 2:
        raise FFDebugError(f"too many arguments {args}: give 'ref-vs-target --dir D' or REF_DIR TARGET_DIR")
    pair = args[0] if args else "ref-vs-target"
    if "-vs-" not in pair:
        raise FFDebugError(
            f"{pair!r}: give 'ref-vs-target --dir D' (or 'A-vs-B' for sides A and B), or two side directories"
        )
    if directory is None:
        raise FFDebugError(f"'{pair}' needs --dir D (the FFDEBUG_FWD_DUMP_DIR both sides wrote to)")
    if not check:
        a, b = pair.split("-vs-", 1)
        return os.path.join(directory, a), os.path.join(directory, b)
    if not os.path.isdir(directory):
        raise FFDebugError(
            f"--dir {directory}: directory does not exist; give the FFDEBUG_FWD_DUMP_DIR of the dumps"
        )
    a, b = pair.split("-vs-", 1)
    ref, tgt = os.path.join(directory, a), os.path.join(directory, b)
    found = sides_in(directory)
    peer = peer_sides(directory) if not found else None
    if peer is not None:  # a foreign dump keeping both sides in one directory (ATOM's ref_ files)
        found = peer[1]
    # a side may also be a peer dump an importer reads (an SGLang run directory DIR/baseline)
    missing = [p for p in (a, b) if p not in found and find_importer(os.path.join(directory, p)) is None]
    if missing:
        listing = ", ".join(found) if found else "none"
        raise FFDebugError(
            f"{directory}: side(s) {', '.join(missing)} not found (sides present: {listing}); "
            f"dump them with FFDEBUG_FWD_DUMP_SIDE={missing[0]}"
        )
    return ref, tgt


def selection_options(
    *, layers, stages, exclude, step, rank, threshold, noise, fail_on, allow_partial, maps, alias_file
) -> dict:
    """The options compare and bisect share, as their engines take them: repeated options as
    tuples, `--step` parsed, `--noise` checked."""
    check_noise(noise)
    return dict(
        layers=layers,
        stages=tuple(stages or ()),
        exclude=tuple(exclude or ()),
        step=parse_step_filter(step),
        rank=rank,
        thresholds=tuple(threshold or ()),
        noise=noise,
        fail_on=fail_on,
        allow_partial=allow_partial,
        maps=tuple(maps or ()),
        alias_file=alias_file,
    )


def parse_step_filter(items: list[str] | None) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise FFDebugError(f"--step {item!r} is invalid: use key=value, e.g. --step optimizer_step=3")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out
