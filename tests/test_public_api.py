"""The typed public API (docs/dumping.md "Python API"): every public function spells its options as annotated
keywords with the engine's own defaults, and each keyword reaches the engine."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

import ffdebug
from ffdebug._env import DumpConfig

FUNCTIONS = [name for name in ffdebug.__all__ if inspect.isfunction(getattr(ffdebug, name))]
STEP_TAGS = {"tap", "step"}  # their free keywords are the caller's step-tag names, not options


def test_every_public_function_is_annotated_and_has_no_hidden_options():
    assert {"compare", "bisect", "weights_diff", "load_audit", "install", "tap", "capture", "step"} <= set(
        FUNCTIONS
    )
    for name in FUNCTIONS:
        sig = inspect.signature(getattr(ffdebug, name))
        assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return type"
        for p in sig.parameters.values():
            assert p.annotation is not inspect.Parameter.empty, f"{name}({p.name}): not annotated"
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                assert name in STEP_TAGS, f"{name}(**{p.name}) hides its options: spell them as keywords"
        assert getattr(ffdebug, name).__doc__ and "Example::" in getattr(ffdebug, name).__doc__, name


def test_result_types_exported():
    from ffdebug.results import BisectResult, CompareResult, WeightsDiffResult
    from ffdebug.weights.audit import LoadAuditResult

    assert (ffdebug.CompareResult, ffdebug.BisectResult) == (CompareResult, BisectResult)
    assert (ffdebug.WeightsDiffResult, ffdebug.LoadAuditResult) == (WeightsDiffResult, LoadAuditResult)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ffdebug.Nope  # noqa: B018


def test_the_errors_the_docstrings_name_are_exported(tmp_path):
    """`compare`'s docstring names FFDebugError (exit 2) and InputIdsMismatch (exit 3): a caller
    catches them from `ffdebug` itself."""
    with pytest.raises(ffdebug.FFDebugError) as caught:
        ffdebug.compare(tmp_path / "missing-ref", tmp_path / "missing-target")
    assert caught.value.exit_code == 2 and issubclass(ffdebug.InputIdsMismatch, ffdebug.FFDebugError)
    assert ffdebug.InputIdsMismatch("x").exit_code == 3


def test_import_stays_torch_free():
    code = (
        "import sys, ffdebug; assert not {'torch', 'ffdebug.results'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


LAZY_IMPORT = """
import sys, ffdebug
loaded = sorted(m for m in sys.modules if m.startswith("ffdebug"))
assert loaded == ["ffdebug"], loaded  # every public name waits for its first use
import ffdebug.capture.hooks  # the capture/ subpackage loads first: the name keeps the function
assert callable(ffdebug.capture) and ffdebug.capture.__module__ == "ffdebug.api.capture"
from ffdebug.capture import hooks  # the subpackage is still importable by name
assert hooks is sys.modules["ffdebug.capture.hooks"]
missing = [n for n in ffdebug.__all__ if getattr(ffdebug, n, None) is None]
assert not missing and set(ffdebug.__all__) <= set(dir(ffdebug)), missing
"""


def test_import_ffdebug_loads_nothing_until_a_name_is_used():
    subprocess.run([sys.executable, "-c", LAZY_IMPORT], check=True)


HELP_WITHOUT_RICH_EXTRAS = """
import contextlib, io, sys
sys.argv = ["ffdebug", "--help"]
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        from ffdebug.cli.app import main
        main()
    except SystemExit:
        pass
assert "Usage" in out.getvalue()
heavy = sorted(m for m in ("markdown_it", "pygments", "rich.syntax") if m in sys.modules)
assert not heavy, heavy  # typer's imports of rich.markdown / rich.traceback are stand-ins
from rich.markdown import Markdown
from rich.traceback import Traceback
import rich.console, rich.markdown
console = rich.console.Console(file=io.StringIO(), width=40)
console.print(Markdown("# Title"))  # a stand-in builds the real thing on first use
try:
    1 / 0
except ZeroDivisionError:
    console.print(Traceback())
