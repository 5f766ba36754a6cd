"""`attn.q_rot` / `attn.k_rot` as the attention kernel reads them (docs/dumping.md "Stage names by role").

Two codebases rarely call their rotary embedding by one name (transformers alone has
`apply_rotary_pos_emb`, `apply_rotary_pos_emb_interleave`, `apply_multimodal_rotary_pos_emb`, …;
an engine port has its own), but every attention hands its rotated q and k to a kernel. While a
block child runs, a `KernelWatcher` sees the first attention kernel call it makes:

| kernel | q, k read as | scale |
|---|---|---|
| `F.scaled_dot_product_attention(q, k, v, …, scale=s)` | `[..., heads, S, D]` (its contract) | a non-default `s` is folded into q: `q · s · √D` |
| eager `q @ kᵀ` (`torch.matmul` / `@` of two 4-D activations) | `[..., heads, S, D]` and the transposed second operand | a scalar `· s` (or `/ s`) taken of the scores right after is folded the same way |

A child that convolves over the sequence first (Mamba, gated delta nets: a sequence mixer compared
as a whole, `models/subroles.branch_substages`) reads nothing. Those q / k are written as
`attn.q_rot` / `attn.k_rot`, `[batch, seq, heads, head_dim]` like the role
sub-stages, when both of them are more than a projection's output moved around (views, splits,
copies, casts, GQA repetition: the "plain" lineage below), i.e. when something (rotary, q / k
norms) computed them; a model without either writes no rotary stage, as before. k repeated for GQA
(each KV head copied to its group's query heads, `repeat_kv`) is stored with its own KV heads. A
call whose k holds more positions than q (a decode step reading a cache) writes q only: the cache's
layout is the engine's, not the model's.

Function taps of a rotary stage (transformers' own rotary functions, listed by introspection in
`capture.functions`, and `ffdebug.tap_function(..., ("attn.q_rot", "attn.k_rot"))`) are the
fallback: inside a watched child each is held in its place among the captures and written only if
that call of the child sees no kernel it reads (flash-attention's fused kernel, an einsum
attention). MLA runs a projection (kv_b) between its rotary and its kernel, so the decision waits
for the child's return.
"""

from __future__ import annotations

import math
import threading

from ffdebug.capture.outputs import first_tensor, tensors_of

ROTARY_STAGES = ("attn.q_rot", "attn.k_rot")
_LOCAL = threading.local()  # the stack of watchers whose child is running on this thread

_PLAIN: tuple = ()


def active():
    """The watcher of the innermost watched child running now, or None."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def _plain_calls() -> tuple:
    """Calls that only move a tensor's elements (views, splits, copies, casts, repetition)."""
    global _PLAIN
    if not _PLAIN:
        import torch

        from ffdebug.capture.branch_calls import casts, splits, views

        T = torch.Tensor
        _PLAIN = (*views(), *splits(), *casts()) + (
            T.transpose, torch.transpose, T.permute, torch.permute, T.contiguous, T.clone, torch.clone,
            T.expand, T.expand_as, T.repeat, T.repeat_interleave, torch.repeat_interleave, T.flatten,
            torch.flatten, T.squeeze, T.unsqueeze, torch.squeeze, torch.unsqueeze, T.movedim,
            torch.movedim, T.select, T.detach,
        )  # fmt: skip
    return _PLAIN


def _projections() -> tuple:
    import torch
    import torch.nn.functional as F

    return (F.linear, torch.addmm)


def _tensors(obj):
    """The tensors of a call's argument or output (a tensor, or a split's tuple of them)."""
    return (t for _, t in tensors_of(obj))


def _kv_repeat(k):
    """(k with its own KV heads, the repetition) for a `[..., heads, S, D]` k whose consecutive
    heads repeat in groups (`repeat_kv`); (k, 1) when they do not."""
    import torch

    heads = k.shape[-3]
    if heads < 2 or not torch.equal(k[..., 0, :, :], k[..., 1, :, :]):
        return k, 1
    for n in sorted((d for d in range(2, heads + 1) if heads % d == 0), reverse=True):
        own = k[..., ::n, :, :]
        if torch.equal(own.repeat_interleave(n, dim=-3), k):
            return own, n
    return k, 1


def _rope_part(k, v) -> int:
    """The width of an MLA key's rotary part, else 0: the trailing columns every head of k shares
    (DeepSeek's k_pe is one head expanded to all: the unabsorbed form), or, for a one-head k whose
    leading columns are v (the absorbed form attends over the latent: k = [c | k_pe], v = c), what
    follows v."""
    import torch

    heads, d = k.shape[-3], k.shape[-1]
    if heads > 1:
        same = (k == k[..., :1, :, :]).flatten(0, -2).all(0) if k.dim() == 4 else None
        if same is None or bool(same.all()):
            return 0  # one head repeated (GQA with one KV head), or not 4-D
        tail = int(torch.flip(same, [0]).int().cumprod(0).sum())
        if tail and not bool(k[..., d - tail :].any()):
            return 0  # zero columns every head shares: a head dim padded for a kernel, not rope
        return tail if 0 < tail < d else 0
    if isinstance(v, torch.Tensor) and v.shape[:-1] == k.shape[:-1] and 0 < v.shape[-1] < d:
        if torch.equal(k[..., : v.shape[-1]], v):
            return d - v.shape[-1]
    return 0


