"""`ffdebug isolate` (which fix matters) and `ffdebug replay` (kernel or input), docs/hunt.md "Hunt: from
symptom to root cause"."""

from __future__ import annotations

import typer

ISOLATE_HELP = """Fix isolation by revert: the target runs with every fix, then once per fix with that
fix alone reverted, each in its own git worktree (your checkout is never touched), and its final
output is compared with the all-fixes run:

  critical     reverting it leaves the output outside the ok band
  fine-tuning  not bit-equal, but inside the ok band (e.g. fp32 accumulation in a norm)
  no effect    bit-equal (a rename)

Fixes are commits in HEAD or patch files applied on top of HEAD. The target command runs in the
worktree with PYTHONPATH=<worktree> first; {worktree} in it is replaced by the path. A run that
imported the checkout's packages from elsewhere is reported. It also says whether all fixes
together are byte-equal to the reference.

[bold]Examples[/bold]

  ffdebug isolate --ref "python run_ref.py" --target "python run.py" --fix a1b2c3 --fix d4e5f6
  ffdebug isolate --ref "python ref.py" --target "python {worktree}/run.py" --fix fix-norm.patch --json

Exit codes: 0 done; 2 bad input, a fix that does not apply, or a command that failed (its log is named).
"""

REPLAY_HELP = """Offline kernel isolation on one dumped stage: F(*inputs, **kwargs) is called with the
stage's dumped inputs in recorded order (KEY.in, KEY.in.1, ...; a block stage L003 takes
L003.hidden_in), each function on each side's inputs. The four runs are compared with the reference
function on the reference's inputs; the verdict is kernel (the target function differs on the same
input), input (the functions agree; the target's inputs move the result) or none.

[bold]Examples[/bold]

  ffdebug replay /tmp/dump --stage L003.mlp.act_fn --ref-fn ref_ops:silu --target-fn my_kernels:fast_silu
  ffdebug replay /tmp/dump --stage L003 --ref-fn blocks.py:ref_block --target-fn blocks.py:port_block \\
      --kwargs '{"eps": 1e-6}' --json

Exit codes: 0 none; 1 kernel or input; 2 bad input.
"""


def register(app: typer.Typer) -> None:
    @app.command("isolate", help=ISOLATE_HELP)
    def isolate_command(
        ref: str = typer.Option(..., "--ref", help="Shell command of the reference run."),
        target: str = typer.Option(
            ..., "--target", help="Shell command of the target run (in each worktree)."
        ),
        fix: list[str] = typer.Option(..., "--fix", help="A fix: commit in HEAD or patch file (repeatable)."),
        repo: str = typer.Option(".", "--repo", help="The git repository holding the fixes."),
        dir: str = typer.Option("ffdebug-isolate", "--dir", help="Where dumps, logs and worktrees go."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        from ffdebug.hunt.isolate import IsolateConfig, isolate
        from ffdebug.report.hunt_text import print_isolate
        from ffdebug.report.sink import Output

        result = isolate(IsolateConfig(ref=ref, target=target, fixes=tuple(fix), dir=dir, repo=repo))
        Output(json=json_out).show(result, print_isolate)

    @app.command("replay", help=REPLAY_HELP)
    def replay_command(
        dir: str = typer.Argument(..., help="Dump directory holding ref/ and target/."),
        stage: str = typer.Option(
            ..., "--stage", help="Stage key without .in/.out: L003.mlp.gate_proj, or L003."
        ),
        ref_fn: str = typer.Option(..., "--ref-fn", help="module:function or file.py:function (reference)."),
        target_fn: str = typer.Option(
            ..., "--target-fn", help="module:function or file.py:function (target)."
        ),
        kwargs: str = typer.Option(
            None, "--kwargs", help="JSON object of keyword arguments for both functions."
        ),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        import json

        from ffdebug.errors import FFDebugError
        from ffdebug.hunt.replay import replay
        from ffdebug.report.hunt_text import print_replay
        from ffdebug.report.sink import Output

        parsed = None
        if kwargs:
            try:
                parsed = json.loads(kwargs)
            except ValueError as err:
                raise FFDebugError(
                    f"--kwargs {kwargs!r} is not JSON ({err.msg}); e.g. '{{\"eps\": 1e-6}}'"
                ) from None
            if not isinstance(parsed, dict):
                raise FFDebugError(f"--kwargs {kwargs!r}: give a JSON object, e.g. '{{\"eps\": 1e-6}}'")
        result = replay(dir, stage, ref_fn, target_fn, parsed)
        Output(json=json_out).show(result, print_replay)
        raise typer.Exit(0 if result.verdict == "none" else 1)