assert type(rich.markdown).__name__ == "module" and "Title" in console.file.getvalue()
"""


def test_help_skips_the_rich_modules_it_never_uses_and_they_still_work():
    subprocess.run([sys.executable, "-c", HELP_WITHOUT_RICH_EXTRAS], check=True)


def _keywords(fn) -> dict[str, object]:
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.default is not inspect.Parameter.empty
    }


def test_defaults_are_the_engines():
    """A default spelled in the public signature is the one the engine itself has."""
    from ffdebug.bisection.engine import bisect
    from ffdebug.comparison.engine import compare
    from ffdebug.weights.diff import WeightsDiff

    for public, engine in (
        (ffdebug.compare, compare),
        (ffdebug.bisect, bisect),
        (ffdebug.weights_diff, WeightsDiff),
    ):
        ours, theirs = _keywords(public), _keywords(engine)
        shared = set(ours) & set(theirs)
        # weights_diff's two extras are `WeightsDiff.run` / `schema_result`'s (checked below)
        assert set(ours) - shared <= {"schema_only", "progress"}, (
            f"{public.__name__}: options the engine lacks"
        )
        # `group`: the process group of a compare across nodes, which the CLI joins under torchrun
        assert set(theirs) - shared <= {"on_tensor", "group"}, (
            f"{public.__name__}: engine options not exposed"
        )
        for name in shared:
            assert ours[name] == theirs[name], (public.__name__, name)
    fields = {
        f.name: f.default for f in dataclasses.fields(DumpConfig) if f.default is not dataclasses.MISSING
    }
    for name, default in _keywords(ffdebug.capture).items():
        if name in fields:
            assert default == fields[name], f"capture({name}) default differs from DumpConfig"


class _Recorder:
    """Stands in for an engine: remembers what it was called with."""

    def __init__(self, returns=None):
        self.calls: list[tuple[tuple, dict]] = []
        self.returns = returns

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.returns if self.returns is not None else self


class _Hook:
    def begin(self, total: int, total_bytes: int = 0) -> None: ...

    def advance(self, nbytes: int = 0) -> None: ...


HOOK = _Hook()
COMPARE = {
    "layers": "1-2",
    "stages": ("L*.attn_out",),
    "exclude": ("loss.*",),
    "step": {"optimizer_step": 3},
    "rank": 1,
    "thresholds": ("L*:cos>=0.9",),
    "noise": "noise_dir",
    "exact": True,
    "fail_on": "bug",
    "allow_partial": True,
    "maps": ("mix.out=attn_out",),
    "alias_file": "aliases.txt",
    "workers": 2,
    "progress": HOOK,
}
BISECT = {k: v for k, v in COMPARE.items() if k not in ("exact", "workers")}
BISECT.update(layer_class="hash:0-2", model_ref="m:ref", model_target="m:tgt")
WEIGHTS = {
    "strip_prefix": ("model.",),
    "add_prefix": "p.",
    "maps": ("a=b",),
    "alias_file": "f.txt",
    "fuse": ("qkv=q+k+v",),
    "stack": ("e=e.{E}.w",),
    "auto_stack": True,
    "skip": ("*.bias",),
    "layers": "0",
    "transforms": ("*.w=transpose",),
    "dequant": "none",
    "tp_merge": 1,
    "thresholds": ("*:cos>=0.9",),
    "fail_on": "bug",
    "allow_dtype": True,
    "match_content": "off",
    "init": "m:init",
    "init_side": "ref",
    "workers": 3,
}


def _options(fn) -> set[str]:
    return {
        p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


@pytest.mark.parametrize(
    ("public", "engine", "options"),
    [
        ("compare", "ffdebug.comparison.engine.compare", COMPARE),
        ("bisect", "ffdebug.bisection.engine.bisect", BISECT),
        (
            "load_audit",
            "ffdebug.weights.audit.load_audit",
            {k: v for k, v in WEIGHTS.items() if k not in ("auto_stack", "init_side", "workers")},
        ),
    ],
)
def test_each_keyword_reaches_the_engine(monkeypatch, public, engine, options):
    """Every keyword-only option, given a value other than its default, arrives at the engine as given."""
    assert set(options) == _options(getattr(ffdebug, public)), "the test lists every option"
    recorder = _Recorder()
    monkeypatch.setattr(engine, recorder)
    monkeypatch.setattr("ffdebug.report.bisect_text.conclude", lambda result: result)
    getattr(ffdebug, public)("a", "b", **options)
    ((args, got),) = recorder.calls
    assert args == ("a", "b") and got == options


def test_weights_diff_keywords_reach_the_engine(monkeypatch):
    assert set(WEIGHTS) | {"schema_only", "progress"} == _options(ffdebug.weights_diff)
    built = _Recorder()
    ran = _Recorder(returns="numerics")
    built.run = ran
    built.schema_result = lambda: "schema"
    monkeypatch.setattr("ffdebug.weights.diff.WeightsDiff", lambda *a, **kw: built(*a, **kw) and built)
    assert ffdebug.weights_diff("a", "b", **WEIGHTS, progress=HOOK) == "numerics"
    assert built.calls == [(("a", "b"), WEIGHTS)] and ran.calls == [((), {"progress": HOOK})]
    assert ffdebug.weights_diff("a", "b", schema_only=True) == "schema"


def test_capture_keywords_reach_its_config(tmp_path):
    """capture's dump settings become the session's DumpConfig (the same one env vars give)."""
    from ffdebug.capture import state

    with ffdebug.capture(
        dir=tmp_path,
        side="ref",
        layers="0-1",
        stages="L*",
        calls="2-3",
        mode="stats",
        grads=True,
        max_bytes=1024,
        queue_bytes=0,
        overwrite=True,
        topk=5,
        layer_attrs="idx",
        substages=True,
        grad_sample=4,
    ):
        c = state.active_session().config
    assert (c.side, c.layers.spec, c.stages, c.calls.lo, c.calls.hi, c.mode) == (
        "ref",
        "0-1",
        ("L*",),
        2,
        3,
        "stats",
    )
    assert (c.grads, c.max_bytes, c.queue_bytes, c.overwrite, c.topk) == (True, 1024, 0, True, 5)
    assert (c.layer_attrs, c.substages, c.grad_sample) == (("idx",), True, 4)


def test_options_have_their_effect(tmp_path):
    """Real engines: `tap(layer=, scale=, step tags)` lands in the manifest; `compare(stages=,
    exclude=)` selects stages; `weights_diff(skip=)` leaves a tensor out."""
    import torch
    from safetensors.torch import save_file

    x = torch.arange(12.0).reshape(3, 4)
    for side, flip in (("ref", 1.0), ("target", -1.0)):
        with ffdebug.capture(dir=tmp_path, side=side):
            ffdebug.tap("mlp.out", x, layer=2, scale=3.0, microbatch=1)
            ffdebug.tap("head", flip * x)
    result = ffdebug.compare(tmp_path / "ref", tmp_path / "target", exclude=["head"], allow_partial=True)
    (stage,) = result.stages
    assert (stage.key, stage.layer, stage.step, stage.ok) == ("L002.mlp.out", 2, {"microbatch": 1}, True)
    assert (
        ffdebug.compare(tmp_path / "ref", tmp_path / "target", stages=["head"]).verdict
        == ffdebug.Severity.SCRAMBLE
    )

    save_file({"a": x, "b": x.clone()}, str(tmp_path / "a.safetensors"))
    save_file({"a": x, "b": -x}, str(tmp_path / "b.safetensors"))
    assert not ffdebug.weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert ffdebug.weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", skip="b")


def test_review_no_longer_flags_the_public_api():
    """`ffdebug review` passes on the package's public surface (its annotation and docstring checks
    flagged 15 findings on the untyped `**opts` version)."""
    import json

    from typer.testing import CliRunner

    from ffdebug.cli.app import app

    root = inspect.getfile(ffdebug).rsplit("/", 1)[0]
    r = CliRunner().invoke(app, ["review", f"{root}/__init__.py", f"{root}/api", "--json"])
    report = json.loads(r.stdout)
    assert r.exit_code == 0 and report["passed"] and report["findings"] == [], report["findings"]
