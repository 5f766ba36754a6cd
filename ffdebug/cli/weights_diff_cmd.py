"""`ffdebug weights-diff A B` and `ffdebug load-audit ENTRY CHECKPOINT`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from ffdebug.cli.common import FAIL_ON_HELP, check_fail_on
from ffdebug.report.sink import write_json
from ffdebug.verdict import Severity

if TYPE_CHECKING:  # types only: the command imports the engine when it runs
    from ffdebug.results import WeightsDiffResult
    from ffdebug.weights.diff import WeightsDiff

WEIGHTS_HELP = """Compare two sets of weights: schema first (names, shapes, dtypes, rename suggestions), then float64 numerics per tensor (byte-equal fast path; cos, rel, max_abs; a finding per tensor: equal, dtype_only, rounding, transposed, sign_flip, scaled, mismatch).

A and B may each be a .safetensors file, a Hugging Face model folder (single file or sharded with model.safetensors.index.json), a *.index.json, a diffusers component folder, a .pt/.bin state dict (weights_only loading only), a weight dump written by maybe_dump_weights_and_exit (per rank), a folder of per-rank checkpoints (rank0/, rank1/ or *rank0*.safetensors), or a Python entry module:function returning a module or a state dict. Tensors are read one at a time.

Name options rewrite target (B) names into reference (A) names (--strip-prefix applies to both sides). Tensors the names leave unpaired are related by content (--match-content auto): equal, transposed or scaled copies, fused tensors (which parts, in which order, verified numerically) and stacked experts; the port's convention is what most of its tensors do, and a tensor that departs from it is named (swapped, permuted), one no content matched is paired by the learned rule (not_loaded with --init).

A weight dump written with FFDEBUG_WEIGHT_DUMP_LAYERS restricts the other side to those layers; buffers only a dump holds (rotary inv_freq, …) are listed as buffers not in checkpoints, not as a schema difference.

[bold]Examples[/bold]

  ffdebug weights-diff hf_model/ engine_dump/weights   # a layer-selected dump restricts hf_model to its layers
  ffdebug weights-diff hf_model/ converted.safetensors --strip-prefix model.
  ffdebug weights-diff hf_model/ gpt2_like.pt --map '^transformer\\.h\\.{L}\\.=model.layers.{L}.'
  ffdebug weights-diff hf_model/ engine.safetensors --fuse qkv_proj=q_proj+k_proj+v_proj
  ffdebug weights-diff moe_dump/weights hf_moe/ --stack 'experts.down_proj=experts.{E}.down_proj.weight'
  ffdebug weights-diff full/ tp_dump/weights --tp-merge auto --skip '*.experts.*' --layers 0-3
  ffdebug weights-diff bf16/ fp8/ --dequant auto --allow-dtype --json
  ffdebug weights-diff ref/ engine/ --transform '*.o_proj.weight=transpose'
  ffdebug weights-diff ref/ engine/ --transform 'ref:*.experts.*=mylib.layout:shuffle'

Exit codes: 0 match; 1 a schema difference (only-in, shape, dtype unless --allow-dtype), a replicated tensor differing across ranks, or a tensor at or above --fail-on; 2 bad input.

Progress of the numerics goes to stderr: a bar on a terminal, else a line every FFDEBUG_PROGRESS_INTERVAL seconds (0: one per tensor; docs/cli.md "Progress"). """

AUDIT_HELP = """Audit what a model really loaded from a checkpoint: checkpoint tensors never loaded, model tensors the checkpoint does not hold (left at their initialisation), shape mismatches a non-strict load skipped, and tensors whose loaded values differ from the checkpoint.

