"""Test-wide settings: offline hub, one thread (bits depend on the thread count), clean env state."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_ffdebug_state(monkeypatch):
    """No FFDEBUG_*/ATOM_* variable leaks into a test; the env session is re-read per test."""
    for k in list(os.environ):
        if k.startswith(("FFDEBUG_", "ATOM_")):
            monkeypatch.delenv(k, raising=False)
    import torch

    torch.set_num_threads(1)
    from ffdebug import logs
    from ffdebug.capture import state

    state.reset()
    logs.reset()  # library logging: a CLI test's -q / -v does not reach the next test
    yield
    state.reset()
    logs.reset()


@pytest.fixture(scope="session", autouse=True)
def _cli_trees_built_once():
    """typer builds an app's click command tree anew on every call and every ``CliRunner.invoke``
    (about 12 ms for ffdebug's on an idle core; the unit tier invokes the CLIs hundreds of times):
    here each app's tree is built once per session. Commands are registered when their module is
    imported, so a tree does not change afterwards (the key still counts the registered commands)."""
    import typer.main
    import typer.testing

    build = typer.main.get_command
    built: dict[tuple, tuple] = {}

    def get_command(app):
        key = (id(app), len(app.registered_commands), len(app.registered_groups))
        if key not in built:
            built[key] = (app, build(app))  # the app is held so that its id is not reused
        return built[key][1]

    patch = pytest.MonkeyPatch()
    patch.setattr(typer.main, "get_command", get_command)
    patch.setattr(typer.testing, "_get_command", get_command)
    yield
    patch.undo()


@pytest.fixture
def tiny_llama():
    """A tiny LlamaForCausalLM from config (no download), eval mode, seeded weights."""
    from helpers.tiny_models import tiny_llama as build

    return build(num_layers=4)


@pytest.fixture
def input_ids():
    import torch

    return torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(7))


def pytest_terminal_summary(terminalreporter) -> None:
    """The fuzz suite's case counts and test time (tests/fuzz; here, not in tests/fuzz/conftest.py,
    so that the xdist controller, which collects nothing, prints it too)."""
    counts = {"test_store_mutation[": 0, "test_cli_arguments[": 0}
    seconds = 0.0
    for reports in terminalreporter.stats.values():
        for rep in reports:
            nodeid = getattr(rep, "nodeid", "")
            if getattr(rep, "when", None) == "call" and "tests/fuzz/" in nodeid:
                seconds += rep.duration
                for prefix in counts:
                    counts[prefix] += prefix in nodeid
    if any(counts.values()):
        terminalreporter.write_line(
            f"fuzz: {counts['test_store_mutation[']} store mutations (2-3 commands each), "
            f"{counts['test_cli_arguments[']} CLI argument cases, {seconds:.1f} s of test time "
            "(FFDEBUG_FUZZ_CASES=N: more store mutations)"
        )
