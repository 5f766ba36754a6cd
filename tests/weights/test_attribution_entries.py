"""Attribution entries on ports (`bisect --model-ref / --model-target`): the forward's input
keyword, a file entry's own folder importable, every failure one line (ffdebug/bisection/attribution.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ffdebug.bisection.attribution import load_entry, replay
from ffdebug.errors import FFDebugError

PORT = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


class Port(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, tokens):  # not input_ids
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        return h
"""
ENTRY = """
def build():
    from port_model import Port  # a sibling module, imported when the entry is called
    return Port()


def build_kw():
    from port_model import Port
    return Port(), "tokens"


def build_wrong_kw():
    from port_model import Port
    return Port(), {"input_ids": None}
"""


class _Rec:
    def __init__(self, t):
        self.t = t

    def load(self):
        return self.t


@pytest.fixture
def entry_dir(tmp_path):
    (tmp_path / "port_model.py").write_text(PORT)
    (tmp_path / "entry.py").write_text(ENTRY)
    return tmp_path


def _run(spec):
    model, kwargs = load_entry(spec, "--model-target")
    ids = torch.tensor([[1, 2, 3]])
    h0 = model.emb(ids).detach()
    return model, replay(model, kwargs, {0: _Rec(h0), 1: _Rec(h0 * 0)}, _Rec(ids)), h0


def test_port_forward_with_another_keyword(entry_dir):
    for fn in ("build", "build_kw"):  # auto (first positional) and (model, "tokens")
        model, outs, h0 = _run(f"{entry_dir / 'entry.py'}:{fn}")
        assert sorted(outs) == [0, 1]
        with torch.no_grad():
            assert torch.equal(outs[0], model.blocks[0](h0))  # block 0 fed the reference input
            assert torch.equal(outs[1], model.blocks[1](h0 * 0))


def test_forward_failure_is_one_line(entry_dir, monkeypatch):
    with pytest.raises(FFDebugError) as err:
        _run(f"{entry_dir / 'entry.py'}:build_wrong_kw")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--model-target: Port.forward(input_ids=) raised TypeError")
    import ffdebug._entry

    monkeypatch.setattr(ffdebug._entry, "call_entry", lambda spec: (nn.Linear(2, 2), 3))
    with pytest.raises(FFDebugError, match="second item must be the input keyword"):
        load_entry("x:y", "--model-target")
