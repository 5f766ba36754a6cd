"""`ffdebug hunt`: the dump-bisect rounds run by ffdebug itself (docs/hunt.md "Hunt: from symptom to root cause")."""

from __future__ import annotations

import typer

HELP = """Run the reference and the target commands (each calls ffdebug.install) round after round,
setting FFDEBUG_* for each, until the layer and the sub-stage that introduce the error are named.

  round 0  (--weights A B, or --dump-weights: each command's maybe_dump_weights_and_exit writes
           its weights and exits) weights-diff first; a weight bug ends the hunt
  round 1  a sketch of every block stage, embed and final (FFDEBUG_FWD_DUMP_MODE=sketch): rel and
           cos estimated from a seeded 1,024-bucket sketch, so a rotary swap shows even where mean,
           std and norm agree; bisect names the first introducing layer
  round 2  full dumps of that layer with its role sub-stages (attn.q.out, mlp.gate.out, ...)
           and the block stages of the layer before
  round 3  only when needed: round 2 for the layer before when that one is already wrong; else,
           when the layer's input differs between the sides, the target alone with that layer
           fed the reference's hidden_in (FFDEBUG_FWD_FEED_DIR): local or inherited

Each round prints its decision, its evidence, its bytes and the command lines that reproduce it.
D/hunt.json is written after every round: --resume continues an interrupted hunt without redoing
finished rounds.

[bold]Examples[/bold]

  ffdebug hunt --ref "python run_ref.py" --target "python run_engine.py" --dir /tmp/hunt
  ffdebug hunt --ref "python ref.py" --target "python port.py" --noise "python ref.py --bf16" \\
      --budget 2GiB --dir /tmp/hunt --html hunt.html
  ffdebug hunt --ref "python ref.py" --target "python port.py" --dir /tmp/hunt --resume --json
  ffdebug hunt --ref "python ref.py" --target "python port.py" --dump-weights --dir /tmp/hunt

Exit codes: 0 the hunt finished and found no divergence; 1 it named where the error starts; 2 bad
input or a command failed (its log is named); 3 the sides were fed different input ids; 4
incomplete (budget spent or interrupted: raise --budget and --resume).
"""


def register(app: typer.Typer) -> None:
    @app.command("hunt", help=HELP)
    def hunt_command(
        ref: str = typer.Option(..., "--ref", help="Shell command of the reference run."),
        target: str = typer.Option(..., "--target", help="Shell command of the target run."),
        noise: str = typer.Option(
            None,
            "--noise",
            help="A third command: the reference in the target's dtype, or at another thread count.",
        ),
        budget: str = typer.Option(
            None, "--budget", help="Byte budget over every round and side: 64MiB, 2G."
        ),
        dir: str = typer.Option("ffdebug-hunt", "--dir", help="Where rounds and hunt.json go."),
        weights: list[str] = typer.Option(
            None, "--weights", help="Two checkpoints (give twice): round 0 diffs them."
        ),
        dump_weights: bool = typer.Option(
            False,
            "--dump-weights",
            help="Round 0 from the commands: each calls ffdebug.maybe_dump_weights_and_exit(model).",
        ),
        seed: int = typer.Option(0, "--seed", help="Sketch seed (the same on every side)."),
        resume: bool = typer.Option(
            False, "--resume", help="Continue the hunt in --dir, keeping finished rounds."
        ),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output (D/hunt.json's keys)."),
        html_out: str = typer.Option(None, "--html", help="Write a self-contained HTML report here."),
    ) -> None:
        from ffdebug.errors import FFDebugError
        from ffdebug.hunt.engine import hunt
        from ffdebug.hunt.rounds import HuntConfig
        from ffdebug.hunt.runner import parse_size
        from ffdebug.report import hunt_text
        from ffdebug.report.output import check_output_file, write_output_file
        from ffdebug.report.sink import Output

        if weights and len(weights) != 2:
            raise FFDebugError(
                f"--weights takes two checkpoints (given {len(weights)}): --weights A --weights B"
            )
        if html_out:
            check_output_file(html_out, "--html")
        cfg = HuntConfig(
            ref=ref,
            target=target,
            dir=dir,
            noise=noise,
            budget=parse_size(budget),
            weights=tuple(weights) if weights else None,
            dump_weights=dump_weights,
            seed=seed,
        )
        state = hunt(
            cfg,
            resume=resume,
            on_round=lambda r, kept: hunt_text.print_round(r, kept, err=json_out, noise=noise),
        )
        if html_out:
            write_output_file(html_out, hunt_text.hunt_html(state, noise), "--html")
        Output(json=json_out).show(state, hunt_text.print_hunt)
        if not state.complete:
            raise typer.Exit(4)
        raise typer.Exit(0 if state.layer is None and state.sub_stage is None else 1)
