"""`load_audit(model, checkpoint)`: which checkpoint tensors a model really loaded.

The "weights silently never loaded" failure: a non-strict load (or `ignore_mismatched_sizes`)
skips what does not fit and the model runs on its random initialisation. The audit compares the
model's state dict (as loaded) with the checkpoint and reports:
- `never_loaded`: checkpoint tensors with no model counterpart;
- `not_covered`: model parameters / buffers the checkpoint does not hold (left at their
  initialisation; tied parameters whose partner is covered are listed under `tied` instead);
- `shape_mismatch`: both hold the name with different shapes (what a non-strict load skipped),
  with the module and its class;
- `value_mismatch`: tensors whose loaded values differ from the checkpoint (findings and
  severities as in weights-diff; dtype casts and rounding are not mismatches).
- `not_loaded`: model tensors the checkpoint holds (by name or content) that still equal the
  model's own initialisation: the entry called without a checkpoint (when that argument is
  optional) or `init`, both under one torch seed.
Direction: the name options rewrite *checkpoint* names into the model's names (the model is the
reference side of the underlying weights-diff). Names that still differ are related by content
(`weights.content`): a fused or stacked model tensor made of checkpoint tensors is audited part
by part.

Stacked MoE experts: transformers 5 holds all experts of a layer in one tensor
(`experts.gate_up_proj` [E, 2I, H]) and converts the per-expert tensors of a checkpoint on load.
For a `PreTrainedModel` the audit reads that conversion from transformers itself
(`conversion_mapping.get_model_conversion_mapping`: stack over experts, then concatenate) and
turns it into `--stack` rules; for any model, stacked tensors that the only-in lists show by
name and shape are paired the same way (a note says so). Each expert's part is then compared on
its own, so an expert left unloaded or changed is named (`experts.3.up_proj.weight`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ffdebug import verdict as V
from ffdebug.errors import FFDebugError, short_reason
from ffdebug.verdict import Severity
from ffdebug.weights.diff import WeightsDiff
from ffdebug.weights.names import StackRule
from ffdebug.weights.schema import apply_hint

LOADED_FINDINGS = ("equal", "dtype_only", "rounding")


@dataclass
class LoadAuditResult:
    """Truthy when everything in the checkpoint was loaded and nothing was left uncovered."""

    never_loaded: list[dict]
    not_covered: list[dict]
    shape_mismatch: list[dict]
    value_mismatch: list[dict]
    not_loaded: list[dict]
    warnings: list[str]
    content: dict | None
    tied: list[dict]
    renames: list[dict]
    loaded: int
    model: str = ""
    checkpoint: str = ""
    fail_on: Severity = Severity.DIVERGE
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Severity:
        """The worst value finding, and at least ``bug`` for a structural one (a shape mismatch, a
        tensor never loaded or a parameter no checkpoint tensor covers): ``verdict`` never says ``ok``
        beside ``passed: false``."""
        worst = V.worst(*(v["severity"] for v in self.value_mismatch + self.not_loaded))
        if self.never_loaded or self.not_covered or self.shape_mismatch or self.not_loaded:
            worst = V.worst(worst, Severity.BUG)
        return worst

    def failed(self) -> bool:
        return bool(
            self.never_loaded
            or self.not_covered
            or self.shape_mismatch
            or self.not_loaded
            or any(V.at_least(v["severity"], self.fail_on) for v in self.value_mismatch)
        )

    def __bool__(self) -> bool:
        return not self.failed()

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict.value,
            "passed": not self.failed(),
            "never_loaded": self.never_loaded,
            "not_covered": self.not_covered,
            "shape_mismatch": self.shape_mismatch,
            "value_mismatch": self.value_mismatch,
            "not_loaded": self.not_loaded,
            "warnings": self.warnings,
            "content": self.content,
            "tied": self.tied,
            "renames": self.renames,
            "apply": apply_hint(self.renames) if self.renames else None,
            "loaded": self.loaded,
            "model": self.model,
            "checkpoint": self.checkpoint,
            "fail_on": self.fail_on.value,
            "notes": self.notes,
        }


def _module_info(model, name: str) -> dict:
    path = name.rsplit(".", 1)[0] if "." in name else ""
    try:
        mod = model.get_submodule(path) if path else model
        cls = type(mod).__name__
    except AttributeError:
        cls = None
    return {"module": path, "module_class": cls}


INIT_SEED = 0  # the entry is called under this torch seed, loaded and unloaded alike


def _call_seeded(spec: str, *args):
    import torch

    from ffdebug._entry import call_entry

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        return call_entry(spec, *args)


def _resolve_model(model, checkpoint):
    import torch

    if isinstance(model, torch.nn.Module):
        return model, f"<{type(model).__name__}>"
    if isinstance(model, str):
        from ffdebug._entry import is_entry_spec

        if not is_entry_spec(model):
            raise FFDebugError(
                f"{model!r}: not a Python entry; pass module:function (or path/to/file.py:function) "
                "returning the loaded model"
            )
        args = (os.fspath(checkpoint),) if isinstance(checkpoint, (str, os.PathLike)) else ()
        obj = _call_seeded(model, *args)
        if not isinstance(obj, torch.nn.Module):
            raise FFDebugError(f"{model}: returned {type(obj).__name__}; return the loaded nn.Module")
        return obj, model
    raise FFDebugError(
        f"load_audit: model must be an nn.Module or a module:function entry, not {type(model).__name__}"
    )


def _resolve_init(init, model):
    """The model built without loading: `init` (an nn.Module, a state dict or an entry), else the
    entry `model` itself when its checkpoint argument is optional (called with none, same seed)."""
    import inspect

    import torch

    from ffdebug._entry import is_entry_spec, resolve_entry

    if init is not None:
        if isinstance(init, str):
            if not is_entry_spec(init):
                raise FFDebugError(f"--init {init!r}: pass module:function returning the unloaded model")
            init = _call_seeded(init)
        if not isinstance(init, (torch.nn.Module, dict)):
            raise FFDebugError(f"--init: returned {type(init).__name__}; return the unloaded nn.Module")
        return init
    if not isinstance(model, str):
        return None
    try:
        params = list(inspect.signature(resolve_entry(model)).parameters.values())
    except (TypeError, ValueError):
        return None
    if not params or params[0].default is inspect.Parameter.empty:
        return None
    out = _call_seeded(model)
    return out if isinstance(out, torch.nn.Module) else None


def transformers_stack_rules(model) -> tuple[list[StackRule], list[str]]:
    """`--stack` rules from transformers' own checkpoint conversion for `model` (MoE experts
    stacked with `MergeModulelist(dim=0)`, then optionally `Concatenate(dim≥1)`), and notes on
    conversions that cannot be expressed as one. ([], []) for other models or transformers < 5."""
    import sys

    if "transformers" not in sys.modules:
        return [], []
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:
        return [], []
    if not isinstance(model, PreTrainedModel):
        return [], []
    try:
        conversions = get_model_conversion_mapping(model)
    except Exception as err:  # an API change in transformers: fall back to shape inference
        return [], [f"transformers conversion mapping unavailable ({short_reason(err)})"]
    rules, notes = [], []
    for conv in conversions:
        if not isinstance(conv, WeightConverter):
            continue
        src = list(getattr(conv, "_original_source_patterns", conv.source_patterns))
        tgt = list(getattr(conv, "_original_target_patterns", conv.target_patterns))
        ops = list(conv.operations)
        plain = len(tgt) == 1 and re.fullmatch(r"\w+(\.\w+)*", tgt[0]) is not None
        plain = plain and all(re.fullmatch(r"[\w.]*\*[\w.]*", p) and p.count("*") == 1 for p in src)
        merge = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        if merge and len(ops) == 1 and len(src) == 1:
            dim = 0
        elif merge and len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
            dim = ops[1].dim - 1
        else:
            plain = False
        if not plain:
            notes.append(
                f"transformers converts {'+'.join(src)} → {'+'.join(tgt)} with "
                f"{[type(o).__name__ for o in ops]}; not audited as a stack"
            )
            continue
        parts = tuple(p.replace("*", "{E}") for p in src)
        spec = f"{tgt[0]}={'+'.join(parts)}" + (f"@{dim}" if dim else "")
        rules.append(StackRule(tgt[0], parts, dim, spec))
    return rules, notes


def _uncovered(diff: WeightsDiff, module) -> tuple[list[dict], list[dict]]:
    """(model tensors the checkpoint does not hold, tied parameters whose partner it holds)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    # Tied parameters: several names, one storage.
    by_storage: dict[int, list[str]] = {}
    for name, p in params.items():
        by_storage.setdefault(p.data_ptr(), []).append(name)

    covered = set(diff.common)
    not_covered, tied = [], []
    for name in diff.only_ref:
        src = diff.ref[name].stored_name
        tensor = params.get(src, buffers.get(src))
        partners = [n for n in by_storage.get(tensor.data_ptr(), []) if n != src] if src in params else []
        partner = next((n for n in partners if diff.ref_name(n) in covered), None)
        if partner is not None:
            tied.append({"name": name, "tied_to": diff.ref_name(partner)})
            continue
        not_covered.append(
            {
                "name": name,
                "shape": list(diff.ref[name].shape),
                "dtype": diff.ref[name].dtype,
                "kind": "parameter" if src in params else "buffer",
                **_module_info(module, src),
            }
        )
    return not_covered, tied


