"""A step whose taps stand in known relations to module outputs (tests/review/test_trace_sources.py).

`Stack` returns every block's output and the norm's, as HF's `output_hidden_states` does: the taps
take them from that tuple, as a drafter's training loop takes its features."""

from __future__ import annotations

import torch

import ffdebug


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class Stack(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        states = []
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        states.append(self.norm(x))
        return tuple(states)


def one_step():
    torch.manual_seed(0)
    model = Stack()
    states = model(torch.randn(2, 5, 8))
    ffdebug.tap("features.layer1", states[1])  # the output of layers.1
    ffdebug.tap("features.last", states[-1])  # the norm's, not layers.2's
    ffdebug.tap("features.first_token", states[0][:, 0])  # a view of layers.0's output
    ffdebug.tap("features.copy", states[2].clone())  # bit-equal to layers.2's output
    ffdebug.tap("features.sum", states[0] + states[1])  # computed: no module made it
    return {"last": states[-1]}
