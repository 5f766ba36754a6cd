"""`ffdebug selftest`: does ffdebug understand this architecture? (docs/selftest.md)"""

from __future__ import annotations

import typer

HELP = """Shrink a Hugging Face architecture to a tiny seeded model on the CPU and check that ffdebug
judges it right: a bit-identical copy passes (a), the model in bf16 / fp16 and with another
attention implementation is at most drift (b), and planted mutations, one per role the model has
(a projection scaled, a head zeroed, the rotary base, a norm's eps, the MLP activation, two experts
swapped, top-k normalisation off, a sliding window ignored), are found at their layer, stage,
sub-stage and pattern (c). Every case dumps through ffdebug.capture and runs ffdebug bisect, as
your own two runs would.

SPEC is a config.json (or a checkpoint folder holding one), a transformers class name
(Qwen2ForCausalLM, T5ForConditionalGeneration, ViTForImageClassification, Qwen2Config), a diffusers
denoiser class (SD3Transformer2DModel, UNet2DConditionModel), a model_type (qwen2) or a model id in
the local Hugging Face cache; nothing is downloaded. --zoo runs every architecture of the families
named by --family (default all: causal_lm, seq2seq_lm, image_classification, diffusers) that the
installed transformers and diffusers ship (--sample N: a seeded N of each family); an architecture
that cannot be built is listed with why. --engine runs (a) and (c) against an engine-style rewrite
of each model instead: sibling projections fused, every module renamed, a causal LM's batch packed
into one row with cu_seqlens where its attention allows it (docs/selftest.md).

Exit 0 when every case holds, 1 when one does not (the table says which), 2 for a spec that names
no model or a model the shrinker cannot build.

[bold]Examples[/bold]

  ffdebug selftest qwen2
  ffdebug selftest path/to/config.json --cases copy,mutations
  ffdebug selftest SD3Transformer2DModel
  ffdebug selftest --zoo --sample 8 --seed 0 --json
  ffdebug selftest --zoo --family diffusers,seq2seq_lm --json
  ffdebug selftest llama --engine
"""


def register(app: typer.Typer) -> None:
    @app.command("selftest", help=HELP)
    def selftest_command(
        specs: list[str] = typer.Argument(
            None, help="Models: config file, class name, model_type or cached id."
        ),
        zoo: bool = typer.Option(
            False, "--zoo", help="Every causal LM architecture of the installed transformers."
        ),
        sample: int = typer.Option(
            0, "--sample", min=0, help="With --zoo: a seeded sample of N architectures per family (0: all)."
        ),
        family: str = typer.Option(
            "all",
            "--family",
            help="With --zoo: families, comma-separated (causal_lm, seq2seq_lm, "
            "image_classification, diffusers), or all.",
        ),
        seed: int = typer.Option(0, "--seed", help="Seed of the weights, the inputs and the --sample draw."),
        cases: str = typer.Option(
            "copy,precision,mutations", "--cases", help="Case groups, comma-separated."
        ),
        keep: str = typer.Option(
            None, "--keep", help="Keep the dumps under this directory (one folder a model)."
        ),
        engine: bool = typer.Option(
            False,
            "--engine",
            help="Compare against an engine-style rewrite of each model (projections fused, modules "
            "renamed, a causal LM packed with cu_seqlens): the copy and mutation cases.",
        ),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output: every case."),
    ) -> None:
        from ffdebug.errors import FFDebugError
        from ffdebug.logs import get_logger
        from ffdebug.report.selftest_text import print_selftest
        from ffdebug.report.sink import Output
        from ffdebug.selftest.cases import SelftestOptions
        from ffdebug.selftest.families import FAMILIES
        from ffdebug.selftest.run import selftest
        from ffdebug.selftest.zoo import sample as zoo_sample

        if zoo and specs:
            raise FFDebugError("give SPECs or --zoo, not both")
        if not zoo and not specs:
            raise FFDebugError("give at least one SPEC (e.g. ffdebug selftest qwen2), or --zoo")
        if sample and not zoo:
            raise FFDebugError("--sample draws from the zoo: add --zoo")
        families = FAMILIES if family == "all" else tuple(f.strip() for f in family.split(",") if f.strip())
        unknown = [f for f in families if f not in FAMILIES]
        if unknown:
            raise FFDebugError(
                f"--family {', '.join(unknown)}: unknown; choose from {', '.join(FAMILIES)} or all"
            )
        if family != "all" and not zoo:
            raise FFDebugError("--family chooses the zoo's families: add --zoo")
        groups = tuple(g.strip() for g in cases.split(",") if g.strip())
        if engine:
            groups = tuple(g for g in groups if g != "precision")
        options = SelftestOptions(groups=groups, seed=seed, keep=keep, engine=engine)
        if zoo:
            names = [n for f in families for n in zoo_sample(sample or 10**9, seed, f)]
        else:
            names = list(specs)
        log = get_logger("progress")

        def on_model(i: int, n: int, spec: str) -> None:
            log.info("selftest: %d/%d %s", i + 1, n, spec)

        result = selftest(names, options, zoo=zoo, on_model=on_model)
        Output(json=json_out).show(result, print_selftest, detail=not zoo)
        raise typer.Exit(result.exit_code())