def _two_tensors(q, k, dims: int) -> bool:
    """`q` and `k` tensors of `dims` dims, `q` floating: what a scores product's operands are."""
    import torch

    return (
        isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and q.dim() == dims
        and k.dim() == dims
        and q.is_floating_point()
    )


def _scores_3d(q, kt) -> bool:
    """A batched `q @ kᵀ` with the heads folded into the batch: two 3-D activations contracted over
    the head size (the second no parameter)."""
    import torch

    return (
        _two_tensors(q, kt, 3)
        and not any(isinstance(t, torch.nn.Parameter) for t in (kt, getattr(kt, "_base", None)))
        and q.shape[0] == kt.shape[0]
        and q.shape[-1] == kt.shape[-2]
    )  # stacked expert weights are parameters (or views of one): never keys


class _Call:
    """One call of a watched child."""

    seen = False  # the kernel was seen (its q / k written or not): function taps stand down
    attended = False  # a softmax attention kernel ran in this call (role naming reads it)
    function = ""  # the rotary function tapped in this call before the kernel, if any
    lead: tuple = ()  # the child input's token dims: `(T,)` for a packed `[T, hidden]` input


class KernelWatcher:
    """Hooks of one block child: watch its call for the first attention kernel (module doc)."""

    def __init__(self, session, module, path: str = "") -> None:
        self.session, self.module, self.path = session, module, path
        self.mode = None
        self.call = _Call()

    def attended(self) -> bool:
        """An attention kernel ran in the child's last call (read by its output hook)."""
        return self.call.attended

    def install(self, handle) -> None:
        # plain functions, not bound methods: a deep copy of the model shares them, so install on
        # the copy drops them as inherited (capture/copies.py)
        handle.add(self.module.register_forward_pre_hook(lambda m, a: self.pre(m, a)))
        handle.add(self.module.register_forward_hook(lambda m, a, o: self.post(m, a, o), always_call=True))

    def _wanted(self) -> bool:
        from ffdebug.capture.state import current_layer

        s = self.session
        if not s.enabled_rank or s.closed or (s.call_depth > 0 and not s.call_selected):
            return False
        layer = current_layer()
        prefix = f"L{layer:03d}." if layer is not None else ""
        return any(s.wants(prefix + stage, layer) for stage in ROTARY_STAGES)

    def pre(self, module, args) -> None:
        import torch
        from torch.overrides import TorchFunctionMode

        if self.mode is not None or not self._wanted():
            return
        self.call = _Call()  # this call of the child: whether the kernel was seen
        x = first_tensor(args, {})
        self.call.lead = tuple(x.shape[:-1]) if x is not None else ()
        self.pending = None  # an eager q @ kᵀ waiting for its scale: (q, k, scores)
        self.deferred: list = []  # function taps of a rotary stage not held: written at the return
        self.plain: dict[int, object] = {}  # storage -> a live tensor of the plain lineage
        watcher = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                with torch._C.DisableTorchFunction():  # no mode sees the watcher's own ops
                    watcher.after(func, args, kwargs, out)
                return out

        self.mode = _Mode()
        self.mode.__enter__()
        _LOCAL.stack = [*getattr(_LOCAL, "stack", []), self]

    def post(self, module, args, output) -> None:
        if self.mode is None:
            return
        mode, self.mode = self.mode, None
        mode.__exit__(None, None, None)
        _LOCAL.stack = _LOCAL.stack[:-1]
        if self.pending is not None:
            self._write_pending(1.0)
        self._flush()
        self.plain = {}

    # -- function taps (the fallback) --------------------------------------------------------------
    def defer(self, stage: str, tensor, source: str = "") -> bool:
        """Take a function tap's rotary stage (True), or leave it to the caller (False). It is
        written, in its place among the captures, only if this call of the child sees no kernel."""
        import ffdebug

        if stage not in ROTARY_STAGES:
            return False
        call, copy = self.call, tensor.detach().clone()
        call.function = call.function or source  # named in the kernel's records (`rotary_function`)

        def write():
            if not call.seen:
                ffdebug.tap(stage, copy)

        if not self.session.hold(write):  # captures held (a block's first call, sub-stages): in place
            self.deferred.append(write)  # else at the child's return, before its output is written
        return True

    def _flush(self) -> None:
        deferred, self.deferred = self.deferred, []
        for write in deferred:
            write()

    def after(self, func, args, kwargs, out) -> None:
        import torch
        import torch.nn.functional as F

        if self.pending is not None:
            self._scale_of_scores(func, args, out)
        if func in _projections():
            self._mark_plain(out)
            return
        if func in _plain_calls() and any(
            t.untyped_storage().data_ptr() in self.plain for t in _tensors(args[:1])
        ):
            self._mark_plain(out)
            return
        if self.call.seen:
            return
        if func in (F.conv1d, torch.conv1d):  # a sequence mixer (state-space, linear attention): its
            self.call.seen = True  # products of q and k are no softmax attention's; nothing is read
            return
        if func is F.scaled_dot_product_attention:
            q = args[0] if args else kwargs.get("query")
            k = args[1] if len(args) > 1 else kwargs.get("key")
            scale = args[6] if len(args) > 6 else kwargs.get("scale")
            v = args[2] if len(args) > 2 else kwargs.get("value")
            if self._is_kernel(q, k):
                self.call.seen = self.call.attended = True
                d = q.shape[-1]
                self._write(q, k, 1.0 if scale is None else float(scale) * math.sqrt(d), v)
        elif func in (torch.bmm, torch.Tensor.bmm) and len(args) >= 2 and _scores_3d(args[0], args[1]):
            self.call.attended = True  # heads folded into the batch (`[B·H, S, D] @ [B·H, D, S]`): not read
        elif (
            func in (torch.baddbmm, torch.Tensor.baddbmm) and len(args) >= 3 and _scores_3d(args[1], args[2])
        ):
            self.call.attended = True  # the scores as `β·bias + α·q @ kᵀ` (GPT-NeoX-Japanese): not read
        elif self.call.attended:
            return  # the scores were made: a later 4-D product is probabilities @ v, no kernel
        elif func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and len(args) >= 2:
            q, kt = args[0], args[1]
            if isinstance(kt, torch.Tensor) and kt.dim() == 4 and self._is_kernel(q, kt.transpose(-1, -2)):
                self.call.seen = self.call.attended = True
                self.pending = (q, kt.transpose(-1, -2), out)

    def _mark_plain(self, out) -> None:
        for t in _tensors(out):
            self.plain[t.untyped_storage().data_ptr()] = t  # kept alive: its address is not reused

    def _is_kernel(self, q, k) -> bool:
        import torch

        return (
            _two_tensors(q, k, 4)
            and not isinstance(q, torch.nn.Parameter)
            and not isinstance(k, torch.nn.Parameter)
            and q.shape[-1] == k.shape[-1]
            and q.shape[0] == k.shape[0]
        )

    def _scale_of_scores(self, func, args, out) -> None:
        """The op right after an eager `q @ kᵀ`: a scalar multiple of the scores is the scale."""
        import torch

        q, k, scores = self.pending
        factor = 1.0
        if len(args) >= 2 and args[0] is scores and isinstance(args[1], (int, float)):
            d = math.sqrt(q.shape[-1])
            if func in (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__):
                factor = float(args[1]) * d
            elif func in (torch.div, torch.Tensor.div, torch.Tensor.__truediv__) and args[1]:
                factor = d / float(args[1])
        self._write_pending(factor)

    def _write_pending(self, factor: float) -> None:
        q, k, _ = self.pending
        self.pending = None
        self._write(q, k, factor)

    def _write(self, q, k, factor: float, v=None) -> None:
        """Write q / k of the kernel (module doc) unless both are plain projection outputs."""
        plain = self.plain
        if q.untyped_storage().data_ptr() in plain or k.untyped_storage().data_ptr() in plain:
            return  # no rotary (nor norm) computed q and k: nothing a projection stage does not hold
        extra = {"read_at": "attention kernel", "orig_shape": list(q.shape), "layout": "B,H,S,D"}
        where = {"module_path": self.path, "module_class": type(self.module).__name__}
        rope = _rope_part(k.detach(), v)
        if rope:  # MLA: the rotary part alone, unscaled (the two forms' kernels differ in width)
            d = q.shape[-1]
            q, k = q[..., d - rope :], k[..., d - rope :]
            extra["rope_part"] = [d - rope, d]
        elif abs(factor - 1.0) > 1e-6:
            q = q * factor
        own, rep = _kv_repeat(k.detach())
        if self.call.function:
            extra["rotary_function"] = self.call.function
        self.session.tap_placed("attn.q_rot", self._tokens_first(q.detach()), extra, **where)
        if k.shape[-2] == q.shape[-2]:  # a decode step's k is a cache: its layout is the engine's
            k_extra = dict(extra, orig_shape=list(k.shape), **({"kv_repeat": rep} if rep > 1 else {}))
            self.session.tap_placed("attn.k_rot", self._tokens_first(own), k_extra, **where)

    def _tokens_first(self, t):
        """`[..., heads, S, D]` as `[..., S, heads, D]`; a packed child (its input `[T, hidden]`)
        that ran the kernel on one row of T tokens gives `[T, heads, D]`, like its other stages."""
        t = t.transpose(-3, -2)
        lead = self.call.lead
        if len(lead) == 1 and t.dim() == 4 and t.shape[0] == 1 and t.shape[1] == lead[0]:
            return t[0]
        return t
