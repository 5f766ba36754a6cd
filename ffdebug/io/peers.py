"""Registrations of the peer-engine importers (docs/peer-dumps.md "Peer dumps"): SGLang dumper runs, ATOM
`debug_helper` directories (hook, `ref_`, weight and `*_fwd.pt` files). Looked up before the
generic `.pt` importer of `ffdebug.store.importers`."""

from __future__ import annotations

from ffdebug.io import atom, sglang
from ffdebug.io.registry import Importer, register_importer

FORMATS = ("sglang", "atom")

register_importer(
    Importer(
        "sglang",
        detect=sglang.detect,
        read=sglang.read,
        accepts="an SGLang dumper exp_name directory",
    )
)
register_importer(
    Importer(
        "atom",
        detect=atom.detect,
        read=atom.read,
        accepts="an ATOM debug_helper dump directory",
        sides=atom.sides,
        read_side=atom.read_side,
    )
)
