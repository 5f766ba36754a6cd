"""The element-wise criterion, the `elem` / `max_abs` / `atol` threshold terms and size-1-dim
shape unification (docs/comparing.md "Comparing"), against hand-derived values and SGLang's comparator cases."""

from __future__ import annotations

import pytest
import torch

import ffdebug
from ffdebug.comparison.metrics import compare_tensors
from ffdebug.errors import FFDebugError
from ffdebug.verdict import ELEM_BUG, ELEM_DIVERGE, Severity, classify, parse_threshold


def _normal_10x10():
    return torch.randn(10, 10, generator=torch.Generator().manual_seed(0))


def _grade(r, t, *specs):
    m = compare_tensors(r, t)
    return m, classify(m.cos, m.rel, "x", tuple(parse_threshold(s) for s in specs), m.elem, m.max_abs)


def test_one_element_off_by_half_fires_where_the_norms_hide_it():
    r = _normal_10x10()
    rms = float(r.double().pow(2).mean().sqrt())
    i = int((r.abs() >= rms).flatten().nonzero()[0])  # an element at least as large as the rms
    t = r.clone()
    t.view(-1)[i] *= 1.5
    m, sev = _grade(r, t)
    assert m.elem == pytest.approx(0.5, rel=1e-6)  # |0.5 r_i| / max(|r_i|, rms) = 0.5
    assert m.rel < 0.1 and m.cos > 0.99  # the bands alone would say drift at most
    assert sev is Severity.DIVERGE and ELEM_DIVERGE <= m.elem < ELEM_BUG


def test_element_wise_is_silent_on_a_bf16_round_trip():
    r = _normal_10x10()
    m, sev = _grade(r, r.bfloat16().float())
    assert 0 < m.elem <= 2.0**-8  # bf16 rounds each value to within half an ulp: 2^-8 relative
    assert sev is Severity.OK


def test_element_wise_on_near_zero_elements_uses_the_tensor_scale():
    """An element near zero measured against rms(r), not itself: a tiny absolute error there is
    small, a sign flip of a large element is elem 2 (bug)."""
    r = torch.tensor([1.0, -1.0, 1.0, 1e-6])
    t = r.clone()
    t[3] = -1e-6
    assert compare_tensors(r, t).elem == pytest.approx(2e-6 / float(r.double().pow(2).mean().sqrt()))
    t = r.clone()
    t[0] = -1.0
    m, sev = _grade(r, t)
    assert m.elem == pytest.approx(2.0) and sev.at_least(Severity.BUG)


def test_sglang_cases_and_threshold_terms():
    ones = torch.ones(10, 10)
    offset = ones.clone()
    offset[3, 7] = 1.5
    assert _grade(ones, offset)[1] is Severity.DIVERGE  # SGLang and ATOM fail it; so do we
    flip = torch.tensor([1e-5, -1e-5, 1e-5, -1e-5])
    assert _grade(flip, -flip)[1].at_least(Severity.BUG)
    assert _grade(flip, -flip, "x:rel<=0.0085,atol=1e-4")[1] is Severity.OK  # within atol: accepted
    assert _grade(flip, -flip, "x:rel<=0.0085,atol=1e-6")[1].at_least(Severity.BUG)
    pair = torch.tensor([1.0, 1.0])
    assert _grade(pair, pair * 1.5)[1].at_least(Severity.DIVERGE)
    assert _grade(pair, pair * 1.5, "x:max_abs<=0.5")[1] is Severity.OK
    assert _grade(pair, pair * 1.5, "x:max_abs<=0.4")[1].at_least(Severity.DRIFT)
    assert _grade(ones, offset, "x:elem<=0.6")[1] is Severity.OK
    assert _grade(ones, offset, "x:elem<=0.4")[1].at_least(Severity.DRIFT)
    # a threshold without element terms keeps the element-wise rule
    assert _grade(ones, offset, "x:rel<=0.5")[1] is Severity.DIVERGE
    small = ones + 1e-4
    assert _grade(ones, small)[1] is Severity.OK


@pytest.mark.parametrize(
    "spec, words",
    [("x:elem<=-1", "elem bound -1 must be >= 0"), ("x:atol<0.1", "cannot read 'atol<0.1'")],
)
def test_bad_threshold_terms_are_one_line_errors(spec, words):
    with pytest.raises(FFDebugError, match=words):
        parse_threshold(spec)


def _taps(directory, side, **tensors):
    with ffdebug.capture(None, dir=directory, side=side):
        for name, x in tensors.items():
            ffdebug.tap(name, x)
    return directory / side


def test_size_one_dims_are_unified_not_broadcast_and_listed_in_coverage(tmp_path):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    y = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    ref = _taps(tmp_path, "ref", a=x.reshape(1, 1, 4, 8), b=y)
    tgt = _taps(tmp_path, "target", a=x, b=y.t().contiguous())
    res = ffdebug.compare(ref, tgt)
    a, b = (next(s for s in res.stages if s.key == k) for k in ("a", "b"))
    assert a.severity is Severity.OK and a.rel == 0.0 and a.bit_equal == 1.0
    assert (a.ref.shape, a.target.shape) == ([1, 1, 4, 8], [4, 8])  # originals kept
    assert b.severity is Severity.BUG and b.finding == "shape_mismatch"  # [3, 4] vs [4, 3]: not unified
    assert res.coverage.to_json()["unified_shapes"] == [
        {"key": "a", "shape_ref": [1, 1, 4, 8], "shape_target": [4, 8]}
    ]
    assert (
        "shapes unified (size-1 dims, or a token's features grouped otherwise): a (ref [1, 1, 4, 8] vs target [4, 8])"
        in res.coverage.selected_out
    )


def test_bf16_dumps_of_a_tiny_hf_model_do_not_trip_the_element_wise_rule(tmp_path):
    from helpers.tiny_models import tiny_llama

    model = tiny_llama(num_layers=2)
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    for side, m in (("ref", model), ("target", tiny_llama(num_layers=2).to(torch.bfloat16))):
        with ffdebug.capture(m, dir=tmp_path, side=side), torch.no_grad():
            m(input_ids=ids)
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    elems = [s.elem for s in res.stages if s.elem is not None and s.key != "embed.input_ids"]
    assert elems and max(elems) < ELEM_DIVERGE, max(elems)
    assert res.verdict.rank < Severity.DIVERGE.rank


def test_elem_over_many_chunks_equals_the_direct_float64_maximum():
    """The second pass visits chunks largest error first and stops early: the result must still be
    the exact maximum, here held by a small-|r| element far from the largest |t − r|."""
    from ffdebug.comparison.metrics import CHUNK

    g = torch.Generator().manual_seed(1)
    r = torch.randn(3 * CHUNK + 5, generator=g)
    t = r + 1e-3 * torch.randn(r.shape, generator=g)
    big = int(r.abs().argmax())
    t[big] = r[big] * 1.01  # the largest |t − r|, but only 1% of its |r|
    small = 2 * CHUNK + 7
    r[small], t[small] = 0.5, 0.9  # |d| 0.4 against max(0.5, rms ~ 1): the maximum
    rms = float(r.double().pow(2).mean().sqrt())
    direct = float(((t.double() - r.double()).abs() / r.double().abs().clamp(min=rms)).max())
    assert compare_tensors(r, t).elem == pytest.approx(direct, rel=1e-12)
    assert direct == pytest.approx(0.4 / max(0.5, rms), rel=1e-6)
