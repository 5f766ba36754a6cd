"""Float64 metrics and severity bands against hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from ffdebug.comparison.logits import logits_metrics
from ffdebug.comparison.metrics import CHUNK, compare_tensors
from ffdebug.errors import FFDebugError
from ffdebug.verdict import Severity, classify, parse_threshold, zero_side


def test_hand_derived_values():
    """r = (1, 0), t = (1, 1): dot 1, |r| 1, |t| sqrt2 -> cos 1/sqrt2; |t-r| 1 -> rel 1;
    rel_diff = 1 - 2*1/(1+2) = 1/3; max_abs 1 at index 1; mean_abs 1/2; norm_ratio sqrt2."""
    m = compare_tensors(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert m.cos == pytest.approx(1 / math.sqrt(2), abs=1e-15)
    assert m.rel == pytest.approx(1.0, abs=1e-15)
    assert m.rel_diff == pytest.approx(1 / 3, abs=1e-15)
    assert m.max_abs == 1.0 and m.max_abs_at == [1]
    assert m.mean_abs == pytest.approx(0.5)
    assert m.norm_ratio == pytest.approx(math.sqrt(2))
    assert m.bit_equal == 0.5


def test_multi_chunk_matches_direct_float64_and_coordinate():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(3, CHUNK + 123, generator=g)
    t = r + 1e-3 * torch.randn(r.shape, generator=g)
    t[2, CHUNK + 5] += 0.5
    m = compare_tensors(r, t)
    r64, t64 = r.double().flatten(), t.double().flatten()
    assert m.cos == pytest.approx(float(r64 @ t64 / (r64.norm() * t64.norm())), abs=1e-12)
    assert m.rel == pytest.approx(float((t64 - r64).norm() / r64.norm()), rel=1e-10)
    assert m.max_abs_at == [2, CHUNK + 5]


def test_max_abs_position_is_the_first_of_ties_after_a_rising_maximum():
    """The running maximum rises in chunks 0, 2 and 3 (errors 0.25, 0.5, 1.0); chunk 5 ties 1.0
    again and chunk 4 holds a NaN next to an error of 2.0 — the largest finite one. Without the
    NaN chunk the answer is the first 1.0, at 3·CHUNK + 7, not the tie at 5·CHUNK + 1."""
    r = torch.zeros(6 * CHUNK)
    t = r.clone()
    for at, err in ((11, 0.25), (2 * CHUNK + 3, 0.5), (3 * CHUNK + 7, 1.0), (5 * CHUNK + 1, 1.0)):
        t[at] = err
    m = compare_tensors(r, t)
    assert (m.max_abs, m.max_abs_at) == (1.0, [3 * CHUNK + 7])
    t[4 * CHUNK + 2], t[4 * CHUNK + 9] = float("nan"), 2.0
    m = compare_tensors(r, t)
    assert (m.max_abs, m.max_abs_at, m.nan_mismatch) == (2.0, [4 * CHUNK + 9], 1)


def _direct_elem_and_position(r, t) -> tuple[float, int]:
    """elem = maxᵢ |tᵢ − rᵢ| / max(|rᵢ|, rms(r)) and the first index of max |t − r|, over the
    whole flat tensors at once in float64 (no chunks, no pieces)."""
    r64, t64 = r.double().flatten(), t.double().flatten()
    d = (t64 - r64).abs()
    rms = float(r64.norm()) / math.sqrt(r64.numel())
    elem = float((d / torch.clamp(r64.abs(), min=rms)).max())
    return elem, int(torch.nonzero(d == d.max())[0])


@pytest.mark.parametrize("kind", ["noise", "relative", "late_spike", "big_r_spike", "ties"])
def test_elem_and_position_match_the_whole_tensor_direct_values(kind):
    """The error pass keeps one max |t − r| per piece of the chunk and revisits only the pieces
    that can hold the maximum; on additive noise (a piece or two), relative error (every chunk
    revisited whole), a spike late in a chunk, a spike where |r| is large (the largest |t − r| is
    not where elem is) and exact ties across pieces, elem is the direct value (to the rounding of
    rms, whose sum of squares is added in another order) and the position is the first maximum."""
    g = torch.Generator().manual_seed(7)
    n = 3 * CHUNK + 5000  # a partial last chunk whose last piece is partial too
    r = torch.randn(n, generator=g)
    if kind == "relative":
        t = r * (1 + 2.0**-9 * torch.randn(n, generator=g))
    else:
        t = r + 1e-4 * torch.randn(n, generator=g)
    if kind == "late_spike":
        t[2 * CHUNK + CHUNK - 3] += 0.01
    if kind == "big_r_spike":
        r[CHUNK + 70_000] = 40.0
        t[CHUNK + 70_000] = 40.5  # max |t − r| here, but elem 0.5 / 40 is small ...
        t[3 * CHUNK + 4999] = r[3 * CHUNK + 4999] + 0.05  # ... elem is set here (|r| < 1 likely)
    if kind == "ties":
        t = r.clone()
        for at in (CHUNK + 9000, CHUNK + 20, 2 * CHUNK + 1):
            t[at] = r[at] + 0.5
    m = compare_tensors(r, t)
    elem, at = _direct_elem_and_position(r, t)
    assert m.elem == pytest.approx(elem, rel=1e-13, abs=0)
    assert m.max_abs_at == [at]


def test_difference_past_float64_range_with_finite_norms():
    """r = (−1.3e154, 1), t = (1.3e154, 1): r², t² and r·t fit in float64 but (t − r)² =
    6.76e308 does not, so the sums are redone on scaled values: max |t − r| = 2.6e154 at 0,
    rel = 2.6e154 / 1.3e154 = 2 (to the rounding of the norms), cos = (1 − 1.69e308) / 1.69e308."""
    r = torch.tensor([-1.3e154, 1.0], dtype=torch.float64)
    t = torch.tensor([1.3e154, 1.0], dtype=torch.float64)
    m = compare_tensors(r, t)
    assert (m.max_abs, m.max_abs_at) == (2.6e154, [0])
    assert m.rel == pytest.approx(2.0, rel=1e-15) and m.cos == pytest.approx(-1.0, abs=1e-15)
    assert m.nan_mismatch == m.inf_mismatch == 0 and m.bit_equal == 0.5


def test_worker_threads_give_the_same_metrics():
    """Each thread keeps its own work rows: two threads comparing different pairs at once get
    what one thread gets comparing them in turn."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(3)
    pairs = []
    for n in (5 * CHUNK + 17, 3 * CHUNK, 999):
        r = torch.randn(n, generator=g)
        pairs.append((r, r + 1e-3 * torch.randn(n, generator=g)))
    alone = [compare_tensors(r, t).to_json() for r, t in pairs]
    with ThreadPoolExecutor(max_workers=3) as pool:
        together = list(pool.map(lambda p: compare_tensors(*p).to_json(), pairs * 4))
    assert together == alone * 4


