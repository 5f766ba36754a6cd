"""Planted mutations: one per role the model has, each with the result bisect should give.

A mutation is planted in a deep copy of the reference model, found from the reference's own dump
(its role sub-stage records name the module of each projection and, for a fused one, its columns):
nothing here reads an attribute name of a model family, except the two config switches transformers
itself defines for the behaviour mutated (`norm_topk_prob`, `sliding_window`).

| kind | planted | expected: layer, stage, sub-stage, pattern |
|---|---|---|
| `attn.q` / `attn.k` / `attn.v` / `attn.o` scaled | that projection's weight rows (its columns of a fused one) and bias × 1.5 in layer `ONE_LAYER` | that layer, its attention stage, the sub-stage, `jump` |
| `head zeroed` | head 1 of the attention context set to 0 where the output projection reads it, in layer `ONE_LAYER` | that layer, its attention stage, `attn.context` with head 1 its worst head, `jump` |
| `rope base` | every rotary table built from base^0.75 (its `inv_freq` ^ 0.75) | the first layer a rotary function rotates q in (its kernel record names the function; else the first with an `attn.q_rot`), `attn.q_rot`, any pattern |
| `norm eps` | every norm inside the blocks with eps 0.1 | layer 0, the first of its stages that holds such a norm, any pattern |
| `mlp.act` swapped | the MLP activation of layer `ONE_LAYER` replaced (one computing SiLU by GELU, any other by SiLU) | that layer, its MLP stage, `mlp.act`, `jump` |
| `experts swapped` | experts 0 and 1 of the first MoE layer exchanged (the container: parameters stacked over the config's E, or a list of E modules) | that layer, its MoE stage, a `moe.` sub-stage, `jump` |
| `top-k unnormalised` | `norm_topk_prob` off in every MoE layer | the first MoE layer, its MoE stage, `layer_class` |
| `window ignored` | `sliding_window` past the input length | the first sliding layer, `layer_class` when the model also has full layers |

"Any pattern" still requires a failing result: only `match` is wrong there (an error planted in
every layer saturates after the first, so `jump` and `drift` are both honest readings).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ffdebug.selftest.stages import BLOCK_STAGE, Dumped, DumpedStages, output_stage
from ffdebug.verdict import PatternName

ONE_LAYER = 1  # one-layer mutations go here: layer 0 is then an exactly equal prefix
SCALE = 1.5
EPS = 0.1
ROPE_EXPONENT = 0.75
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class Expected:
    """What bisect should name; None fields are not checked (`pattern` None: anything but match)."""

    layer: int
    stage: str | None
    sub_stage: str | None
    pattern: PatternName | None
    head: int | None = None  # the head the sub-stage's per-head error must name worst
    within: str | None = None  # the planted module's child below its block (`layer.0`, `norm1`): a
    # stage inside it (a T5 norm's first reader, `layer.0.SelfAttention.q.in`), or a block stage
    # whose sub-stage is it (`ffn_out`, sub-stage `norm1`), holds too
    streams: tuple[str, ...] = ()  # other stages that hold: where a module of several outputs
    # (a dual-stream attention's text output) sends the planted stream instead (`Planner.streams`)
    within_keys: tuple[str, ...] = ()  # role sub-stages read while `within` ran (its kernel's q_rot)

    def describe(self) -> str:
        parts = [f"layer {self.layer}"]
        parts += (
            [
                self.stage
                + (f" (or a stage inside {self.within})" if self.within else "")
                + (f" (or {' / '.join(self.streams)})" if self.streams else "")
            ]
            if self.stage
            else []
        )
        parts += [self.sub_stage] if self.sub_stage else []
        parts += [f"head {self.head}"] if self.head is not None else []
        parts.append(self.pattern.value if self.pattern else "any pattern but match")
        return ", ".join(parts)


@dataclass(frozen=True)
class Mutation:
    """One planted mutation: `plant(model)` changes `model` (a deep copy of the reference) in place."""

    kind: str
    where: str
    expected: Expected
    plant: Callable[[Any], None]

    def target(self, reference: Any) -> Any:
        model = copy.deepcopy(reference)
        self.plant(model)
        return model


def _columns(extra: dict) -> list[tuple[int, int]] | None:
    if "split" in extra:
        return [tuple(extra["split"])]
    if "split_cols" in extra:
        return [tuple(run) for run in extra["split_cols"]]
    return None


def _feature_axes(module: Any) -> tuple[int, int] | None:
    """(output axis, input axis) of a projection's 2-D weight: `nn.Linear` stores `[out, in]`,
    GPT-2's `Conv1D` (`nf` outputs) `[in, out]`; None for anything else."""
    import torch

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if isinstance(module, torch.nn.Linear):
        return 0, 1
    if isinstance(getattr(module, "nf", None), int) and weight.shape[1] == module.nf:
        return 1, 0
    return None


