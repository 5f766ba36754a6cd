"""Typed records: every manifest field is type-checked once when a store is read (exit 2 naming
file:line and the field); unknown keys are kept; importers are one registration."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.errors import FFDebugError
from ffdebug.io.record import Record, ShardSpec
from ffdebug.store.reader import open_side
from ffdebug.store.writer import StoreWriter

GOOD = {
    "key": "L000.ffn_out",
    "seq": 0,
    "file": None,
    "tensor": None,
    "side": "ref",
    "rank": 0,
    "world_size": 1,
    "call": 0,
    "invocation": 0,
    "phase": None,
    "step": {"optimizer_step": 1},
    "layer": 0,
    "layer_class": "dense",
    "module_class": "MLP",
    "module_path": "model.layers.0.mlp",
    "io": "out",
    "dtype": "float32",
    "shape": [2, 3],
    "stats": {"mean": 0.0},
    "shard": None,
    "reduction": "full",
}


def _store(tmp_path, *lines: dict):
    """A side whose manifest holds `lines` after one good record (so the bad one is line 2)."""
    rank = tmp_path / "side" / "rank000"
    rank.mkdir(parents=True)
    text = "".join(json.dumps(x) + "\n" for x in (GOOD, *lines))
    (rank / "manifest.jsonl").write_text(text)
    return tmp_path / "side", rank / "manifest.jsonl"


def test_a_good_manifest_reads_into_typed_attributes(tmp_path):
    extra = dict(GOOD, seq=1, key="L000.x", shard={"dim": 1, "index": 1, "count": 2}, future_field=[1, 2])
    side, _ = _store(tmp_path, extra)
    first, second = open_side(side).records
    assert first.shape == (2, 3) and first.step == {"optimizer_step": 1} and first.layer == 0
    assert first.rank == 0 and first.io == "out" and first.over_budget is False and first.extra == {}
    assert not first.has_payload  # no file: statistics only
    assert second.shard == ShardSpec(dim=1, index=1, count=2)
    assert second.unknown == {"future_field": [1, 2]}  # kept, not an error
    with pytest.raises(AttributeError):
        first.__getitem__  # noqa: B018 — no dict-style access on Record
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.key = "other"


def test_nulls_take_the_documented_defaults(tmp_path):
    side, _ = _store(tmp_path, dict(GOOD, seq=1, rank=None, invocation=None, step=None, io=None, shape=None))
    rec = open_side(side).records[1]
    assert (rec.rank, rec.invocation, rec.step, rec.io, rec.shape) == (0, 0, {}, "out", ())


BAD = [
    ("key", 7),
    ("key", None),
    ("seq", [1]),
    ("seq", "0"),
    ("seq", True),
    ("rank", "0"),
    ("world_size", 1.5),
    ("call", {"n": 1}),
    ("invocation", "first"),
    ("phase", 3),
    ("step", [1]),
    ("step", "optimizer_step=1"),
    ("layer", "3"),
    ("layer_class", 1),
    ("io", ["out"]),
    ("dtype", 32),
    ("shape", 4),
    ("shape", [2, "3"]),
    ("shape", [2, -1]),
    ("stats", [1.0]),
    ("stats", "none"),
    ("shard", [0, 1, 2]),
    ("shard", {"dim": 0, "index": 2, "count": 2}),
    ("shard", {"dim": "0", "index": 0, "count": 2}),
    ("reduction", "mean"),
    ("reduction", 1),
    ("file", 12),
    ("tensor", ["t"]),
    ("persistent", "yes"),
    ("over_budget", 1),
    ("extra", "input_ids"),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_a_wrong_typed_field_names_file_line_and_field(tmp_path, field, value):
    side, manifest = _store(tmp_path, {**GOOD, "seq": 1, field: value})
    with pytest.raises(FFDebugError) as err:
        open_side(side)
    msg = str(err.value)
    assert err.value.exit_code == 2 and "\n" not in msg
    assert msg.startswith(f"{manifest}:2: ")
    assert f"manifest field '{field}' must be" in msg


def test_the_cli_exits_2_with_one_line(tmp_path):
    side, manifest = _store(tmp_path, dict(GOOD, seq=1, layer="3"))
    result = CliRunner().invoke(app, ["inspect", str(side)])
    err = result.output.strip()
    assert result.exit_code == 2 and len(err.splitlines()) == 1, result.output
    assert f"{manifest}:2:" in err and "'layer'" in err


def test_missing_key_is_named(tmp_path):
    side, manifest = _store(tmp_path, {"seq": 1})
    with pytest.raises(FFDebugError, match=rf"^{manifest}:2: manifest record lacks 'key'/'seq'"):
        open_side(side)


@pytest.mark.integration
def test_written_records_round_trip(tmp_path):
    w = StoreWriter(str(tmp_path / "s"), "ref")
    t = torch.arange(6.0).reshape(2, 3)
    w.write("L001.attn_out", t, {"layer": 1, "io": "out", "shard": {"dim": 1, "index": 0, "count": 1}})
    w.close()
    (rec,) = open_side(tmp_path / "s").records
    assert isinstance(rec, Record) and rec.has_payload and rec.layer == 1 and rec.shape == (2, 3)
    assert rec.shard == ShardSpec(1, 0, 1) and rec.dtype == "float32"
    assert np.array_equal(rec.load(), t.numpy()) and rec.load().dtype == np.float32
    assert rec.stats["numel"] == 6 and rec.stats["max"] == 5.0


def test_a_new_importer_is_one_registration(tmp_path):
    from ffdebug.io import registry
    from ffdebug.io.side import SideStore
    from ffdebug.io.sources import InMemory

    path = tmp_path / "dump.peer"
    path.write_text("x")

    def read(p):
        rec = Record(
            key="L000.out", seq=0, layer=0, dtype="float32", shape=(2,), source=InMemory(torch.ones(2))
        )
        return SideStore(path=p, records=[rec], run={"side": "peer"}, kind="peer")

    before = list(registry.importers())  # built-ins loaded first, restored after
    try:
        registry.register_importer(registry.Importer("peer", detect=lambda p: p.endswith(".peer"), read=read))
        store = open_side(str(path))
        assert store.kind == "peer" and np.array_equal(store.records[0].load(), np.ones(2, dtype=np.float32))
    finally:
        registry._IMPORTERS[:] = before
    assert [i.name for i in registry.importers()] == ["sglang", "atom", "safetensors", "atom-pt"]


def test_record_attributes_are_the_manifest_fields():
    import dataclasses

    from ffdebug.store.schema import RECORD_KEYS

    names = {f.name for f in dataclasses.fields(Record)}
    assert set(RECORD_KEYS) | {"persistent", "over_budget", "extra", "unknown", "source"} == names


@pytest.mark.parametrize("pad", [0, 1, 2, 3])
def test_payload_read_mapped_or_copied_equals_the_bytes_and_never_writes_the_file(tmp_path, pad):
    """A payload whose data starts at a multiple of 4 bytes is mapped, otherwise copied: either way
    the tensor holds the file's values, and writing into it leaves the file as it was."""
    from ffdebug.io.safetensors import load_payload

    values = torch.arange(1000, dtype=torch.float32) / 7
    header = json.dumps({"tensor": {"dtype": "F32", "shape": [10, 100], "data_offsets": [0, 4000]}})
    header += " " * ((pad - 8 - len(header)) % 4)  # the data starts at 8 + len(header) ≡ pad (mod 4)
    raw = len(header).to_bytes(8, "little") + header.encode() + values.numpy().tobytes()
    assert (8 + len(header)) % 4 == pad
    path = tmp_path / "p.safetensors"
    path.write_bytes(raw)
    x = load_payload(str(path), "tensor")
    assert x.dtype == np.float32 and x.shape == (10, 100) and np.array_equal(x.reshape(-1), values.numpy())
    x.fill(0.0)
    assert path.read_bytes() == raw
    assert np.array_equal(load_payload(str(path), "tensor").reshape(-1), values.numpy())