def test_fp32_cos_above_one_is_clamped():
    """A vector against itself: float32 arithmetic gives cos 1.0000001; float64 unclamped gives
    1 + 4e-15 on the scaled pair below. Ours is exactly <= 1 in both cases."""
    x = torch.tensor([1.5409960746765137, -0.293428897857666, -2.1787893772125244])
    assert float(torch.nn.functional.cosine_similarity(x, x.clone(), dim=0)) > 1.0  # the fp32 problem
    assert compare_tensors(x, x.clone()).cos == 1.0
    a = torch.full((4097,), 0.1, dtype=torch.float32) * torch.linspace(1, 3, 4097)
    b = a * 1.0000001
    a64, b64 = a.double(), b.double()
    assert float(a64 @ b64) / (math.sqrt(float(a64 @ a64)) * math.sqrt(float(b64 @ b64))) > 1.0
    assert compare_tensors(a, b).cos <= 1.0


def test_zero_tensors_explicit():
    z = torch.zeros(10)
    both = compare_tensors(z, z)
    assert (both.cos, both.rel) == (1.0, 0.0)
    ref_zero = compare_tensors(z, torch.ones(10))
    assert ref_zero.cos == 0.0 and ref_zero.rel is None and "reference is all zeros" in ref_zero.notes[0]
    tgt_zero = compare_tensors(torch.ones(10), z)
    assert tgt_zero.cos == 0.0 and tgt_zero.rel == 1.0
    # Bands alone: cos 0 is below every cos band (scramble), an undefined rel is a bug; the worse
    # wins. The zero-side rule then says what it is: one side missing, a bug, not a scramble.
    assert classify(ref_zero.cos, ref_zero.rel) == Severity.SCRAMBLE
    assert (
        zero_side(classify(ref_zero.cos, ref_zero.rel), 0.0, float(torch.ones(10).norm()), 10) == Severity.BUG
    )


def test_nan_inf_positions():
    r = torch.tensor([1.0, float("nan"), 3.0, float("inf"), 5.0])
    t = torch.tensor([1.0, float("nan"), float("nan"), float("inf"), 5.0])
    m = compare_tensors(r, t)
    assert m.nan_mismatch == 1 and m.nan_both == 1 and m.inf_mismatch == 0
    assert m.cos == pytest.approx(1.0)  # finite positions agree
    t2 = torch.tensor([1.0, float("nan"), 3.0, float("-inf"), 5.0])
    assert compare_tensors(r, t2).inf_mismatch == 1


def test_shape_mismatch_not_broadcast():
    m = compare_tensors(torch.ones(2, 3), torch.ones(3, 2))
    assert m.shape_mismatch and m.cos is None