def _scale_output(path: str, cols: list[tuple[int, int]] | None, factor: float) -> Callable[[Any], None]:
    """The projection's output columns `cols` (all when None) x `factor`, in its weights (and bias):
    what a loader that scales a tensor does; the forward itself is untouched."""

    def plant(model: Any) -> None:
        import torch

        module = model.get_submodule(path)
        out_axis, _ = _feature_axes(module)  # type: ignore[misc]
        runs = cols or [(0, module.weight.shape[out_axis])]
        with torch.no_grad():
            for lo, hi in runs:
                module.weight.narrow(out_axis, lo, hi - lo).mul_(factor)
                if getattr(module, "bias", None) is not None:
                    module.bias[lo:hi].mul_(factor)

    return plant


def _zero_input_head(path: str, head: int, head_dim: int) -> Callable[[Any], None]:
    """One head of the attention context is zeros where the output projection reads it (its input,
    through a pre-hook: the heads that attention computed, minus one)."""

    def plant(model: Any) -> None:
        def pre(module, args):
            x = args[0].clone()
            x[..., head * head_dim : (head + 1) * head_dim] = 0
            return (x, *args[1:])

        model.get_submodule(path).register_forward_pre_hook(pre)

    return plant


class Planner(DumpedStages):
    """The mutations of one model, from the records of its reference dump."""

    def __init__(self, model: Any, records: list[Dumped]) -> None:
        super().__init__(records)
        self.model = model
        self.layers = sorted({r.layer for r in records if r.layer is not None})

    def all(self) -> list[Mutation]:
        return [
            *self.projections(),
            *self.head_zeroed(),
            *self.rope_base(),
            *self.norm_eps(),
            *self.activation(),
            *self.experts_swapped(),
            *self.topk_unnormalised(),
            *self.window_ignored(),
        ]

    def projections(self) -> list[Mutation]:
        out = []
        for kind in ("attn.q", "attn.k", "attn.v", "attn.o"):
            r = self.sub(ONE_LAYER, kind)
            if (
                r is None
                or not r.module_path
                or _feature_axes(self.model.get_submodule(r.module_path)) is None
            ):
                continue
            stage = self.block_stage(ONE_LAYER, r.module_path)
            out.append(
                Mutation(
                    f"{kind} scaled",
                    f"layer {ONE_LAYER}: {r.module_path} x {SCALE}",
                    Expected(
                        ONE_LAYER, stage, kind, PatternName.JUMP, streams=self.streams(ONE_LAYER, stage)
                    ),
                    _scale_output(r.module_path, _columns(r.extra), SCALE),
                )
            )
        return out

    def head_zeroed(self) -> list[Mutation]:
        r = self.sub(ONE_LAYER, "attn.context")
        heads = (r.extra or {}).get("heads") if r else None
        if r is None or not r.module_path or not isinstance(heads, int) or heads < 2:
            return []
        module = self.model.get_submodule(r.module_path)
        axes = _feature_axes(module)
        width = module.weight.shape[axes[1]] if axes else None
        if not isinstance(width, int) or width % heads:
            return []
        stage = self.block_stage(ONE_LAYER, r.module_path)
        return [
            Mutation(
                "head zeroed",
                f"layer {ONE_LAYER}: head 1 of {r.module_path}'s input",
                Expected(
                    ONE_LAYER,
                    stage,
                    "attn.context",
                    PatternName.JUMP,
                    head=1,
                    streams=self.streams(ONE_LAYER, stage),
                ),
                _zero_input_head(r.module_path, 1, width // heads),
            )
        ]

    def rope_base(self) -> list[Mutation]:
        tables = [name for name, buf in self.model.named_buffers() if name.endswith("inv_freq")]
        rotated = self._first_rotated()
        if not tables or rotated is None:
            return []

        def plant(model: Any) -> None:
            for name in tables:
                owner, _, attr = name.rpartition(".")
                module = model.get_submodule(owner) if owner else model
                setattr(module, attr, getattr(module, attr) ** ROPE_EXPONENT)

        return [
            Mutation(
                "rope base",
                f"{len(tables)} rotary table(s), inv_freq ^ {ROPE_EXPONENT}",
                Expected(rotated, None, "attn.q_rot", None),
                plant,
            )
        ]

    def _first_rotated(self) -> int | None:
        """The first layer whose `attn.q_rot` a rotary function made (the kernel's record names the
        function: a hybrid's linear-attention layers read q / k at a kernel without rotating them),
        else the first layer that has one."""
        rot = [r for r in self.records if r.key.endswith(".attn.q_rot") and r.layer is not None]
        named = [r.layer for r in rot if (r.extra or {}).get("rotary_function")]
        layers = named or [r.layer for r in rot]
        return min(layers) if layers else None

    def norm_eps(self) -> list[Mutation]:
        from ffdebug.models.roles import is_norm_type, norm_shaped

        blocks = {
            r.module_path for r in self.records if BLOCK_STAGE.match(r.key) and r.key.endswith(".hidden_out")
        }
        names = []
        for name, module in self.model.named_modules():
            if not any(name.startswith(b + ".") for b in blocks if b) or not (
                is_norm_type(module) or norm_shaped(module)
            ):
                continue
            attr = next(
                (
                    a
                    for a in ("eps", "variance_epsilon", "epsilon")
                    if isinstance(getattr(module, a, None), float)
                ),
                None,
            )
            if attr:
                names.append((name, attr))
        if not names:
            return []
        blocks0 = self._blocks().get(0)
        in_block0 = [n for n, _ in names if blocks0 and n.startswith(blocks0 + ".")]
        order = [st for r in self.records if r.layer == 0 and (st := output_stage(r.key, True))]
        # the block stage owning the first broken norm, or a stage inside the child that holds it
        block_owned = {self.block_stage(0, n) for n in in_block0}
        first_norm = next((st for st in order if st in block_owned), None)  # in execution order
        child_owned = {found[0]: found[1] for n in in_block0 if (found := self.owning_stage(0, n))}
        first_child = next((st for st in order if st in child_owned), None)
        within, within_keys = None, ()
        if first_child is not None and child_owned[first_child].startswith(blocks0 + "."):
            within = child_owned[first_child][len(blocks0) + 1 :]
            path = child_owned[first_child]
            within_keys = tuple(  # sub-stages recorded inside that child (the q / k its kernel read)
                r.key.split(".", 1)[1]
                for r in self.records
                if r.layer == 0
                and r.module_path
                and (r.module_path == path or r.module_path.startswith(path + "."))
            )

        def plant(model: Any) -> None:
            for name, attr in names:
                setattr(model.get_submodule(name), attr, EPS)

        return [
            Mutation(
                "norm eps",
                f"{len(names)} norm(s) in the blocks, eps {EPS}",
                Expected(0, first_norm, None, None, within=within, within_keys=within_keys),
                plant,
            )
        ]

    def activation(self) -> list[Mutation]:
        import torch

        r = self.sub(ONE_LAYER, "mlp.act")
        down = self.sub(ONE_LAYER, "mlp.down")
        if r is None or down is None or not down.module_path:
            return []
        branch = down.module_path.rpartition(".")[0]
        found = [
            (name, module)
            for name, module in self.model.get_submodule(branch).named_modules()
            if name
            and not list(module.parameters())
            and type(module).__module__.startswith(
                ("torch.nn.modules.activation", "transformers.activations")
            )
        ]
        if not found:
            return []
        name, module = found[0]
        probe = torch.linspace(-3, 3, 13)
        with torch.no_grad():  # by what it computes: transformers' SiLUActivation is nn.SiLU's function
            silu_like = torch.allclose(module(probe), torch.nn.functional.silu(probe))
        other = torch.nn.GELU if silu_like else torch.nn.SiLU
        path = f"{branch}.{name}"

        def plant(model: Any) -> None:
            owner, _, attr = path.rpartition(".")
            setattr(model.get_submodule(owner), attr, other())

        stage = self.block_stage(ONE_LAYER, down.module_path)
        return [
            Mutation(
                "mlp.act swapped",
                f"layer {ONE_LAYER}: {path} {type(module).__name__} -> {other.__name__}",
                Expected(ONE_LAYER, stage, "mlp.act", PatternName.JUMP),
                plant,
            )
        ]

    def _blocks(self) -> dict[int, str]:
        """Layer -> the block's module path (from its `hidden_out` record)."""
        return {
            r.layer: r.module_path
            for r in self.records
            if r.layer is not None and r.module_path and r.key == f"L{r.layer:03d}.hidden_out"
        }

    def _expert_count(self) -> int | None:
        """E from the config (the field the shrinker sized: `num_experts`, `n_routed_experts`, ...)."""
        config = getattr(self.model, "config", None)
        return next(
            (v for n in EXPERT_FIELDS if isinstance(v := getattr(config, n, None), int) and v >= 2), None
        )

    def _experts(self) -> list[tuple[int, str]]:
        """(layer, path) of each block's expert container: parameters stacked over the config's E
        experts (`[E, ...]`, 3-D or more), or a list of E modules of one class that hold a projection.
        A model whose config names no expert count has none."""
        import torch

        count = self._expert_count()
        if count is None:
            return []
        found = []
        for layer, block in sorted(self._blocks().items()):
            for name, module in self.model.get_submodule(block).named_modules():
                own = [p for p in module.parameters(recurse=False) if p.dim() >= 3]
                stacked = bool(own) and all(p.shape[0] == count for p in own)
                listed = (
                    isinstance(module, torch.nn.ModuleList)
                    and len(module) == count
                    and len({type(m) for m in module}) == 1
                    and any(isinstance(c, torch.nn.Linear) for c in module[0].modules())
                )
                if stacked or listed:
                    found.append((layer, f"{block}.{name}" if name else block))
                    break
        return found

    def experts_swapped(self) -> list[Mutation]:
        import torch

        experts = self._experts()
        if not experts:
            return []
        layer, path = experts[0]

        def plant(model: Any) -> None:
            target = model.get_submodule(path)
            with torch.no_grad():
                if isinstance(target, torch.nn.ModuleList):
                    first, second = target[0].state_dict(), target[1].state_dict()
                    target[0].load_state_dict(second)
                    target[1].load_state_dict(first)
                    return
                for p in target.parameters(recurse=False):
                    if p.dim() >= 3:
                        p[[0, 1]] = p[[1, 0]].clone()

        stage = self.block_stage(layer, path)
        return [
            Mutation(
                "experts swapped",
                f"layer {layer}: experts 0 and 1 of {path}",
                Expected(layer, stage, "moe.", PatternName.JUMP),
                plant,
            )
        ]

    def topk_unnormalised(self) -> list[Mutation]:
        experts = self._experts()
        layers = [layer for layer, _ in experts]
        owners = [n for n, m in self.model.named_modules() if getattr(m, "norm_topk_prob", None) is True]
        config = getattr(self.model, "config", None)
        if not layers or not (owners or getattr(config, "norm_topk_prob", None) is True):
            return []

        def plant(model: Any) -> None:
            if getattr(model.config, "norm_topk_prob", None) is True:
                model.config.norm_topk_prob = False
            for n in owners:
                model.get_submodule(n).norm_topk_prob = False

        stage = self.block_stage(layers[0], experts[0][1])
        return [
            Mutation(
                "top-k unnormalised",
                f"norm_topk_prob off in {len(layers)} MoE layer(s)",
                Expected(
                    layers[0], stage, None, PatternName.LAYER_CLASS if len(layers) > 1 else PatternName.JUMP
                ),
                plant,
            )
        ]

    def window_ignored(self) -> list[Mutation]:
        config = getattr(self.model, "config", None)
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if not isinstance(window, int) or not types or "sliding_attention" not in types:
            return []
        first = types.index("sliding_attention")
        mixed = any(t != "sliding_attention" for t in types)
        pattern = PatternName.LAYER_CLASS if types.count("sliding_attention") > 1 else PatternName.JUMP

        def plant(model: Any) -> None:
            model.config.sliding_window = 10**6

        return [
            Mutation(
                "window ignored",
                f"sliding_window {window} -> past the input",
                Expected(first, None, None, pattern if mixed else None),
                plant,
            )
        ]
