"""The fuzz suite's case counts and test time, printed in the terminal summary."""

from __future__ import annotations

from cases import cli_cases, store_cases


def pytest_terminal_summary(terminalreporter) -> None:
    seconds = 0.0
    ran = 0
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) == "call" and "tests/fuzz/" in getattr(rep, "nodeid", ""):
                seconds += rep.duration
                ran += 1
    if ran:
        terminalreporter.write_line(
            f"fuzz: {len(store_cases())} store mutations (x3 commands), {len(cli_cases())} CLI argument cases; "
            f"{ran} fuzz tests ran, {seconds:.1f} s of test time "
            "(FFDEBUG_FUZZ_CASES=N for more store mutations)"
        )