def test_bit_equal_is_bitwise():
    r = torch.tensor([0.0, 1.0], dtype=torch.float32)
    t = torch.tensor([-0.0, 1.0], dtype=torch.float32)  # equal as values, different bits
    assert compare_tensors(r, t).bit_equal == 0.5
    bf = torch.randn(100, dtype=torch.bfloat16)
    assert compare_tensors(bf, bf.clone()).bit_equal == 1.0


def test_bit_equal_counts_every_chunk_whichever_way_its_head_goes():
    """Equal bits are counted before t is copied where a chunk's first positions agree, after it
    where they do not: a chunk equal but for its tail, one differing only in its head, a
    bit-identical one and a short last one all count exactly."""
    n = 3 * CHUNK + 100
    r = torch.randn(n, generator=torch.Generator().manual_seed(5))
    t = r.clone()
    t[CHUNK - 7 : CHUNK] += 1.0  # chunk 0: equal head, 7 differ at its end
    t[CHUNK : CHUNK + 10] += 1.0  # chunk 1: 10 differ at its head; chunk 2 bit-identical
    t[3 * CHUNK + 99] = -t[3 * CHUNK + 99]  # the short last chunk: 1 differs
    assert compare_tensors(r, t).bit_equal == (n - 18) / n


def test_bands_rel_wins():
    assert classify(0.99999, 0.001) == "ok"
    assert classify(0.9998, 0.57) == "bug"  # the DESIGN example: cos fine, rel large
    assert classify(0.995, 0.05) == "drift"
    assert classify(0.95, 0.2) == "diverge"
    assert classify(0.6, 0.9) == "bug"
    assert classify(0.3, 0.9) == "scramble"
    assert classify(-1.0, 2.0) == "scramble"
    assert classify(1.0, 3.0) == "bug"  # pure scale error


def test_threshold_override_first_match_wins():
    th = (parse_threshold("final.*:cos>=0.9,rel<=0.5"), parse_threshold("*:cos>=0.99999"))
    assert classify(0.95, 0.2, "final.logits", th) == "ok"
    assert classify(0.99995, 0.001, "L000.attn_out", th) == "drift"  # stricter override fails
    with pytest.raises(FFDebugError, match="--threshold"):
        parse_threshold("nocolon")


def test_logits_metrics():
    r = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    m = logits_metrics(r, r.clone(), topk=2)
    assert (
        m["argmax_agree"] == 1.0
        and m["top2_overlap"] == 1.0
        and m["kl_mean"] == pytest.approx(0.0, abs=1e-15)
    )
    t = torch.tensor([[2.0, 1.0, 0.0], [3.0, 0.0, 0.0]])
    m2 = logits_metrics(r, t, topk=2)
    assert m2["argmax_agree"] == 0.5
    # KL(p||q) for row 0: p = softmax(0,1,2), q = softmax(2,1,0) = reversed p
    p = torch.softmax(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), 0)
    kl0 = float((p * (p.log() - p.flip(0).log())).sum())
    assert m2["kl_mean"] == pytest.approx(kl0 / 2, rel=1e-12)


def test_float64_overflow_gives_finite_exact_metrics():
    """|values| ~1e300 overflow float64 sums of squares; scaled by a power of two the metrics stay
    exact: r = (1, -1)·1e300, t = (1, 1)·1e300 -> dot 0 -> cos 0; |t-r| = 2e300, |r| = sqrt2·1e300
    -> rel sqrt2; max_abs 2e300 at index 1; mean_abs 1e300."""
    r = torch.tensor([1e300, -1e300], dtype=torch.float64)
    t = torch.tensor([1e300, 1e300], dtype=torch.float64)
    m = compare_tensors(r, t)
    assert m.cos == 0.0 and m.rel == pytest.approx(math.sqrt(2), rel=1e-15)
    assert m.max_abs == 2e300 and m.max_abs_at == [1] and m.mean_abs == 1e300
    assert m.ref_norm == pytest.approx(math.sqrt(2) * 1e300, rel=1e-15)


def test_equal_integer_tensors_have_positive_zero_max_abs():
    m = compare_tensors(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]))
    assert m.max_abs == 0.0 and math.copysign(1.0, m.max_abs) == 1.0  # printed "0", not "-0"


def test_logits_kl_masked_and_infinite():
    """Entries both sides mask (-inf) add 0 to KL; a target that masks what the reference does not
    is infinitely far: null in JSON (never 1.8e308), counted in kl_inf_rows."""
    masked = torch.tensor([[float("-inf"), 1.0, 2.0], [0.0, 1.0, 2.0]])
    same = logits_metrics(masked, masked.clone())
    assert same["kl_mean"] == 0.0 and same["kl_max"] == 0.0 and same["kl_inf_rows"] == 0
    ref = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    far = logits_metrics(ref, masked)
    assert far["kl_mean"] is None and far["kl_max"] is None and far["kl_inf_rows"] == 1