def load_audit(model, checkpoint, **opts) -> LoadAuditResult:
    """Audit what `model` (an nn.Module, or an entry `module:function` called with the checkpoint
    path and returning the loaded model) took from `checkpoint` (any weights-diff input).

    Options: strip_prefix, add_prefix, maps, alias_file, stack, skip, dequant, thresholds, fail_on.
    Stacked MoE experts are paired automatically (see the module docstring).
    """
    module, label = _resolve_model(model, checkpoint)
    init = _resolve_init(opts.pop("init", None), model)
    fail_on = V.parse_fail_on(opts.get("fail_on", Severity.DIVERGE))
    stack = opts.pop("stack", ()) or ()
    stack = (stack,) if isinstance(stack, (str, StackRule)) else tuple(stack)
    hf_rules, hf_notes = transformers_stack_rules(module)
    diff = WeightsDiff(
        module,
        checkpoint,
        stack=stack + tuple(hf_rules),
        auto_stack=True,
        init=init,
        init_side="ref",
        **opts,
    )
    used = {t.stacked_from for t in diff.ref.values() if t.stacked_from}
    if hf_rules and used:
        diff.notes.insert(
            0,
            f"{len(used)} stacked expert tensor(s) compared expert by expert, as transformers converts "
            f"them on load ({'; '.join(r.spec for r in hf_rules)})",
        )
    diff.notes.extend(hf_notes)

    not_covered, tied = _uncovered(diff, module)
    never_loaded = [
        {
            "name": diff.tgt[n].source_name,
            "mapped": n,
            "shape": list(diff.tgt[n].shape),
            "dtype": diff.tgt[n].dtype,
        }
        for n in diff.only_target
    ]
    shape_mismatch = [
        {
            "name": s["name"],
            "shape_model": s["shape_ref"],
            "shape_checkpoint": s["shape_target"],
            **_module_info(module, diff.ref[s["name"]].stored_name),
        }
        for s in diff.shape_mismatch
    ]
    result = diff.run()
    value_mismatch = [
        dict(t.to_json(), **_module_info(module, diff.ref[t.name].stored_name))
        for t in result.tensors
        if t.finding not in LOADED_FINDINGS
    ]
    not_loaded = [v for v in value_mismatch if v["finding"] == "not_loaded"]
    value_mismatch = [v for v in value_mismatch if v["finding"] != "not_loaded"]
    if init is None:
        diff.notes.append(
            "no unloaded build of the model to tell a tensor left at its initialisation: make the "
            "entry's checkpoint argument optional, or pass --init ENTRY"
        )
    return LoadAuditResult(
        never_loaded=never_loaded,
        not_covered=not_covered,
        shape_mismatch=shape_mismatch,
        value_mismatch=value_mismatch,
        not_loaded=not_loaded,
        warnings=list(diff.warnings),
        content=diff.content.to_json() if diff.content is not None else None,
        tied=tied,
        renames=diff.renames,
        loaded=sum(1 for t in result.tensors if t.finding in LOADED_FINDINGS),
        model=label,
        checkpoint=diff.tgt_src.path,
        fail_on=fail_on,
        notes=diff.notes,
    )