ENTRY is module:function (or path/to/file.py:function); it is called with the checkpoint path when it takes an argument, and returns the loaded nn.Module. When that argument is optional, ENTRY is also called without it (same torch seed) to get the model's own initialisation: a tensor still equal to it is reported not loaded (or pass --init). Name options rewrite CHECKPOINT names into the model's names; names that still differ are related by content, as in weights-diff. CHECKPOINT is any weights-diff input. MoE experts that the model holds stacked (transformers 5: experts.gate_up_proj [E, 2I, H]) and the checkpoint per expert are paired automatically (from transformers' own conversion mapping for a PreTrainedModel, else by name and shape) and compared expert by expert.

[bold]Examples[/bold]

  ffdebug load-audit mypkg.loading:build_model /ckpt/model
  ffdebug load-audit tools/load.py:load ckpt.safetensors --strip-prefix module. --json

Exit codes: 0 everything loaded as stored; 1 anything never loaded, left uncovered, skipped for its shape, or loaded with other values (at or above --fail-on); 2 bad input. """


def _name_options(rewritten: str, into: str):
    """The name options of both commands; `rewritten` names the side whose names they rewrite
    (weights-diff: B, the target; load-audit: CHECKPOINT) and `into` the side they must match."""
    return dict(
        strip_prefix=typer.Option(
            None, "--strip-prefix", help="Remove this prefix from names on both sides (repeatable)."
        ),
        add_prefix=typer.Option(None, "--add-prefix", help=f"Prepend this prefix to {rewritten} names."),
        maps=typer.Option(
            None,
            "--map",
            help=f"OLD=NEW regex rewriting {rewritten} names into {into} names (repeatable); {{L}} "
            "stands for a layer number. A rule that matches nothing is a warning.",
        ),
        alias_file=typer.Option(
            None,
            "--alias-file",
            help=f"File of OLD=NEW rules (text, JSON or YAML), OLD a {rewritten} name, NEW a {into} name.",
        ),
        fuse=typer.Option(
            None,
            "--fuse",
            help="FUSED=PART+PART\\[@DIM]: pair a fused tensor (either side) with its parts (repeatable).",
        ),
        match_content=typer.Option(
            "auto",
            "--match-content",
            help="auto: relate the tensors the names leave unpaired by content (equal, transposed, "
            "scaled, fused, stacked experts) and compare them; off: names only.",
        ),
        init=typer.Option(
            None,
            "--init",
            help="module:function returning the port built without loading (its initialisation): a "
            "tensor still equal to it is reported not_loaded.",
        ),
        stack=typer.Option(
            None,
            "--stack",
            help="STACKED=PART+PART\\[@DIM] with {E} in each part: pair a stacked MoE tensor [E, …] with "
            "one tensor per expert and part, e.g. 'experts.gate_up_proj=experts.{E}.gate_proj.weight"
            "+experts.{E}.up_proj.weight' (repeatable).",
        ),
    )


def register(app: typer.Typer) -> None:
    """Add `weights-diff` and `load-audit` to `app`."""
    _register_weights_diff(app, _name_options("target (B)", "reference (A)"))
    _register_load_audit(app, _name_options("CHECKPOINT", "model"))


def _numerics(diff: WeightsDiff) -> WeightsDiffResult:
    """The numerics with progress on stderr (docs/cli.md "Progress")."""
    from ffdebug.report.progress import Progress

    with Progress("weights-diff", "tensors") as progress:
        return diff.run(progress=progress)


def _render_diff(diff, schema_only: bool, show_all: bool, json_out: bool) -> None:
    """Run the numerics (unless --schema-only), print or emit, and exit 1 when the diff fails."""
    if json_out:
        result = diff.schema_result() if schema_only else _numerics(diff)
        write_json(result.to_json())
        raise typer.Exit(1 if result.failed() else 0)
    from rich.console import Console

    from ffdebug.report.weights_text import print_weights_numerics, print_weights_schema

    console = Console()
    print_weights_schema(diff.schema_result().to_json(), console)  # before the numerics start
    result = diff.schema_result() if schema_only else _numerics(diff)
    print_weights_numerics(result.to_json(), console, show_all=show_all)
    raise typer.Exit(1 if result.failed() else 0)


def _register_weights_diff(app: typer.Typer, names: dict) -> None:
    @app.command("weights-diff", help=WEIGHTS_HELP)
    def weights_diff_command(
        a: str = typer.Argument(..., metavar="A", help="Reference weights (see the kinds above)."),
        b: str = typer.Argument(..., metavar="B", help="Target weights."),
        strip_prefix: list[str] = names["strip_prefix"],
        add_prefix: str = names["add_prefix"],
        maps: list[str] = names["maps"],
        alias_file: str = names["alias_file"],
        fuse: list[str] = names["fuse"],
        stack: list[str] = names["stack"],
        match_content: str = names["match_content"],
        init: str = names["init"],
        skip: list[str] = typer.Option(
            None, "--skip", help="Glob of tensor names to leave out (repeatable)."
        ),
        layers: str = typer.Option(
            None, "--layers", help="Layers to compare: '0,2,5-7,-1' (tensors outside blocks are kept)."
        ),
        transform: list[str] = typer.Option(
            None,
            "--transform",
            help="\\[ref:|target:]GLOB=transpose|module:function layout transform (repeatable).",
        ),
        dequant: str = typer.Option(
            "auto",
            "--dequant",
            help="fp8 dequantisation: auto (when the other side is not fp8), always, none.",
        ),
        tp_merge: str = typer.Option("auto", "--tp-merge", help="Merge per-rank shards: auto or a dim."),
        threshold: list[str] = typer.Option(
            None, "--threshold", help="'GLOB:cos>=X,rel<=Y' ok band per tensor."
        ),
        fail_on: str = typer.Option(Severity.DIVERGE.value, "--fail-on", help=FAIL_ON_HELP),
        allow_dtype: bool = typer.Option(False, "--allow-dtype", help="dtype differences alone do not fail."),
        schema_only: bool = typer.Option(False, "--schema-only", help="Stop after the schema diff."),
        show_all: bool = typer.Option(False, "--all", help="List byte-equal tensors too."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output with the stable keys."),
        workers: int = typer.Option(
            None,
            "--workers",
            min=1,
            help="Workers comparing tensor pairs in parallel: forked processes on Linux, else one "
            "(default: one per free core); the output is the same at any count.",
        ),
    ) -> None:
        from ffdebug.weights.diff import WeightsDiff

        diff = WeightsDiff(
            a,
            b,
            strip_prefix=tuple(strip_prefix or ()),
            add_prefix=add_prefix,
            maps=tuple(maps or ()),
            alias_file=alias_file,
            fuse=tuple(fuse or ()),
            stack=tuple(stack or ()),
            skip=tuple(skip or ()),
            layers=layers,
            transforms=tuple(transform or ()),
            dequant=dequant,
            tp_merge=tp_merge,
            thresholds=tuple(threshold or ()),
            fail_on=check_fail_on(fail_on),
            allow_dtype=allow_dtype,
            match_content=match_content,
            init=init,
            workers=workers,
        )
        _render_diff(diff, schema_only, show_all, json_out)


def _register_load_audit(app: typer.Typer, audit_names: dict) -> None:
    @app.command("load-audit", help=AUDIT_HELP)
    def load_audit_command(
        entry: str = typer.Argument(..., metavar="ENTRY", help="module:function returning the loaded model."),
        checkpoint: str = typer.Argument(
            ..., metavar="CHECKPOINT", help="The checkpoint it should have loaded."
        ),
        strip_prefix: list[str] = audit_names["strip_prefix"],
        add_prefix: str = audit_names["add_prefix"],
        maps: list[str] = audit_names["maps"],
        alias_file: str = audit_names["alias_file"],
        fuse: list[str] = audit_names["fuse"],
        stack: list[str] = audit_names["stack"],
        match_content: str = audit_names["match_content"],
        init: str = audit_names["init"],
        skip: list[str] = typer.Option(
            None, "--skip", help="Glob of tensor names to leave out (repeatable)."
        ),
        fail_on: str = typer.Option(Severity.DIVERGE.value, "--fail-on", help=FAIL_ON_HELP),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        from ffdebug.weights.audit import load_audit

        result = load_audit(
            entry,
            checkpoint,
            strip_prefix=tuple(strip_prefix or ()),
            add_prefix=add_prefix,
            maps=tuple(maps or ()),
            alias_file=alias_file,
            fuse=tuple(fuse or ()),
            stack=tuple(stack or ()),
            match_content=match_content,
            init=init,
            skip=tuple(skip or ()),
            fail_on=check_fail_on(fail_on),
        )
        if json_out:
            write_json(result.to_json())
        else:
            from ffdebug.report.weights_text import print_load_audit

            print_load_audit(result.to_json())
        raise typer.Exit(1 if result.failed() else 0)