def test_logits_blocks_are_bounded_and_do_not_change_the_answer(monkeypatch):
    """A large vocabulary is taken a few rows at a time (each float64 block within
    LOGITS_CHUNK_BYTES; a fixed 256 rows of a 152k vocabulary held about 2 GiB), and the result
    does not depend on the blocking: one row at a time, the default, all rows at once."""
    import ffdebug.comparison.logits as metrics

    g = torch.Generator().manual_seed(0)
    r = torch.randn(2, 30, 40_000, generator=g)
    t = r + 0.05 * torch.randn(r.shape, generator=g)
    t[1, 4] = t[1, 4].flip(0)  # one row far off: argmax and top-k disagree there
    seen = []
    real = metrics._log_softmax

    def spy(x):
        seen.append(x.nbytes)
        return real(x)

    monkeypatch.setattr(metrics, "_log_softmax", spy)
    default = logits_metrics(r, t)
    assert seen and max(seen) <= metrics.LOGITS_CHUNK_BYTES and len(seen) > 2
    for rows in (1, 60):
        other = logits_metrics(r, t, rows_per_chunk=rows)
        assert {k: v for k, v in other.items() if k != "kl_mean"} == {
            k: v for k, v in default.items() if k != "kl_mean"
        }
        assert other["kl_mean"] == pytest.approx(default["kl_mean"], rel=1e-12)
    assert default["argmax_agree"] < 1.0


def test_threshold_bounds_validated():
    with pytest.raises(FFDebugError, match=r"outside \[-1, 1\]"):
        parse_threshold("L*:cos>=2")
    with pytest.raises(FFDebugError, match=">= 0"):
        parse_threshold("L*:rel<=-0.1")


def test_float16_goes_through_float32_to_the_same_values():
    """float16 chunks are staged through a float32 row (torch's direct float16 -> float64 copy is
    slow); both conversions are exact, so every metric equals that of the float32 upcast."""
    g = torch.Generator().manual_seed(3)
    r = torch.randn(2 * CHUNK + 11, generator=g).half()
    t = (r.float() + 1e-2 * torch.randn(r.shape, generator=g)).half()
    t[5] = r[5]
    assert compare_tensors(r, t).to_json() == compare_tensors(r.float(), t.float()).to_json()


def test_top_k_ranks_nan_above_inf_as_torch_topk_does():
    # distinct values, so torch.topk's set is unique: NaN first, then +inf, then the largest
    x = torch.tensor([[1.0, math.inf, float("nan"), 3.0, -math.inf], [0.5, 2.0, 1.0, -1.0, 0.0]])
    for k in (1, 2, 3):
        t = torch.tensor([[0.1, 0.2, float("nan"), 0.3, 0.4], [0.0, 2.0, 1.0, -1.0, 0.5]])
        m = logits_metrics(x, t, topk=k)
        want = sum(
            len(set(a.topk(k).indices.tolist()) & set(b.topk(k).indices.tolist())) for a, b in zip(x, t)
        )
        assert m[f"top{k}_overlap"] == pytest.approx(want / (2 * k))


def test_logits_kl_is_infinite_for_a_nan_or_inf_row_on_either_side():
    r = torch.tensor([[0.0, 1.0, 2.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    for bad in (float("nan"), math.inf):
        ref = r.clone()
        ref[1, 0] = bad
        m = logits_metrics(ref, r, topk=1)
        assert m["kl_inf_rows"] == 1 and m["kl_max"] is None
        m = logits_metrics(r, ref, topk=1)
        assert m["kl_inf_rows"] == 1 and m["kl_max"] is None


def test_cos_and_rel_diff_of_a_close_pair_match_exactly_rounded_sums():
    # t = r + 1e-3 noise over 1 M elements: 1 − cos and rel_diff are ~5e-7, where a direct dot
    # summed near ‖r‖‖t‖ loses digits; expected values from math.fsum (exactly rounded sums of
    # float32 products, which float64 holds exactly)
    g = torch.Generator().manual_seed(0)
    r = torch.randn(1 << 20, generator=g)
    t = r + 1e-3 * torch.randn(1 << 20, generator=g)
    r64, t64 = r.double().tolist(), t.double().tolist()
    rr = math.fsum(a * a for a in r64)
    tt = math.fsum(b * b for b in t64)
    rt = math.fsum(a * b for a, b in zip(r64, t64))
    dd = math.fsum((b - a) ** 2 for a, b in zip(r64, t64))
    m = compare_tensors(r, t)
    assert m.cos == pytest.approx(rt / math.sqrt(rr * tt), abs=4 * 2.0**-52)
    assert m.rel_diff == pytest.approx(dd / (rr + tt), rel=1e-12)
