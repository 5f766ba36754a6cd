"""`ffdebug bisect`: the first layer that introduces error, per layer class, the pattern and the
sub-stage inside it."""

from __future__ import annotations

import typer

from ffdebug.cli.common import (
    ALIAS_FILE_OPT,
    ALLOW_PARTIAL_OPT,
    DIR_OPT,
    EXCLUDE_OPT,
    FAIL_ON_HELP,
    JSON_OPT,
    LAYERS_OPT,
    MAP_OPT,
    NOISE_OPT,
    SIDES_ARG,
    STAGES_OPT,
    STEP_OPT,
    THRESHOLD_OPT,
    check_fail_on,
    selection_options,
)
from ffdebug.verdict import Severity

HELP = """Localise where a target first parts from its reference: the first layer that introduces
error (per layer class), the pattern (match, drift, layer_class, jump, undetermined) and the sub-stage inside that
layer whose own step loses accuracy. Ends with one sentence naming layer, class, stage and pattern.

[bold]Examples[/bold]

  ffdebug bisect --dir /tmp/dump                       # D/ref vs D/target
  ffdebug bisect /tmp/dump/ref /tmp/dump/target --html report.html
  ffdebug bisect --dir D --noise /tmp/noise/ref        # calibrate: the reference run twice
  ffdebug bisect --dir D --layer-class 'hash:0-2,routed:3-' --json
  ffdebug bisect --dir D --model-ref my_models:build_ref --model-target my_models:build_engine
  ffdebug bisect --dir D --alias-file examples/external_trainer/taps.txt   # your trainer vs the reference

Trainer stores (optimizer_step tags, docs/trainer-taps.md): the first divergent stage in training
order (rollout, reward, advantage, train forwards, loss, gradients, updates) of the first divergent
optimizer step, and per role. A harmless difference (prompts encoded as a batch) changes every
later stage a little: with --noise (the reference run again with that kind of change, never the
target re-run) a stage is the divergence when its error is beyond the noise run's there, e.g.

  ffdebug bisect D/ref D/target --alias-file taps.txt --noise D/noise

Dump sub-stages by naming more classes: FFDEBUG_FWD_DUMP_BLOCK_CLASS=DecoderLayer,TopkRouter,MLP.
Per-rank target dumps are folded as their manifest says (reduction='partial': summed; shard: concatenated);
undeclared ones are tested as partial sums and shards. Warm-up calls are set aside.

Judgement: error above rounding after an exactly equal prefix in the same dtype (or beyond a --noise run, beyond a less precise dtype's budget, or found local by --model-target) is a bug signal however small its band: the verdict is raised to bug ('signal' in --json; 'judgement' is the same grade). Precision is never a bug: bf16 / fp16 against fp32 is judged against its dtype (drift), and tokens that take another expert at a near tie are left out of later stages (routing flip).

Exit codes: 0 verdict below --fail-on and everything compared; 1 at or above it; 2 bad input; 3
input ids differ; 4 incomplete (what was left out is named; --allow-partial makes it 0).

Progress goes to stderr: a bar on a terminal, else a line every FFDEBUG_PROGRESS_INTERVAL seconds
(0: one per stage; docs/cli.md "Progress").
"""


def register(app: typer.Typer) -> None:
    @app.command("bisect", help=HELP)
    def bisect_command(
        sides: list[str] = SIDES_ARG,
        dir: str = DIR_OPT,
        layers: str = LAYERS_OPT,
        stages: list[str] = STAGES_OPT,
        exclude: list[str] = EXCLUDE_OPT,
        step: list[str] = STEP_OPT,
        rank: int = typer.Option(None, "--rank", help="Use this rank only (no folding of ranks)."),
        threshold: list[str] = THRESHOLD_OPT,
        noise: str = NOISE_OPT,
        layer_class: str = typer.Option(
            None, "--layer-class", help="Declare layer classes by hand: 'hash:0-2,routed:3-'."
        ),
        model_ref: str = typer.Option(
            None, "--model-ref", help="module:function returning the reference model (attribution control)."
        ),
        model_target: str = typer.Option(
            None,
            "--model-target",
            help="module:function returning the target model: re-run its blocks on the reference's inputs.",
        ),
        html: str = typer.Option(None, "--html", help="Write a self-contained HTML report here."),
        all_stages: bool = typer.Option(
            False, "--all", help="Show every stage, not only the first bad layer."
        ),
        fail_on: str = typer.Option(Severity.DIVERGE.value, "--fail-on", help=FAIL_ON_HELP),
        maps: list[str] = MAP_OPT,
        alias_file: str = ALIAS_FILE_OPT,
        allow_partial: bool = ALLOW_PARTIAL_OPT,
        json_out: bool = JSON_OPT,
    ) -> None:
        from ffdebug.bisection.engine import bisect
        from ffdebug.report.bisect_text import conclude

        fail = check_fail_on(fail_on)
        if html:  # before the analysis: a bad path is one line, not a lost bisect
            from ffdebug.report.output import check_output_file

            check_output_file(html, "--html")
        options = selection_options(
            layers=layers,
            stages=stages,
            exclude=exclude,
            step=step,
            rank=rank,
            threshold=threshold,
            noise=noise,
            fail_on=fail,
            allow_partial=allow_partial,
            maps=maps,
            alias_file=alias_file,
        ) | {"layer_class": layer_class, "model_ref": model_ref, "model_target": model_target}

        def render(result) -> int:
            conclude(result)
            if html:
                from ffdebug.report.html import write_bisect_html

                write_bisect_html(result.to_json(), html)
            from ffdebug.report.bisect_text import print_bisect
            from ffdebug.report.sink import Output

            Output(json=json_out).show(result, print_bisect, all_stages=all_stages, html=html)
            return result.exit_code()

        from ffdebug.across.cli import run_command

        raise typer.Exit(run_command(bisect, sides, dir, options, render))
