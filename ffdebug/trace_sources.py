"""Which module output a tapped tensor is: `ffdebug trace`'s identity match (docs/playbooks.md "Playbooks,
review and trace"; docs/trainer-taps.md "LM training").

While a trace runs, every module output is held here (a reference to the tensor, detached: no copy
and no autograd graph), newest last, up to a budget of storage bytes. A tap (or a returned tensor)
is then matched against them:

- **same**: the tap shares an output's storage at the same offset, shape and strides (it is that
  tensor, or a tensor taken from an output tuple such as `hidden_states[i]`);
- **view**: the tap shares an output's storage with another layout (a slice, a reshape);
- **equal**: another tensor, bit-equal to an output of the same dtype, shape and device (a copy;
  compared as raw bits, so NaN payloads match and -0.0 is not 0.0; empty tensors never match).

The first relation that matches wins; its modules are listed in the order their outputs were made,
so the module that produced a tensor comes before a parent that returned it unchanged.

Memory: the index holds at most `budget_bytes` of output storage (each storage counted once). In a
training step autograd keeps most of those tensors alive anyway; what it would have freed (outputs
under `no_grad`, outputs the backward does not need) stays allocated until the trace ends. Past the
budget (or past MAX_HELD outputs) the oldest are dropped and counted, so a tap of an early output may
read "no module output equals it" with the number dropped. An output changed in place after it was
made is matched by storage, not by its old values. Tensors without a plain storage (nested tensors,
vmap's batched tensors, tensor subclasses that refuse it) are neither held nor matched: the match
never raises into the traced program.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_BUDGET_MIB = 512
MAX_HELD = 100_000  # outputs held at most, whatever their bytes (empty outputs and views cost none)
MAX_NAMES = 4
RELATIONS = ("same", "view", "equal")


@dataclass(frozen=True)
class Source:
    """Where a tapped tensor comes from: its relation to module outputs and their names."""

    relation: str | None  # "same" | "view" | "equal"; None: no held output matches
    modules: tuple[str, ...]  # at most MAX_NAMES, in the order the outputs were made
    more: int  # further matching outputs not named
    held: int  # outputs held when the tap was matched
    dropped: int  # outputs dropped by the budget before it

    def describe(self) -> str:
        """`the output of M`, `a view of the output of M`, `equal to the output of M`, or why none."""
        if self.relation is None:
            why = f"; {self.dropped} older output(s) dropped by the memory budget" if self.dropped else ""
            return f"no module output equals it ({self.held} held{why})"
        first, others = self.modules[0], self.modules[1:]
        lead = {"same": "the output of", "view": "a view of the output of", "equal": "equal to the output of"}
        text = f"{lead[self.relation]} {first}"
        if others or self.more:
            also = ", ".join(others) + (f" and {self.more} more" if self.more else "")
            text += f" (also {also.lstrip(', ')})"
        return text

    def to_json(self) -> dict:
        """Stable keys: relation, modules, more, held, dropped."""
        return {
            "relation": self.relation,
            "modules": list(self.modules),
            "more": self.more,
            "held": self.held,
            "dropped": self.dropped,
        }


@dataclass
class _Held:
    name: str
    tensor: torch.Tensor
    storage: int  # data pointer of the untyped storage
    nbytes: int  # the storage's size, counted once per storage


class OutputIndex:
    """Module outputs held for the identity match, oldest first, within `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes}: must be >= 0")
        self.budget_bytes = budget_bytes
        self._held: deque[_Held] = deque()
        self._storage_refs: dict[int, int] = {}  # storage pointer -> outputs held on it
        self.held_bytes = 0
        self.dropped = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Hold `tensor` (an output of module output `name`), dropping the oldest past the budget."""
        if self.budget_bytes == 0:
            return
        plain = _plain(tensor)
        if plain is None:
            return
        t, pointer, nbytes = plain
        if nbytes > self.budget_bytes:
            self.dropped += 1
            return
        if pointer not in self._storage_refs:
            self.held_bytes += nbytes
        self._storage_refs[pointer] = self._storage_refs.get(pointer, 0) + 1
        self._held.append(_Held(name, t, pointer, nbytes))
        while (self.held_bytes > self.budget_bytes or len(self._held) > MAX_HELD) and self._held:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        old = self._held.popleft()
        self.dropped += 1
        left = self._storage_refs[old.storage] - 1
        if left:
            self._storage_refs[old.storage] = left
        else:
            del self._storage_refs[old.storage]
            self.held_bytes -= old.nbytes

    def match(self, tensor: torch.Tensor) -> Source:
        """The held outputs `tensor` is (same storage and layout), views (same storage) or equals."""
        found: dict[str, list[str]] = {r: [] for r in RELATIONS}
        plain = _plain(tensor)
        if plain is not None:
            t, pointer, _ = plain
            for h in self._held:
                o = h.tensor
                if o.device != t.device:
                    continue
                if pointer and h.storage == pointer:
                    same = (
                        o.storage_offset() == t.storage_offset()
                        and o.shape == t.shape
                        and o.stride() == t.stride()
                        and o.dtype == t.dtype
                    )
                    found["same" if same else "view"].append(h.name)
                elif not found["same"] and t.numel() and o.shape == t.shape and o.dtype == t.dtype:
                    if _bit_equal(o, t):
                        found["equal"].append(h.name)
        relation = next((r for r in RELATIONS if found[r]), None)
        names = _unique(found[relation]) if relation else []
        return Source(
            relation=relation,
            modules=tuple(names[:MAX_NAMES]),
            more=max(0, len(names) - MAX_NAMES),
            held=len(self._held),
            dropped=self.dropped,
        )


def _plain(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
    """(detached tensor, storage pointer, storage bytes) of a tensor with a plain strided storage,
    else None (nested, batched under vmap, meta, sparse, a subclass that refuses its storage)."""
    import torch

    try:
        if tensor.is_nested or tensor.is_meta or tensor.layout != torch.strided:
            return None
        t = tensor.detach()
        storage = t.untyped_storage()
        return t, storage.data_ptr(), storage.nbytes()
    except Exception:  # noqa: BLE001 - a tensor kind without a storage: not matched, never raised
        return None


_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits (floats viewed as integers of their width: NaN equals its own payload)."""
    import torch

    try:
        if (a.is_floating_point() or a.is_complex()) and a.element_size() in _BITS:
            bits = getattr(torch, _BITS[a.element_size()])
            return bool(torch.equal(a.view(bits), b.view(bits)))
        return bool(torch.equal(a, b))
    except Exception:  # noqa: BLE001 - a dtype that cannot be viewed: compared by value
        return bool(torch.equal(a, b))


def _unique(names: list[str]) -> list[str]:
    """Names in first-seen order, each once (a module called twice made two outputs)."""
    return list(dict.fromkeys(names))
