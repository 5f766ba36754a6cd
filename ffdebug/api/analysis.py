"""The analysis half of the public API (`ffdebug.compare`, `bisect`, `weights_diff`, ...): each
keyword is an option of the engine underneath, with the engine's default (docs/dumping.md "Python API").
The engines are imported by the functions that run them."""

from __future__ import annotations

import os as _os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from ffdebug._env import LayerSelection
from ffdebug.api.capture import TagValue
from ffdebug.progress_hook import ProgressHook
from ffdebug.verdict import Severity, Threshold

if TYPE_CHECKING:  # types only: importing them would import torch
    from typing import TypeAlias

    import numpy as np
    import torch

    from ffdebug.io.side import SideStore
    from ffdebug.results import BisectResult, CompareResult, WeightsDiffResult
    from ffdebug.weights.audit import LoadAuditResult

    # a side: its directory (a store, a peer dump, a tensor file) or an opened SideStore
    Side: TypeAlias = str | _os.PathLike[str] | SideStore
    # what weights_diff reads: a checkpoint path (docs/weights-diff.md "Weights first"), an entry
    # `module:function`, a module or a state dict (torch tensors or numpy arrays)
    Weights: TypeAlias = (
        str | _os.PathLike[str] | torch.nn.Module | Mapping[str, torch.Tensor] | Mapping[str, np.ndarray]
    )
    # a model to re-run (attribution): an entry `module:function`, the model, or (model, keyword
    # or forward kwargs), what such a function returns (ffdebug/bisection/attribution.py)
    ModelEntry: TypeAlias = str | torch.nn.Module | tuple[torch.nn.Module, str | Mapping[str, object]]


def compare(
    ref: Side,
    target: Side,
    *,
    layers: str | LayerSelection | None = None,
    stages: Sequence[str] = (),
    exclude: Sequence[str] = (),
    step: Mapping[str, TagValue] | None = None,
    rank: int | None = None,
    thresholds: Sequence[str | Threshold] = (),
    noise: Side | None = None,
    exact: bool = False,
    fail_on: Severity | str = Severity.DIVERGE,
    allow_partial: bool = False,
    maps: Sequence[str] = (),
    alias_file: str | None = None,
    workers: int | None = None,
    progress: ProgressHook | None = None,
) -> CompareResult:
    """Compare two sides stage by stage in float64 (docs/comparing.md "Comparing"); the keywords are the
    `ffdebug compare` options: `layers` '0,2,5-7,-1', `stages` / `exclude` key globs, `step`
    tags to keep, `rank`, `thresholds` 'GLOB:cos>=X,rel<=Y', a `noise` side, `exact` (any bit
    difference counts), `fail_on`, `allow_partial`, `maps` 'OLD=NEW' stage renames and their
    `alias_file`, `workers` threads (None: one per free core), a `progress` hook.

    Raises `InputIdsMismatch` (exit 3) when the sides were fed different inputs, `FFDebugError`
    (exit 2) on unreadable input.

    Example::

        result = ffdebug.compare("dump/ref", "dump/target", layers="0-3", exclude=["loss.*"])
        bad = result.first_at_or_above(ffdebug.Severity.DIVERGE)
        print(result.verdict, bad.key if bad else None, result.exit_code())
    """
    from ffdebug.comparison.engine import compare as _compare

    return _compare(
        ref,
        target,
        layers=layers,
        stages=tuple(stages),
        exclude=tuple(exclude),
        step=dict(step) if step is not None else None,
        rank=rank,
        thresholds=tuple(thresholds),
        noise=noise,
        exact=exact,
        fail_on=fail_on,
        allow_partial=allow_partial,
        maps=tuple(maps),
        alias_file=alias_file,
        workers=workers,
        progress=progress,
    )


