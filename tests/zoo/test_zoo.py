"""The zoo sweep (docs/selftest.md, "The sweep"): `ffdebug selftest` over the architectures the
installed transformers and diffusers ship, listed by introspection (causal LMs, encoder-decoder LMs,
image classifiers, diffusers denoisers).

CI runs a seeded sample (`FFDEBUG_TEST_ZOO_SAMPLE` causal LMs, default 6, and
`FFDEBUG_TEST_ZOO_SAMPLE_OTHER` of each other family, default 1, all of `FFDEBUG_TEST_ZOO_SEED`,
default 0); `FFDEBUG_TEST_ZOO=all` runs every architecture of every family (about an hour on two
cores; its tables are docs/bisect.md, "The zoo"). What is asserted: (a) a bit-identical copy passes on every architecture
that builds (a copy that fails is a pairing or coverage defect of ffdebug), every built model gets
its mutations planted, and every case ends in a known status. The precision and mutation rates are
measured, not asserted: docs/bisect.md records them.
"""

from __future__ import annotations

import os

import pytest

from ffdebug.selftest.cases import FAILS, HOLDS, NO_EFFECT, SKIPPED
from ffdebug.selftest.families import CAUSAL_LM, FAMILIES
from ffdebug.selftest.run import selftest
from ffdebug.selftest.zoo import architectures, sample

pytestmark = pytest.mark.integration

EVERY = os.environ.get("FFDEBUG_TEST_ZOO") == "all"
SEED = int(os.environ.get("FFDEBUG_TEST_ZOO_SEED", "0"))
COUNTS = {
    family: int(
        os.environ.get(
            "FFDEBUG_TEST_ZOO_SAMPLE" + ("" if family == CAUSAL_LM else "_OTHER"),
            "6" if family == CAUSAL_LM else "1",
        )
    )
    for family in FAMILIES
}
NAMES = [
    name
    for family in FAMILIES
    for name in (architectures(family) if EVERY else sample(COUNTS[family], SEED, family))
]


@pytest.mark.parametrize("name", NAMES)
def test_the_architecture_is_understood_as_far_as_the_copy(name):
    (report,) = selftest([name], zoo=True).reports
    if not report.built:
        pytest.skip(f"not built: {report.error}")
    cases = {c.name: c for c in report.cases}
    assert cases["copy"].status == HOLDS, cases["copy"].got
    assert {c.status for c in report.cases} <= {HOLDS, FAILS, NO_EFFECT, SKIPPED}
    assert any(c.group == "mutations" for c in report.cases), f"{name}: no mutation could be planted"


@pytest.mark.parametrize("name", NAMES)
def test_the_engine_rewrite_of_the_architecture_passes_as_a_copy(name):
    """(a) on the engine-style rewrite (`selftest --engine`: projections fused, every module
    renamed, a causal LM's batch packed where its logits allow it), in every family: a correct
    port passes with its coverage complete, and the report says what the rewrite did."""
    from ffdebug.selftest.cases import SelftestOptions

    (report,) = selftest([name], SelftestOptions(groups=("copy",), engine=True), zoo=True).reports
    if not report.built:
        pytest.skip(f"not built: {report.error}")
    (copy,) = report.cases
    assert copy.status == HOLDS, (copy.got, report.engine)
    assert report.engine.startswith("engine rewrite: ") and "renamed" in report.engine
