"""``reference-trainer``: train from a YAML config, list what is registered, diff two runs.

    reference-trainer train CONFIG [--output-dir DIR] [--max-steps N] [--resume DIR|latest] [--set k=v ...]
    reference-trainer list [--json]
    reference-trainer diff RUN_A RUN_B [--json]

Also ``python -m reference_trainer ...``. Only typer and rich are imported at module level; torch,
diffusers and the trainers are imported inside the commands. Known errors (invalid config or YAML,
contract mismatch, refused or damaged checkpoint, bad log line, non-finite loss, bad reward) end in
one ``reference-trainer: error: Type: message`` line on stderr (never wrapped) plus a hint — exit 2
for config/usage errors, 1 for failures during training; ``FFDEBUG_DEBUG=1`` shows the traceback.
The boundary is ffdebug's (``ffdebug.cli.boundary``, docs/architecture.md "Layers", the cli/ row): ``TrainerErrors``
only names the program and maps the trainer's exception types to exit codes. ``main(args)`` runs the CLI in
process and returns the exit code (the fault-injection tests call it so).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ffdebug.cli.boundary import OneLineErrors
from ffdebug.cli.conventions import GLOBAL_HELP, add_global_options


class TrainerErrors(OneLineErrors):
    """`reference-trainer`'s error boundary: config and usage errors exit 2, failures during training 1."""

    program = "reference-trainer"
    hint = "set FFDEBUG_DEBUG=1 for the full traceback"

    def known_error(self, err: Exception) -> tuple[str, int] | None:
        """`Type: message` and 2 for a config or usage error, 1 for a training failure, None otherwise."""
        usage, failures = _known_errors()
        if isinstance(err, usage):
            return f"{type(err).__name__}: {err}", 2
        if isinstance(err, failures):
            return f"{type(err).__name__}: {err}", 1
        return None


app = typer.Typer(
    cls=TrainerErrors,
    name="reference-trainer",
    help="Reference trainer for diffusion / flow-matching RL finetuning (tiny CPU models)."
    + GLOBAL_HELP.format(program="reference-trainer"),
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (docs/cli.md "CLI conventions")
    pretty_exceptions_enable=False,
)

add_global_options(app, "reference-trainer")

EXAMPLES = {
    "train": [
        "reference-trainer train examples/grpo/full/sd3_tiny/default.yaml --output-dir runs/grpo",
        "reference-trainer train examples/grpo/full/sd3_tiny/default.yaml --output-dir runs/grpo --resume latest",
        "reference-trainer train CONFIG --set train.kl_beta=0.01 --set optimizers.0.lr=1e-3",
    ],
    "diff": ["reference-trainer diff runs/a runs/b"],
}


