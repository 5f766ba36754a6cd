"""The selftest cases of one model, run through the public dump and analysis path.

Every case dumps the reference (the tiny model, float32, eager attention) and a target into one
store with `ffdebug.capture(..., substages=True)` on the same input ids, then runs `ffdebug.bisect`
(compare included), exactly what a user's two runs and `ffdebug bisect` do:

- **copy** (a): a bit-identical deep copy → exit 0 with complete coverage;
- **precision** (b): the model in bfloat16, in float16 (where the CPU kernels support it) and with
  another attention implementation (`sdpa`) → exit 0, judgement at most `drift`, pattern `match`
  or `drift` (exit 4 counts when its only gap is extra outputs the other implementation does not
  return: eager attention's probabilities, `attn_out.1`, which sdpa returns as None);
- **mutations** (c): each of `mutations.Planner` → the expected layer, stage, sub-stage and pattern,
  and a failing result. A mutation whose target is bit-identical to the reference on the tiny model
  (top-k normalisation at k = 1, a window longer than the input) is `no effect`, left out of the rates.

With `SelftestOptions.engine` every target is first rewritten the way an inference engine ports
the model (`selftest.rewrite`: projections fused, modules renamed, a causal LM's batch packed into
one row with `cu_seqlens`), so copy and mutations measure pairing across two codebases; the
precision group is the original's.

A case that does not hold is `fails` with what bisect said; one that cannot run here (fp16 kernels
missing, no sdpa support) is `skipped` with why.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ffdebug.errors import short_reason
from ffdebug.selftest.families import DIFFUSERS, inputs
from ffdebug.selftest.models import ModelSpec, SelftestError, build, resolve
from ffdebug.selftest.mutations import Dumped, Expected, Mutation, Planner
from ffdebug.selftest.shrink import Sizes
from ffdebug.verdict import PatternName, Severity

CASE_GROUPS = ("copy", "precision", "mutations")
HOLDS, FAILS, NO_EFFECT, SKIPPED = "holds", "fails", "no effect", "skipped"
PRECISION_PATTERNS = (PatternName.MATCH, PatternName.DRIFT)


@dataclass(frozen=True)
class SelftestOptions:
    """What to run: the case groups, the input (batch x seq token ids), the seed, the sizes."""

    groups: tuple[str, ...] = CASE_GROUPS
    batch: int = 2
    seq: int = 16
    seed: int = 0
    sizes: Sizes = field(default_factory=Sizes)
    keep: str | None = None  # a directory to keep the dumps in (else a temporary one)
    engine: bool = False  # every target is an engine-style rewrite (`selftest.rewrite`): copy and mutations

    def __post_init__(self) -> None:
        unknown = [g for g in self.groups if g not in CASE_GROUPS]
        if unknown:
            raise SelftestError(
                f"--cases: {', '.join(unknown)} unknown; choose from {', '.join(CASE_GROUPS)}"
            )
        if self.seq <= self.sizes.window:
            raise SelftestError(
                f"--seq {self.seq}: must exceed the shrunk sliding window ({self.sizes.window})"
            )


@dataclass
class CaseResult:
    """One case: what was expected, what bisect said, and whether it holds."""

    group: str
    name: str
    expected: str
    status: str
    got: str = ""
    where: str = ""
    exit_code: int | None = None
    pattern: str | None = None
    judgement: str | None = None
    layer: int | None = None
    stage: str | None = None
    sub_stage: str | None = None
    head: int | None = None  # the sub-stage's worst head (per-head error), where it has heads
    attributed: bool = False  # bisect could not judge every layer, and its deciding run answered

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ModelReport:
    """One model's cases (or why it could not be built)."""

    spec: str
    model_class: str = ""
    model_type: str = ""
    family: str = ""
    error: str | None = None
    parameters: int = 0
    layers: int = 0
    shrunk: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # ffdebug's warnings while dumping / comparing
    engine: str = ""  # with options.engine: what the rewrite did (`Rewrite.describe`)
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def built(self) -> bool:
        return self.error is None

    def holds(self) -> bool:
        return self.built and all(c.status in (HOLDS, NO_EFFECT, SKIPPED) for c in self.cases)

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "cases"}
        out["built"] = self.built
        out["holds"] = self.holds()
        out["cases"] = [c.to_json() for c in self.cases]
        return out


def _inputs(spec: ModelSpec, model: Any, options: SelftestOptions) -> dict[str, Any]:
    """The forward's keyword arguments (`families.inputs`): the same for the reference and targets."""
    return inputs(spec.family, model, options.batch, options.seq, options.seed, options.sizes.vocab)


