"""Env-var parsing: defaults, validation naming the variable, ATOM aliases."""

from __future__ import annotations

import pytest

from ffdebug._env import parse_calls, parse_layers, read_dump_config, read_weight_dump_config
from ffdebug.errors import FFDebugError


def test_disabled_without_dir():
    assert read_dump_config({}) is None
    assert read_weight_dump_config({}) is None


def test_defaults():
    c = read_dump_config({"FFDEBUG_FWD_DUMP_DIR": "/tmp/x"})
    assert c.side == "target" and c.mode == "full" and c.layers.all and c.calls.spec == "all"
    assert c.layer_attrs == ("layer_id", "layer_idx", "layer_number") and not c.grads


def test_layers_ranges_negative_open():
    s = parse_layers("0,2,5-7,-1")
    assert [i for i in range(10) if s.contains(i, 10)] == [0, 2, 5, 6, 7, 9]
    assert [i for i in range(6) if parse_layers("3-").contains(i, 6)] == [3, 4, 5]
    with pytest.raises(FFDebugError, match="FFDEBUG_FWD_DUMP_LAYERS"):
        read_dump_config({"FFDEBUG_FWD_DUMP_DIR": "d", "FFDEBUG_FWD_DUMP_LAYERS": "a-b"})


def test_calls():
    assert parse_calls("2-4").contains(3) and not parse_calls("2-4").contains(5)
    assert parse_calls("first-real").first_real
    with pytest.raises(FFDebugError, match="FFDEBUG_FWD_DUMP_CALLS"):
        parse_calls("sometimes")


@pytest.mark.parametrize(
    "var,value",
    [
        ("FFDEBUG_FWD_DUMP_MODE", "everything"),
        ("FFDEBUG_FWD_DUMP_GRADS", "maybe"),
        ("FFDEBUG_FWD_DUMP_MAX_BYTES", "lots"),
        ("FFDEBUG_FWD_DUMP_QUEUE_BYTES", "-1"),
        ("FFDEBUG_FWD_DUMP_SIDE", "a b/c"),
    ],
)
def test_invalid_values_name_the_variable(var, value):
    with pytest.raises(FFDebugError, match=var):
        read_dump_config({"FFDEBUG_FWD_DUMP_DIR": "d", var: value})


def test_queue_bytes_default_and_zero():
    """256 MiB unless set; 0 (write on the forward thread) is allowed."""
    assert read_dump_config({"FFDEBUG_FWD_DUMP_DIR": "d"}).queue_bytes == 256 << 20
    assert (
        read_dump_config({"FFDEBUG_FWD_DUMP_DIR": "d", "FFDEBUG_FWD_DUMP_QUEUE_BYTES": "0"}).queue_bytes == 0
    )


def test_atom_aliases_and_precedence(caplog):
    c = read_dump_config(
        {
            "ATOM_FWD_DUMP_DIR": "/a",
            "ATOM_FWD_DUMP_ONE_SHOT": "1",
            "ATOM_FWD_DUMP_STATS_ONLY": "1",
            "ATOM_FWD_DUMP_LAYERS": "0",
            "ATOM_DEBUG_TOPK": "5",
        }
    )
    assert (
        c.dir == "/a" and c.calls.spec == "0" and c.mode == "stats" and c.layers.spec == "0" and c.topk == 5
    )
    c2 = read_dump_config({"ATOM_FWD_DUMP_DIR": "/a", "FFDEBUG_FWD_DUMP_DIR": "/f"})
    assert c2.dir == "/f"
    assert "FFDEBUG_FWD_DUMP_DIR" in caplog.text  # the ffdebug.env logger
    c3 = read_dump_config({"ATOM_FWD_DUMP_DIR": "/a", "ATOM_FWD_DUMP_ONE_SHOT": "0"})
    assert c3.calls.spec == "all"
    w = read_weight_dump_config({"ATOM_WEIGHT_DUMP_DIR": "/w", "ATOM_WEIGHT_DUMP_EXIT": "0"})
    assert w.dir == "/w" and not w.exit


def test_reversed_layer_range_is_an_error():
    """`5-2` selects nothing; it must not silently compare only embed/final stages."""
    with pytest.raises(FFDebugError, match="reversed"):
        parse_layers("5-2", "--layers")
    assert [i for i in range(8) if parse_layers("-3--1").contains(i, 8)] == [5, 6, 7]


def test_ranks_selection_from_env(tmp_path, monkeypatch):
    """FFDEBUG_FWD_DUMP_RANKS=1: rank 0 writes nothing, rank 1 writes its own rank directory."""
    import torch

    import ffdebug
    from ffdebug.capture import state

    monkeypatch.setenv("FFDEBUG_FWD_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("FFDEBUG_FWD_DUMP_RANKS", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        state.reset()
        ffdebug.tap("x", torch.ones(2))
        state.active_session().close()
    assert sorted(p.name for p in (tmp_path / "target").iterdir()) == ["rank001"]
