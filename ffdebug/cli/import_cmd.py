"""`ffdebug import`: a peer engine's dump (ATOM, SGLang) written as a normal ffdebug store."""

from __future__ import annotations

import os

import typer

HELP = """Convert a peer engine's dump into an ffdebug store (compare, bisect and inspect also read
the peer dumps directly; importing keeps a converted copy that loads fast and carries a manifest).

[bold]Examples[/bold]

  ffdebug import /tmp/atom_dump /tmp/dump            # ATOM: ref_ files -> /tmp/dump/ref, hook files -> /tmp/dump/target
  ffdebug import /tmp/sglang/baseline/dump_20261201 /tmp/dump --side ref
  ffdebug import /tmp/sglang/target /tmp/dump --side target --format sglang
  ffdebug compare ref-vs-target --dir /tmp/dump

Formats (detected from SRC; --format overrides): sglang (a dumper exp_name directory, or its
parent holding one), atom (hook layerNN_Class_rankR[_callNNN].pt, prefixed ref_ files,
weight_rankR_layerL.pt, SIDE_rankR_fwd.pt), atom-pt (any .pt file of tensors), safetensors, store.
Each side goes to DIR/SIDE. The store records that it was imported (finished: null) and every
problem found on the way (files a weights-only load refused, gaps in SGLang's dump_index, replicas
that differ): compare and bisect list them and do not exit 0 while any is there.
"""


def register(app: typer.Typer) -> None:
    @app.command("import", help=HELP)
    def import_command(
        src: str = typer.Argument(..., help="The peer dump: a directory or file."),
        dir: str = typer.Argument(..., help="Dump directory to write; each side goes to DIR/SIDE."),
        format: str = typer.Option(
            None, "--format", help="Override the detected format (sglang, atom, ...)."
        ),
        side: str = typer.Option(None, "--side", help="Side label for a source holding one side (e.g. ref)."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing sides in DIR."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        from ffdebug.errors import FFDebugError
        from ffdebug.io.registry import peer_sides
        from ffdebug.report.sink import Output
        from ffdebug.report.store_text import print_imported
        from ffdebug.store.importing import write_store
        from ffdebug.store.reader import open_side

        peer = peer_sides(src) if format in (None, "atom") and os.path.isdir(src) else None
        if peer is not None and len(peer[1]) > 1:
            if side is not None:
                raise FFDebugError(
                    f"--side {side}: {src} holds sides {', '.join(peer[1])}; drop --side to import them all"
                )
            stores = [(label, peer[0].read_side(src, label)) for label in peer[1]]
        else:
            store = open_side(src, format=format)
            stores = [(side or store.side, store)]
        written = [
            write_store(store, os.path.join(dir, label), label, src, overwrite) for label, store in stores
        ]
        Output(json=json_out).show({"sides": written}, print_imported)