def _cast(values: dict[str, Any], dtype) -> dict[str, Any]:
    """Floating inputs in the target's dtype (a bf16 denoiser is fed bf16 latents); ids stay."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in values.items()}


def _dtype(model: Any):
    """The model's floating dtype (its first floating parameter's)."""
    import torch

    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _dump(model: Any, values: dict[str, Any], directory: Path, side: str) -> str:
    import torch

    import ffdebug

    dtype = _dtype(model)
    with ffdebug.capture(model, dir=str(directory), side=side, substages=True), torch.no_grad():
        model(**_cast(values, dtype))
    return str(directory / side)


def _records(side_dir: str) -> list[Dumped]:
    from ffdebug.store.reader import open_side

    return [
        Dumped(r.key, r.layer, r.module_path, dict(r.extra or {}), tuple(r.shape or ()))
        for r in open_side(side_dir).records
    ]


def _sub_name(result) -> str | None:
    sub = result.sub_stage
    if sub is None:
        return None
    stage = sub.stage
    for suffix in (".out", ".in"):
        if stage.endswith(suffix):
            return stage[: -len(suffix)]
    return stage


def _said(result) -> dict:
    first = result.first_divergence
    return dict(
        exit_code=result.exit_code(),
        pattern=str(result.pattern),
        judgement=str(result.judgement),
        layer=first.layer if first else None,
        stage=first.stage if first else None,
        sub_stage=_sub_name(result),
        head=_worst_head(result.sub_stage),
    )


def _worst_head(stage) -> int | None:
    rels = getattr(stage, "per_head_rel", None) or []
    known = [(r, h) for h, r in enumerate(rels) if r is not None]
    return max(known)[1] if known else None


_EXTRA_OUTPUT = re.compile(r"\.\d+$")  # `attn_out.1`: a module's second output, not its first


def _only_extra_outputs_missing(result) -> bool:
    """Coverage is incomplete only because the reference dumped extra outputs the other
    implementation does not return (eager attention returns its probabilities, sdpa None): every
    stage (or stage kind) with no target record is a module's second-or-later output, and nothing
    else is missing. The stages both sides produce were all compared."""
    cov = result.coverage
    gaps = [k for k in cov.kinds if k.ref and not k.target]
    if gaps:  # whole kinds: the extra output of every layer
        return (
            all(k.target == 0 and _EXTRA_OUTPUT.search(k.kind) for k in gaps)
            and not cov.only_target
            and len(cov.missing) == 1
        )
    # some layers only (a hybrid model: its full-attention layers return probabilities, its
    # linear-attention layers a second output on both sides)
    return (
        bool(cov.stages_only_ref)
        and all(_EXTRA_OUTPUT.search(k) for k in cov.stages_only_ref)
        and not cov.stages_only_target
        and len(cov.missing) == 1
    )


def _got(said: dict, head: bool = False) -> str:
    if said["layer"] is None and said["stage"] is None:
        where = "no divergence"
    else:
        where = f"layer {said['layer']} {said['stage']}" if said["layer"] is not None else str(said["stage"])
    sub = f", {said['sub_stage']}" if said["sub_stage"] else ""
    sub += f" (worst head {said['head']})" if head and said["head"] is not None else ""
    return f"{where}{sub}, {said['pattern']}, judgement {said['judgement']}, exit {said['exit_code']}"


def _matches(expected: Expected, said: dict, failed: bool) -> bool:
    if not failed or said["layer"] != expected.layer:
        return False
    at_planted = expected.sub_stage is not None and (said["stage"] or "").startswith(expected.sub_stage + ".")
    within = expected.within
    inside = within is not None and (
        (said["stage"] or "").startswith(within + ".")
        or (said["sub_stage"] or "") == within
        or (said["sub_stage"] or "").startswith(within + ".")
        or (said["sub_stage"] or "") in expected.within_keys
    )  # a finer first divergence, or a block stage whose sub-stage is the planted module
    elsewhere = said["stage"] in expected.streams  # another output of the planted module's stage
    if (
        expected.stage is not None
        and said["stage"] != expected.stage
        and not (at_planted or inside or elsewhere)
    ):
        return False  # the planted sub-stage itself is a first divergence finer than its block stage
    if expected.sub_stage is not None:
        sub = said["sub_stage"] or ""
        prefix = expected.sub_stage
        if not (sub == prefix or sub.startswith(prefix if prefix.endswith(".") else prefix + ".")):
            return False
    if expected.head is not None and said["head"] != expected.head:
        return False
    if expected.pattern is None:
        return said["pattern"] != PatternName.MATCH
    return said["pattern"] == PatternName(expected.pattern).value


class Runner:
    """The cases of one built model, dumped under one directory."""

    def __init__(self, spec: ModelSpec, model: Any, options: SelftestOptions, root: Path) -> None:
        self.spec, self.model, self.options, self.root = spec, model, options, root
        self.ids = _inputs(spec, model, options)
        self.ref = _dump(model, self.ids, root, "ref")
        self.records = _records(self.ref)
        self.rewrites: dict[str, Any] = {}  # side -> its engine rewrite (options.engine)

    def _as_run(self, target: Any, side: str) -> tuple[Any, dict[str, Any]]:
        """The module dumped for `side` and its inputs: `target`, or its engine rewrite."""
        if not self.options.engine:
            return target, self.ids
        from ffdebug.selftest.families import CAUSAL_LM
        from ffdebug.selftest.rewrite import engine_rewrite

        rw = engine_rewrite(target, _cast(self.ids, _dtype(target)), self.spec.family == CAUSAL_LM)
        self.rewrites[side] = rw
        return rw.module, rw.feed

    def _bisect(self, target: Any, side: str):
        import ffdebug

        module, feed = self._as_run(target, side)
        return ffdebug.bisect(self.ref, _dump(module, feed, self.root, side))

    def _attribute(self, target: Any, side: str):
        """The deciding run a user is told to make when the budget cannot judge every layer: bisect
        again with each block of `target` re-run on the reference's inputs, the reference replayed
        the same way as the control (`ffdebug/bisection/attribution.py`)."""
        import ffdebug

        dtype = _dtype(target)
        rw = self.rewrites.get(side)
        return ffdebug.bisect(
            self.ref,
            str(self.root / side),
            model_ref=(self.model, _cast(self.ids, _dtype(self.model))),
            model_target=(target, _cast(self.ids, dtype)) if rw is None else (rw.module, rw.feed),
        )

    def copy_case(self) -> CaseResult:
        import ffdebug

        target = copy.deepcopy(self.model)
        result = self._bisect(target, "copy")
        said = _said(result)
        compared = ffdebug.compare(self.ref, str(self.root / "copy"))
        holds = said["exit_code"] == 0 and compared.exit_code() == 0 and compared.complete
        return CaseResult(
            "copy", "copy", "exit 0, coverage complete", HOLDS if holds else FAILS, _got(said), **said
        )

    def precision_cases(self) -> list[CaseResult]:
        import torch

        if self.options.engine:
            why = "the engine rewrite runs copy and mutations; precision is the original's sweep"
            return [CaseResult("precision", "precision", "", SKIPPED, why)]
        out = []
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            try:
                target = copy.deepcopy(self.model).to(dtype)
                result = self._bisect(target, name)
            except (RuntimeError, NotImplementedError) as e:
                out.append(CaseResult("precision", name, "", SKIPPED, f"not supported here: {str(e)[:100]}"))
                continue
            out.append(self._precision(name, result))
        if self.spec.family == DIFFUSERS:
            why = "diffusers models choose attention per processor; there is no second implementation to switch to"
            out.append(CaseResult("precision", "sdpa", "", SKIPPED, why))
            return out
        try:
            other = build(self.spec, self.options.sizes, self.options.seed, attn="sdpa")
            other.load_state_dict(self.model.state_dict())
            result = self._bisect(other, "sdpa")
        except (SelftestError, ValueError, RuntimeError) as e:
            out.append(CaseResult("precision", "sdpa", "", SKIPPED, f"not supported: {str(e)[:100]}"))
        else:
            out.append(self._precision("sdpa", result))
        return out

    def _precision(self, name: str, result) -> CaseResult:
        said = _said(result)
        judged = not Severity(result.judgement).at_least(Severity.DIVERGE)
        passed = said["exit_code"] == 0 or (said["exit_code"] == 4 and _only_extra_outputs_missing(result))
        holds = passed and judged and said["pattern"] in [p.value for p in PRECISION_PATTERNS]
        expected = "exit 0, judgement <= drift, pattern match or drift"
        return CaseResult("precision", name, expected, HOLDS if holds else FAILS, _got(said), **said)

    def _no_effect_before_rewrite(self, target: Any, side: str) -> bool:
        """With --engine, whether the mutated model itself dumps bit-identical to the reference (a
        rewrite's own dump never is: its fused projections differ in the last bits)."""
        import ffdebug

        return self.options.engine and _bit_identical(
            ffdebug.compare(self.ref, _dump(target, self.ids, self.root, side + "_plain"))
        )

    def _mutation(self, mutation: Mutation) -> CaseResult:
        import ffdebug

        side = "m_" + "".join(ch if ch.isalnum() else "_" for ch in mutation.kind)
        target = mutation.target(self.model)
        result = self._bisect(target, side)
        attributed = result.attribution_decides()
        if attributed:  # what bisect tells the user to run next, and what they would read
            result = self._attribute(target, side)
        compared = ffdebug.compare(self.ref, str(self.root / side))
        expected = mutation.expected.describe()
        said = _said(result)
        holds = _matches(mutation.expected, said, result.failed())
        if _bit_identical(compared) or (not holds and self._no_effect_before_rewrite(target, side)):
            why = "bit-identical to the " + (
                "model before the rewrite" if self.options.engine else "reference"
            )
            return CaseResult("mutations", mutation.kind, expected, NO_EFFECT, why, mutation.where)
        return CaseResult(
            "mutations",
            mutation.kind,
            expected,
            HOLDS if holds else FAILS,
            _got(said) + (" (after attribution)" if attributed else ""),
            mutation.where,
            attributed=attributed,
            **said,
        )


def _bit_identical(compared) -> bool:  # every compared stage bit-equal, and at least one compared
    return bool(compared.stages) and all((s.bit_equal or 0.0) == 1.0 for s in compared.stages)


@contextlib.contextmanager
def _warnings_into(notes: list[str]) -> Iterator[None]:
    """ffdebug's warnings during the cases become the report's notes (once each), not stderr lines:
    they describe this model (a branch without role sub-stages, ...), and the report shows them."""
    from ffdebug import logs

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if record.levelno >= logging.WARNING and message not in notes:
                notes.append(message)

    root, ours, collect = logging.getLogger(logs.ROOT), logs.handler(), Collect()
    level = ours.level
    root.addHandler(collect)
    ours.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.removeHandler(collect)
        ours.setLevel(level)


def run_model(name: str, options: SelftestOptions | None = None) -> ModelReport:
    """Every case of `options.groups` for the model `name` names (`models.resolve`). A spec that
    resolves to nothing raises `SelftestError`; a model that does not build is a report with `error`."""
    options = options or SelftestOptions()
    spec = resolve(name)
    report = ModelReport(name, spec.model_class.__name__, spec.model_type, family=spec.family)
    try:
        report.shrunk = spec.shrunk(options.sizes)[1]
        model = build(spec, options.sizes, options.seed)
    except SelftestError as e:
        report.error = str(e)
        return report
    report.parameters = sum(p.numel() for p in model.parameters())
    root = (
        Path(options.keep) / _safe(name)
        if options.keep
        else Path(tempfile.mkdtemp(prefix="ffdebug-selftest-"))
    )
    if options.keep:
        shutil.rmtree(root, ignore_errors=True)
    try:
        with _warnings_into(report.notes):
            _run_cases(report, spec, model, options, root)
    finally:
        if not options.keep:
            shutil.rmtree(root, ignore_errors=True)
    return report


def _raised(group: str, name: str, e: BaseException) -> CaseResult:
    """A case in which ffdebug raised on a model whose plain forward runs: a defect, so it fails."""
    return CaseResult(
        group, name, "no exception", FAILS, f"raised {type(e).__name__}: {short_reason(e, 160)}"
    )


def _run_cases(
    report: ModelReport, spec: ModelSpec, model: Any, options: SelftestOptions, root: Path
) -> None:
    import torch

    try:
        with torch.no_grad():
            model(**_inputs(spec, model, options))
    except Exception as e:  # noqa: BLE001 - a foreign forward that fails is this model's finding
        report.error = (
            f"{report.spec}: the tiny model's forward failed ({type(e).__name__}: {short_reason(e, 160)})"
        )
        return
    try:
        runner = Runner(spec, model, options, root)
    except Exception as e:  # noqa: BLE001 - the forward runs, so the dump's failure is ffdebug's
        report.cases.append(_raised("copy", "reference dump", e))
        return
    report.layers = len({r.layer for r in runner.records if r.layer is not None})
    groups = {"copy": lambda: [runner.copy_case()], "precision": runner.precision_cases}
    for group, run in groups.items():
        if group in options.groups:
            try:
                report.cases.extend(run())
            except Exception as e:  # noqa: BLE001 - recorded as the group's failing case
                report.cases.append(_raised(group, group, e))
    if runner.rewrites:
        report.engine = next(iter(runner.rewrites.values())).describe()
    if "mutations" in options.groups:
        try:
            planted = Planner(model, runner.records).all()
        except Exception as e:  # noqa: BLE001
            report.cases.append(_raised("mutations", "planning", e))
            return
        for mutation in planted:
            try:
                report.cases.append(runner._mutation(mutation))
            except Exception as e:  # noqa: BLE001
                report.cases.append(_raised("mutations", mutation.kind, e))


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