def _known_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(usage/config errors -> exit 2, training failures -> exit 1); imported when an error is mapped."""
    from reference_trainer.checkpoint import CheckpointError
    from reference_trainer.contracts import ContractError
    from reference_trainer.errors import ConfigError
    from reference_trainer.jsonl import LogError
    from reference_trainer.optim import NonFiniteLossError
    from reference_trainer.registry import RegistryError
    from reference_trainer.rewards import RewardError
    from reference_trainer.roles import RoleError

    return (ConfigError, ContractError, RegistryError, CheckpointError, RoleError, LogError), (
        NonFiniteLossError,
        RewardError,
    )


def _quiet_loading() -> None:
    """Silence transformers' / diffusers' per-component "Loading weights" tqdm bars: the run has its own
    progress bar, and the fixtures load in milliseconds."""
    import diffusers.utils.logging
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()


@app.command()
def train(
    config: Annotated[
        Path, typer.Argument(help="YAML config (examples/{algorithm}/{finetune_type}/{model}/{variant}.yaml)")
    ],
    output_dir: Annotated[
        Path | None, typer.Option("--output-dir", help="Run directory (default: runs/<config stem>)")
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", help="Total optimizer steps (overrides max_steps)")
    ] = None,
    resume: Annotated[
        str | None, typer.Option("--resume", help="Checkpoint directory, or 'latest' in --output-dir")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="dotted.key=value override (repeatable)")
    ] = None,
    inputs_from: Annotated[
        Path | None,
        typer.Option(
            "--inputs-from",
            help="A target's ffdebug store (DIR/<side>): take its random draws (prompts, noise, sample order, "
            "record ids, sampled timesteps); the σ schedule is recomputed and gated (docs/trainer-taps.md "
            '"Inputs"); DIR/inputs_from.json says what was taken and what recomputed',
        ),
    ] = None,
    inputs_map: Annotated[
        list[str] | None,
        typer.Option("--inputs-map", help="OLD=NEW rename of the --inputs-from store's stages (repeatable)"),
    ] = None,
    inputs_map_file: Annotated[
        Path | None,
        typer.Option(
            "--inputs-map-file", help="The renames as a file (ffdebug compare --alias-file's format)"
        ),
    ] = None,
) -> None:
    """Train from CONFIG; writes run.json, metrics.jsonl and checkpoints/step-NNNNNN/ in the output dir.

    Several processes (gloo on CPU): torchrun --nproc-per-node 2 -m reference_trainer train CONFIG
    --set backend.kind=fsdp2 (or ddp; or deepspeed with --set backend.zero_stage=2, after
    DS_BUILD_OPS=0 pip install 'ffdebug\\[deepspeed]').

    Teacher forcing against your own trainer (docs/trainer-taps.md "Compare your own trainer"):
    FFDEBUG_FWD_DUMP_DIR=D FFDEBUG_FWD_DUMP_SIDE=ref reference-trainer train CONFIG --inputs-from D/target
    """
    output_dir = output_dir or Path("runs") / config.stem
    _quiet_loading()
    from reference_trainer.config import load_config
    from reference_trainer.distributed import shutdown
    from reference_trainer.run import train as run_train

    run_config = load_config(config, overrides=tuple(set_ or ()), max_steps=max_steps)
    run_train(
        run_config,
        output_dir,
        resume=resume,
        inputs_from=inputs_from,
        inputs_map=tuple(inputs_map or ()),
        inputs_map_file=inputs_map_file,
    )
    shutdown()


@app.command("list")
def list_(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False) -> None:
    """Registered trainers (with execution contract and roles), adapters and rewards."""
    from reference_trainer.registry import describe_registries
    from reference_trainer.rewards import registered_rewards

    info = describe_registries()
    info["rewards"] = registered_rewards()
    if as_json:
        print(json.dumps(info, indent=2))
        return
    from rich.table import Column, Table

    # every column folds: wrapped at 80 columns, never cut (docs/cli.md "CLI conventions")
    table = Table(*(Column(h, overflow="fold") for h in ("trainer", "contract", "roles", "arguments")))
    for trainer in info["trainers"]:
        table.add_row(trainer["name"], trainer["contract"], ", ".join(trainer["roles"]), trainer["arguments"])
    console = Console()
    console.print(table)
    console.print("adapters: " + ", ".join(info["adapters"]))
    console.print("rewards: " + ", ".join(f"{name} ({kind})" for name, kind in info["rewards"].items()))


def _read_metrics(run: Path) -> list[dict[str, Any]]:
    from reference_trainer.errors import ConfigError
    from reference_trainer.jsonl import read_jsonl

    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError("", f"{path} not found; give a run directory (it holds metrics.jsonl)")
    return list(read_jsonl(path).records)


def first_difference(
    a: list[dict[str, Any]], b: list[dict[str, Any]], keys: Collection[str] | None = None
) -> dict[str, Any] | None:
    """The first optimizer step whose records differ (exact float equality), or None.

    ``keys``: compare only these metric keys (``diff`` passes the keys both runs log); None compares
    every key either record has, a key missing on one side being a difference."""
    for record_a, record_b in zip(a, b):
        wanted = sorted(set(record_a) | set(record_b)) if keys is None else sorted(keys)
        differing = [key for key in wanted if record_a.get(key) != record_b.get(key)]
        if differing:
            step = record_a.get("optimizer_step", record_b.get("optimizer_step"))
            values = {key: [record_a.get(key), record_b.get(key)] for key in differing}
            return {"optimizer_step": step, "keys": differing, "values": values}
    if len(a) != len(b):
        shorter = min(len(a), len(b))
        return {
            "optimizer_step": shorter + 1,
            "keys": ["<missing record>"],
            "values": {"records": [len(a), len(b)]},
        }
    return None


COUNTER_KEYS = frozenset({"optimizer_step", "rollout_iteration", "data_epoch"})
"""Progress counters every record carries: not metrics by themselves."""


def metric_keys(records: list[dict[str, Any]]) -> set[str]:
    """Every metric key any record of a run logs."""
    return {key for record in records for key in record}


@app.command()
def diff(
    run_a: Annotated[Path, typer.Argument(help="First run directory")],
    run_b: Annotated[Path, typer.Argument(help="Second run directory")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """The first optimizer step whose metrics differ between two runs (exit 1 when one does).

    The metric keys both runs log are compared; the keys only one run logs (another trainer, another
    reward) are listed, never compared. Example: reference-trainer diff runs/a runs/b --json
    """
    from reference_trainer.errors import ConfigError

    a, b = _read_metrics(run_a), _read_metrics(run_b)
    keys_a, keys_b = metric_keys(a), metric_keys(b)
    shared = keys_a & keys_b
    if not shared - COUNTER_KEYS:
        raise ConfigError("", f"{run_a} and {run_b} log no metric key in common; nothing to compare")
    only_a, only_b = sorted(keys_a - keys_b), sorted(keys_b - keys_a)
    difference = first_difference(a, b, shared)
    if as_json:
        print(
            json.dumps(
                {
                    "identical": difference is None,
                    "first_difference": difference,
                    "compared_keys": sorted(shared),
                    "only_in_a": only_a,
                    "only_in_b": only_b,
                }
            )
        )
        raise typer.Exit(0 if difference is None else 1)
    if difference is None:
        print(f"PASSED | the {len(shared)} metric keys both runs log are identical at every optimizer step")
    else:
        shown = ", ".join(f"{key}: {a!r} vs {b!r}" for key, (a, b) in list(difference["values"].items())[:4])
        print(f"FAILED | first difference at optimizer_step {difference['optimizer_step']}: {shown}")
    for run, only in ((run_a, only_a), (run_b, only_b)):
        if only:
            print(f"not compared: only {run} logs {', '.join(only)}")
    raise typer.Exit(0 if difference is None else 1)


def main(args: list[str] | None = None) -> int:
    """Entry point of the ``reference-trainer`` console script; ``args`` default to ``sys.argv[1:]``.

    Returns the exit code instead of exiting when ``args`` are given (in-process use).
    """
    if args is None:
        app(prog_name="reference-trainer")
        return 0
    try:
        app(args, prog_name="reference-trainer")  # standalone: every outcome is a SystemExit
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    return 0


if __name__ == "__main__":
    main()