def assert_match(
    ref: Side,
    target: Side,
    fail_on: Severity | str = Severity.DRIFT,
    *,
    layers: str | LayerSelection | None = None,
    stages: Sequence[str] = (),
    exclude: Sequence[str] = (),
    step: Mapping[str, TagValue] | None = None,
    rank: int | None = None,
    thresholds: Sequence[str | Threshold] = (),
    noise: Side | None = None,
    exact: bool = False,
    allow_partial: bool = False,
    maps: Sequence[str] = (),
    alias_file: str | None = None,
    workers: int | None = None,
) -> CompareResult:
    """`compare`, then raise AssertionError naming the first stage at or above `fail_on` (default
    drift: stricter than the CLI); returns the result when none is.

    Example::

        ffdebug.assert_match(tmp_path / "ref", tmp_path / "target", thresholds=["final.logits:cos>=0.999"])
    """
    result = compare(
        ref,
        target,
        layers=layers,
        stages=stages,
        exclude=exclude,
        step=step,
        rank=rank,
        thresholds=thresholds,
        noise=noise,
        exact=exact,
        fail_on=fail_on,
        allow_partial=allow_partial,
        maps=maps,
        alias_file=alias_file,
        workers=workers,
    )
    bad = result.first_at_or_above(fail_on)
    if bad is not None:
        raise AssertionError(
            f"{bad.key}: {bad.severity} (cos={bad.cos}, rel={bad.rel}); verdict {result.verdict}"
        )
    return result


def bisect(
    ref: Side,
    target: Side,
    *,
    layers: str | LayerSelection | None = None,
    stages: Sequence[str] = (),
    exclude: Sequence[str] = (),
    step: Mapping[str, TagValue] | None = None,
    rank: int | None = None,
    thresholds: Sequence[str | Threshold] = (),
    noise: Side | None = None,
    fail_on: Severity | str = Severity.DIVERGE,
    layer_class: str | None = None,
    model_ref: ModelEntry | None = None,
    model_target: ModelEntry | None = None,
    allow_partial: bool = False,
    maps: Sequence[str] = (),
    alias_file: str | None = None,
    progress: ProgressHook | None = None,
) -> BisectResult:
    """Localise the first layer that introduces error, its class pattern and sub-stage (docs/bisect.md
    "Bisecting"); the result carries its one-sentence conclusion (`result.conclusion`). The
    keywords are compare's, plus `layer_class` ('hash:0-2,routed:3-') and `model_ref` /
    `model_target` (`module:function` entries, or the models themselves, optionally as
    `(model, forward_kwargs)`: re-run the target's blocks on the reference's inputs to tell local
    from inherited error; the model as the only judge of the layers the budget cannot judge).

    Example::

        result = ffdebug.bisect("dump/ref", "dump/target")
        print(result.pattern, result.first_divergence.key if result.first_divergence else None)
        print(result.conclusion)
    """
    from ffdebug.bisection.engine import bisect as _bisect
    from ffdebug.report.bisect_text import conclude

    return conclude(
        _bisect(
            ref,
            target,
            layers=layers,
            stages=tuple(stages),
            exclude=tuple(exclude),
            step=dict(step) if step is not None else None,
            rank=rank,
            thresholds=tuple(thresholds),
            noise=noise,
            fail_on=fail_on,
            layer_class=layer_class,
            model_ref=model_ref,
            model_target=model_target,
            allow_partial=allow_partial,
            maps=tuple(maps),
            alias_file=alias_file,
            progress=progress,
        )
    )


