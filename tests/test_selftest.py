"""`ffdebug selftest`: the shrinker, spec resolution, the expected-result rule, and whole runs on
tiny architectures through the CLI (docs/selftest.md)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.selftest.cases import HOLDS, NO_EFFECT, SelftestOptions, _matches
from ffdebug.selftest.models import SelftestError, build, resolve
from ffdebug.selftest.mutations import Expected, Mutation
from ffdebug.selftest.shrink import Sizes, compress_types, shrink
from ffdebug.verdict import PatternName

runner = CliRunner()


def test_layer_types_keep_every_kind_in_order():
    gemma = ["sliding_attention"] * 5 + ["full_attention"]
    assert compress_types(gemma * 4, 4) == ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
    assert compress_types(["full_attention"] * 32, 4) == ["full_attention"] * 4
    assert compress_types(["a", "b"], 5) == ["a", "b", "a", "b", "a"]  # a short pattern repeats


def test_shrink_keeps_the_relations_between_sizes_and_leaves_the_original():
    from transformers import AutoConfig

    original = AutoConfig.for_model("deepseek_v3")
    shrunk = shrink(original).config
    assert original.num_hidden_layers == 61 and original.n_routed_experts == 256  # untouched
    assert (shrunk.hidden_size, shrunk.num_hidden_layers, shrunk.n_routed_experts) == (64, 4, 8)
    assert shrunk.num_key_value_heads == shrunk.num_attention_heads == 4  # MHA stays MHA
    assert shrunk.head_dim == shrunk.qk_rope_head_dim  # MLA: head_dim sizes the rotary part
    assert shrunk.qk_head_dim == shrunk.qk_nope_head_dim + shrunk.qk_rope_head_dim
    assert shrunk.num_experts_per_tok <= shrunk.n_routed_experts // shrunk.n_group * shrunk.topk_group
    assert shrunk.first_k_dense_replace == 1
    gqa = shrink(AutoConfig.for_model("llama", num_attention_heads=32, num_key_value_heads=8)).config
    assert (gqa.num_attention_heads, gqa.num_key_value_heads) == (4, 2)  # a grouping keeps a group
    sliding = shrink(AutoConfig.for_model("gemma3_text")).config
    assert sliding.sliding_window < SelftestOptions().seq and "full_attention" in sliding.layer_types


def test_token_ids_are_clamped_into_the_shrunk_vocabulary():
    from transformers import AutoConfig

    shrunk = shrink(AutoConfig.for_model("gpt2"), Sizes(vocab=100)).config
    assert shrunk.vocab_size == 100 and shrunk.eos_token_id == shrunk.bos_token_id == 99


@pytest.mark.parametrize("spec", ["qwen2", "Qwen2ForCausalLM", "Qwen2Config"])
def test_a_spec_by_model_type_or_class_name(spec):
    resolved = resolve(spec)
    assert resolved.model_type == "qwen2" and resolved.model_class.__name__ == "Qwen2ForCausalLM"


def test_a_spec_by_config_file_or_checkpoint_folder(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("mistral").save_pretrained(tmp_path)
    assert resolve(str(tmp_path)).model_class.__name__ == "MistralForCausalLM"
    assert resolve(str(tmp_path / "config.json")).model_type == "mistral"


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("no_such_architecture", "not a config file, a transformers class name, a model_type"),
        ("someone/not-downloaded-model", "not in the local Hugging Face cache (selftest never downloads"),
        ("Wav2Vec2Config", "maps to no causal LM, encoder-decoder LM or image classification class"),
    ],
)
def test_a_spec_that_names_no_model_is_one_line_exit_2(spec, needle):
    with pytest.raises(SelftestError, match="^" + spec):
        resolve(spec)
    r = runner.invoke(app, ["selftest", spec])
    assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "give at least one SPEC"),
        (["qwen2", "--zoo"], "give SPECs or --zoo, not both"),
        (["qwen2", "--sample", "3"], "--sample draws from the zoo"),
        (["qwen2", "--cases", "copy,typo"], "--cases: typo unknown"),
    ],
)
def test_bad_usage_is_exit_2(args, needle):
    r = runner.invoke(app, ["selftest", *args])
    assert r.exit_code == 2 and needle in r.stderr, r.stderr


def _said(**kw):
    return {"layer": 1, "stage": "attn_out", "sub_stage": "attn.q", "pattern": "jump", "head": None, **kw}


def test_the_expected_result_rule():
    q = Expected(1, "attn_out", "attn.q", PatternName.JUMP)
    assert _matches(q, _said(), failed=True)
    assert not _matches(q, _said(), failed=False)  # the right place on a passing result is not found
    assert not _matches(q, _said(layer=2), failed=True)
    assert not _matches(q, _said(sub_stage="attn.q_rot"), failed=True)  # a role, not a name prefix
    assert not _matches(q, _said(pattern="drift"), failed=True)
    # a q norm cancels the scale: attn_out is bit-equal and the first divergence is q itself
    assert _matches(q, _said(stage="attn.q.out"), failed=True)
    assert not _matches(q, _said(stage="attn.k.out", sub_stage="attn.k"), failed=True)
    moe = Expected(1, "ffn_out", "moe.", PatternName.JUMP)
    assert _matches(moe, _said(stage="ffn_out", sub_stage="moe.expert001"), failed=True)
    anywhere = Expected(0, None, None, None)
    assert _matches(anywhere, _said(layer=0, pattern="drift"), failed=True)
    assert not _matches(anywhere, _said(layer=0, pattern="match"), failed=True)
    head = Expected(1, "attn_out", "attn.context", PatternName.JUMP, head=1)
    assert _matches(head, _said(sub_stage="attn.context", head=1), failed=True)
    assert not _matches(head, _said(sub_stage="attn.context", head=2), failed=True)
    # a dual-stream attention: the text stream's projection surfaces at the block's text output
    joint = Expected(1, "attn_out", "attn.o", PatternName.JUMP, streams=("attn_out.1", "hidden_out.0"))
    assert _matches(joint, _said(stage="hidden_out.0", sub_stage="attn.o"), failed=True)
    assert not _matches(joint, _said(stage="ffn_out", sub_stage="attn.o"), failed=True)


def test_a_mutation_that_changes_no_bit_is_no_effect(tmp_path):
    from ffdebug.selftest.cases import Runner

    spec = resolve("llama")
    model = build(spec)
    run = Runner(spec, model, SelftestOptions(), tmp_path)
    nothing = Mutation("nothing", "no change", Expected(1, None, None, None), lambda m: None)
    case = run._mutation(nothing)
    assert case.status == NO_EFFECT and case.got == "bit-identical to the reference"


@pytest.mark.integration
def test_a_class_wide_moe_bug_the_budget_cannot_decide_is_decided_by_attribution():
    """AX-K2 (a dense layer 0, MoE layers 1-3, one attention class): top-k normalisation off in
    every MoE layer. By the budget layer 1 is the first to show any error after an exact layer 0,
    and layer 2 adds error beyond precision too, a third of layer 1's on an inexact input: one
    layer amplified or the same bug again? The first bisect says `jump` at layer 1, not decided;
    the deciding run re-runs each block on the reference's input, and the MoE layers err by
    themselves: `layer_class`. Two experts swapped in layer 1 only: that layer alone, `jump`."""
    from ffdebug.selftest.cases import run_model

    report = run_model("axk2", SelftestOptions(groups=("mutations",)))
    cases = {c.name: c for c in report.cases}
    topk, swapped = cases["top-k unnormalised"], cases["experts swapped"]
    assert topk.status == HOLDS and topk.attributed, topk
    assert (topk.layer, topk.pattern, topk.sub_stage) == (1, "layer_class", "moe.topk_weights")
    assert swapped.status == HOLDS and (swapped.layer, swapped.pattern) == (1, "jump"), swapped


@pytest.mark.integration
def test_gpt2_selftest_through_the_cli(tmp_path):
    """GPT-2: fused q / k / v (Conv1D, its columns scaled), a GELU MLP, no rotary, no MoE, no window.
    Exit 1 exactly when a case does not hold, and the JSON holds every case."""
    r = runner.invoke(
        app, ["selftest", "gpt2", "--cases", "copy,mutations", "--json", "--keep", str(tmp_path)]
    )
    doc = json.loads(r.stdout)
    (model,) = doc["models"]
    cases = {c["name"]: c for c in model["cases"]}
    assert model["model_class"] == "GPT2LMHeadModel" and model["layers"] == 4
    assert set(cases) == {"copy", "attn.q scaled", "attn.k scaled", "attn.v scaled", "attn.o scaled",
                          "head zeroed", "norm eps", "mlp.act swapped"}  # fmt: skip
    assert "transformer.h.1.attn.c_attn" in cases["attn.k scaled"]["where"]
    for name in ("copy", "attn.q scaled", "attn.k scaled", "attn.v scaled", "mlp.act swapped", "norm eps"):
        assert cases[name]["status"] == HOLDS, cases[name]
    assert cases["attn.k scaled"]["layer"] == 1 and cases["attn.k scaled"]["sub_stage"] == "attn.k"
    assert r.exit_code == (0 if all(c["status"] != "fails" for c in cases.values()) else 1)
    assert (tmp_path / "gpt2" / "ref" / "rank000" / "manifest.jsonl").is_file()  # --keep kept the dumps


def test_a_config_that_refuses_a_global_field_reads_as_unknown():
    """transformers' per-layer configs raise their own error for a global `head_dim` (found by the
    sweep on gemma4_unified_text, whose reference dump raised): the field is unknown, not fatal."""
    from ffdebug.models.config_fields import config_field
    from ffdebug.models.subroles import Dims

    class PerLayer:
        num_attention_heads = 4
        hidden_size = 64

        @property
        def head_dim(self):
            raise RuntimeError("'head_dim' is a per-layer attribute and may vary across layers")

    assert config_field(PerLayer(), "head_dim") is None and config_field({"a": 1}, "a") == 1
    assert Dims.of_config(PerLayer()).head_dim == 16  # from hidden / heads, as when absent
