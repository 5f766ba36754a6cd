"""The direct children of a block, named by role (docs/dumping.md "Stage names by role").

Split from `capture/hooks.py`: the block's children are hooked here, their roles decided on the
block's first call (`ffdebug.models.roles`) and their outputs written under those names.
"""

from __future__ import annotations

from ffdebug.models.blocks import CANONICAL_CHILDREN
from ffdebug.models.roles import (
    ATTENTION,
    BRANCH,
    CROSS,
    NORM,
    NORM_LED,
    NORM_SHAPED,
    Placement,
    fed_encoder_states,
    has_role,
    is_norm,
    is_norm_type,
    norm_shaped,
    place_children,
    role_children,
)


def tensors_of(obj, prefix: str = ""):
    from ffdebug.capture.outputs import tensors_of as tensors

    return tensors(obj, prefix)


def _is_linear(module) -> bool:
    import torch.nn as nn

    return isinstance(module, nn.Linear)


def _own_norms(child) -> list:
    """The direct sub-modules of `child` that are norms by type or by their parameters."""
    return [m for m in child.children() if is_norm_type(m) or norm_shaped(m)]


class ChildRoles:
    """The direct children of one block, named by role (`ffdebug.models.roles`).

    On the block's first call every capture made inside it (its children, taps, sub-stages, inner
    blocks) is held by the session, in capture order, until the block returns: only then is the
    order around the residual adds known. The held captures are then written in that same order
    (a copy of each tensor is held, and the live one for its gradient). Later calls capture at
    once under the names decided then."""

    _warned: set[str] = set()

    def __init__(self, session, capture, block, prefix: str, base: dict) -> None:
        self.session, self.capture, self.block = session, capture, block
        self.prefix, self.base = prefix, base
        self.names: dict[str, str] | None = None
        self.called: list[tuple[str, str]] = []
        self.cross: set[str] = set()  # children fed the encoder's states
        self.encoder = None  # the encoder states of the block's call in flight (`begin`)
        self.hidden_shape: tuple | None = None  # the shape of the block's hidden input (`begin`)
        self.by_path: set[str] = set()  # members of a list of like parts: `{child}.out`
        self.holding = False
        self.watchers: dict = {}  # child name -> its KernelWatcher (`kernel_taps`): did it attend
        self.inputs: dict[str, object] = {}  # child name -> its input on the first call (held until flush)
        self.led: set[str] = set()  # children whose own norm reads their input first (`NORM_LED`)
        self.bare: set[str] = set()  # children that are plain projections (`nn.Linear`)

    def install(self, handle) -> None:
        for name, child, by_path in role_children(self.block.module):
            if by_path:
                self.by_path.add(name)
            if has_role(child):
                meta = dict(
                    self.base, module_class=type(child).__name__, module_path=f"{self.block.path}.{name}"
                )
                handle.add(
                    child.register_forward_pre_hook(
                        lambda m, a, kw, n=name: self.on_input(n, a, kw), with_kwargs=True
                    )
                )
                handle.add(
                    child.register_forward_hook(
                        lambda m, a, o, n=name, meta=meta: self.on_output(n, m, o, meta, a)
                    )
                )
                for norm in _own_norms(child):
                    handle.add(norm.register_forward_pre_hook(lambda m, a, n=name: self.on_norm(n, a)))

    def on_input(self, name: str, args, kwargs) -> None:
        if self.names is None:
            enc = self.encoder
            given = (*args, *kwargs.values())
            if fed_encoder_states(args, kwargs) or (enc is not None and any(t is enc for t in given)):
                self.cross.add(name)  # the block's own encoder states, under any argument name (`key=`)
            if args and name not in self.inputs:
                self.inputs[name] = args[0]

    def on_norm(self, name: str, args) -> None:
        """A norm of child `name` runs: the child is norm-led when that norm reads the child's own
        input tensor (a gated norm: `norm(x) · σ(g(norm(x)))`); only on the block's first call."""
        if self.names is None and name not in {n for n, _ in self.called} and args:
            if self.inputs.get(name) is args[0]:
                self.led.add(name)

    def begin(self, encoder=None, hidden_shape: tuple | None = None) -> None:
        """At the block's start (after its input was captured): hold until the names are known.
        `encoder`: the encoder states the block was given, if any (a child passed that very tensor
        is a cross-attention); `hidden_shape`: the shape of the block's hidden input."""
        self.encoder, self.hidden_shape = encoder, hidden_shape
        if self.names is None and not self.holding:
            self.holding = True
            self.session.begin_hold()

    def on_output(self, name: str, module, output, meta: dict, args=()) -> None:
        # a child called twice in one call (a shared dropout) gets its own invocation index
        inv = self.session.next_invocation(meta["module_path"])
        if self.names is not None:
            self.emit(name, [(sfx, t, t) for sfx, t in tensors_of(output)], inv, meta)
            return
        pairs = list(tensors_of(output))
        if not pairs:
            return
        if name not in {n for n, _ in self.called}:
            x = args[0] if args else None
            kind = NORM if is_norm(module, pairs[0][1], x) else CROSS if name in self.cross else BRANCH
            watcher = self.watchers.get(name)
            if kind == BRANCH and watcher is not None and watcher.attended():
                kind = ATTENTION
            elif kind == BRANCH and norm_shaped(module):
                kind = NORM_SHAPED
            elif kind == BRANCH and name in self.led:
                kind = NORM_LED
            if _is_linear(module):
                self.bare.add(name)
            self.called.append((name, kind))
        held = [(sfx, t.detach().clone(), t) for sfx, t in pairs]
        if not self.session.hold(lambda: self.emit(name, held, inv, meta)):
            self.emit(name, held, inv, meta)

    def emit(self, name: str, pairs: list, inv: int, meta: dict) -> None:
        stage = (self.names or {}).get(name, f"{name}.out")
        for i, (suffix, copy, live) in enumerate(pairs):
            key = f"{self.prefix}.{stage}" if i == 0 else f"{self.prefix}.{stage}{suffix}"
            self.capture(key, copy, grad_source=live, invocation=inv, **meta)

    def flush(self) -> None:
        """At the block's return: decide the names (first call) and write what was held."""
        if self.names is None:
            called = [c for c in self.called if c[0] not in self.by_path]
            if called and all(n in self.bare for n, _ in called):
                # a block of bare projections (an attention module standing as the block, its
                # kernel in its own forward): no residual branches to read, named by path
                placement = Placement({n: f"{n}.out" for n, _ in called}, tuple(n for n, _ in called), False)
            else:
                attended = frozenset(n for n, w in self.watchers.items() if w.attended())
                placement = place_children(
                    called,
                    CANONICAL_CHILDREN,
                    hidden_stream=self._hidden_stream(),
                    attended=attended,
                    unattended=frozenset(self.watchers) - attended,
                )
            self.names = {**placement.names, **{n: f"{n}.out" for n in self.by_path}}
            self.inputs = {}
            if placement.unplaced:
                self._warn(placement.unplaced)
        if self.holding:
            self.holding = False
            for replay in self.session.end_hold():
                replay()

    def _hidden_stream(self) -> frozenset[str]:
        """The children whose first input has the block's hidden token count (its shape but the
        last dim) where the encoder states' differs: the stream a joint block's branch reads."""
        if self.hidden_shape is None:
            return frozenset()
        tokens = tuple(self.hidden_shape[:-1])
        enc = None if self.encoder is None else tuple(self.encoder.shape[:-1])
        return frozenset(
            n
            for n, x in self.inputs.items()
            if hasattr(x, "shape") and tuple(x.shape[:-1]) == tokens and tokens != enc
        )

    def _warn(self, unplaced: tuple[str, ...]) -> None:
        from ffdebug.logs import get_logger

        cls = self.block.class_name
        self.session.note_unplaced(cls, unplaced)
        if cls in self._warned:
            return
        self._warned.add(cls)
        get_logger("capture").warning(
            f"{cls} ({self.block.path}): could not place {', '.join(unplaced)} by role "
            f"(more than two branches, no name hint); dumped as L{{NNN}}.<child>.out — name them with "
            "install(model, stage_names={...}) or compare --map"
        )