def weights_diff(
    a: Weights,
    b: Weights,
    *,
    strip_prefix: str | Sequence[str] = (),
    add_prefix: str | None = None,
    maps: Sequence[str] = (),
    alias_file: str | None = None,
    fuse: str | Sequence[str] = (),
    stack: str | Sequence[str] = (),
    auto_stack: bool = False,
    skip: str | Sequence[str] = (),
    layers: str | LayerSelection | None = None,
    transforms: Sequence[str] = (),
    dequant: Literal["auto", "always", "none"] = "auto",
    tp_merge: Literal["auto"] | int = "auto",
    thresholds: Sequence[str | Threshold] = (),
    fail_on: Severity | str = Severity.DIVERGE,
    allow_dtype: bool = False,
    match_content: Literal["auto", "off"] = "auto",
    init: Weights | None = None,
    init_side: Literal["ref", "target"] = "target",
    workers: int | None = None,
    schema_only: bool = False,
    progress: ProgressHook | None = None,
) -> WeightsDiffResult:
    """Schema, then float64 numerics of two checkpoints / weight dumps (docs/weights-diff.md "Weights first");
    truthy when they match, `.to_json()` has the keys of docs/weights-diff.md "JSON". The keywords are the
    `ffdebug weights-diff` options: name rewriting of B into A's names (`strip_prefix`,
    `add_prefix`, `maps` 'OLD=NEW', `alias_file`), `fuse` / `stack` rules ('FUSED=A+B[@DIM]'),
    `auto_stack` (pair stacked experts the schema shows), `skip` globs, `layers`, `transforms`
    ('[ref:|target:]GLOB=transpose|module:function'), `dequant`, `tp_merge` ('auto' or a dim),
    `thresholds`, `fail_on`, `allow_dtype`, `match_content`, `init` (the port built without
    loading: a tensor still equal to it is not_loaded) and the side it builds (`init_side`),
    `workers` (None: one per free core), `schema_only`, a `progress` hook.

    Example::

        diff = ffdebug.weights_diff("hf_model/", "converted.safetensors", strip_prefix="model.")
        for t in diff.tensors:
            if t.finding != "equal":
                print(t.name, t.finding, t.severity)
    """
    from ffdebug.weights.diff import WeightsDiff

    diff = WeightsDiff(
        a,
        b,
        strip_prefix=strip_prefix,
        add_prefix=add_prefix,
        maps=maps,
        alias_file=alias_file,
        fuse=fuse,
        stack=stack,
        auto_stack=auto_stack,
        skip=skip,
        layers=layers,
        transforms=transforms,
        dequant=dequant,
        tp_merge=tp_merge,
        thresholds=thresholds,
        fail_on=fail_on,
        allow_dtype=allow_dtype,
        match_content=match_content,
        init=init,
        init_side=init_side,
        workers=workers,
    )
    return diff.schema_result() if schema_only else diff.run(progress=progress)


def load_audit(
    model: torch.nn.Module | str,
    checkpoint: Weights,
    *,
    strip_prefix: str | Sequence[str] = (),
    add_prefix: str | None = None,
    maps: Sequence[str] = (),
    alias_file: str | None = None,
    fuse: str | Sequence[str] = (),
    stack: str | Sequence[str] = (),
    skip: str | Sequence[str] = (),
    layers: str | LayerSelection | None = None,
    transforms: Sequence[str] = (),
    dequant: Literal["auto", "always", "none"] = "auto",
    tp_merge: Literal["auto"] | int = "auto",
    thresholds: Sequence[str | Threshold] = (),
    fail_on: Severity | str = Severity.DIVERGE,
    allow_dtype: bool = False,
    match_content: Literal["auto", "off"] = "auto",
    init: torch.nn.Module | str | None = None,
) -> LoadAuditResult:
    """Which checkpoint tensors `model` really loaded: never-loaded keys, parameters left at their
    initialisation, skipped shapes (docs/weights-diff.md "Weights first"). `model` is a module or an entry
    `module:function` called with the checkpoint path; the name options rewrite *checkpoint*
    names into the model's (as weights_diff's rewrite B into A); `init` is the model built
    without loading (default: the entry called without a checkpoint, when it allows that).

    Example::

        audit = ffdebug.load_audit(model, "hf_model/")
        assert audit, audit.never_loaded + audit.not_loaded
    """
    from ffdebug.weights.audit import load_audit as _la

    return _la(
        model,
        checkpoint,
        strip_prefix=strip_prefix,
        add_prefix=add_prefix,
        maps=maps,
        alias_file=alias_file,
        fuse=fuse,
        stack=stack,
        skip=skip,
        layers=layers,
        transforms=transforms,
        dequant=dequant,
        tp_merge=tp_merge,
        thresholds=thresholds,
        fail_on=fail_on,
        allow_dtype=allow_dtype,
        match_content=match_content,
        init=init,
    )
