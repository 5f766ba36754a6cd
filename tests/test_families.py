"""Model families beyond decoder LLMs: one injected bug per family, found at its layer and stage.

Every model is built from a tiny config (random init, no download); the bug is injected by
patching one submodule's forward in the test, on the target side only. The expected layer
numbers are hand-derived from each model's execution order (docs/dumping.md "Stage names by role").
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import block_stack

import ffdebug


def _dump(model, directory, side, calls):
    """Run `calls` (kwargs of each root call) under one capture of `side`."""
    with ffdebug.capture(model, dir=str(directory), side=side), torch.no_grad():
        for kwargs in calls:
            model(**kwargs)
    return directory / side


def _scaled(module, factor=1.5):
    """`module`'s forward with its first output scaled: the injected bug."""
    forward = module.forward

    def buggy(*args, **kwargs):
        out = forward(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] * factor, *out[1:])
        return out * factor

    return buggy


def _located(model, bug_path, calls, tmp_path, monkeypatch):
    """Compare a clean dump with one whose `bug_path` module is scaled; the first divergence."""
    ref = _dump(model, tmp_path, "ref", calls)
    bugged = model.get_submodule(bug_path)
    monkeypatch.setattr(bugged, "forward", _scaled(bugged))
    tgt = _dump(model, tmp_path, "target", calls)
    result = ffdebug.compare(ref, tgt)
    assert not result, "an injected bug must fail the compare"
    first = result.first_divergence
    return result, (first.layer, first.stage)


def _keys(result) -> set[str]:
    return {s.key for s in result.stages}


@pytest.fixture(scope="module")
def sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64, out_channels=4,
        pos_embed_max_size=16,
    ).eval()  # fmt: skip
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
        pooled_projections=torch.randn(1, 64, generator=g),
        timestep=torch.tensor([500.0]),
    )
    return model, inputs


def test_sd3_feed_forward_bug_is_found_in_the_last_block(sd3, tmp_path, monkeypatch):
    model, inputs = sd3
    result, where = _located(model, "transformer_blocks.1.ff", [inputs], tmp_path, monkeypatch)
    assert where == (1, "ffn_out")
    assert {"embed.timestep", "embed.latents", "L000.hidden_out"} <= _keys(result)
    labels = {s.layer: s.layer_class for s in result.stages if s.layer is not None}
    assert labels[0] != labels[1]  # the last block differs in a child's class: its label says so


def test_flux_single_stream_attention_bug(tmp_path, monkeypatch):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
        axes_dims_rope=(4, 4, 8),
    ).eval()  # fmt: skip
    g = torch.Generator().manual_seed(2)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(7, 3),
    )
    # double-stream block L000, then the single-stream block L001
    _, where = _located(model, "single_transformer_blocks.0.attn", [inputs], tmp_path, monkeypatch)
    assert where == (1, "attn_out")


@pytest.fixture(scope="module")
def unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
    ).eval()  # fmt: skip
    g = torch.Generator().manual_seed(3)
    sample, context = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 5, 32, generator=g)
    return model, dict(sample=sample, timestep=torch.tensor([10]), encoder_hidden_states=context)


def test_unet_mid_block_bug_is_layer_2_in_execution_order(unet, tmp_path, monkeypatch):
    """Registered down, up, mid; run down (L000, L001), mid (L002), up (L003, L004)."""
    model, call = unet
    result, where = _located(model, "mid_block.resnets.1", [call], tmp_path, monkeypatch)
    assert where == (2, "resnets.1.out")
    paths = {s.layer: s.stage for s in result.stages if s.stage == "hidden_out"}
    assert sorted(paths) == [0, 1, 2, 3, 4]
    assert not any(s.layer is not None and s.layer < 2 and not s.ok for s in result.stages)
    by_key = {r.key: r for r, _ in result.records}
    assert by_key["final.norm_out"].module_path == "conv_norm_out"  # not a norm of the first down block
    assert by_key["L002.hidden_in"].module_path == "mid_block"
    bisected = ffdebug.bisect(tmp_path / "ref", tmp_path / "target")
    assert bisected.pattern == "jump" and bisected.first_divergence.layer == 2
    assert bisected.sub_stage.key == "L002.resnets.1.out"


def test_gpt2_conv1d_attention_bug(tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(4))
    # c_attn is a Conv1D (weights stored transposed): the bug shows at the attention's output
    _, where = _located(model, "transformer.h.1.attn.c_attn", [dict(input_ids=ids)], tmp_path, monkeypatch)
    assert where == (1, "attn_out")


def test_mixtral_experts_bug(tmp_path, monkeypatch):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=1000, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2)  # fmt: skip
    model = MixtralForCausalLM(config).eval()
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(5))
    _, where = _located(model, "model.layers.1.mlp.experts", [dict(input_ids=ids)], tmp_path, monkeypatch)
    assert where == (1, "ffn_out")


@pytest.fixture(scope="module")
def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=1000, d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=1)  # fmt: skip
    model = T5ForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(6)
    call = dict(input_ids=torch.randint(2, 1000, (1, 6), generator=g),
                decoder_input_ids=torch.randint(2, 1000, (1, 4), generator=g))  # fmt: skip
    return model, call


def test_t5_decoder_cross_attention_bug(t5, tmp_path, monkeypatch):
    """Encoder blocks L000-L001, decoder blocks L002-L003 (one numbering, in execution order)."""
    model, call = t5
    result, where = _located(model, "decoder.block.1.layer.1", [call], tmp_path, monkeypatch)
    assert where == (3, "cross_attn_out")
    keys = _keys(result)
    assert {"embed.decoder_input_ids", "embed.out", "final.norm_out", "L002.attn_out"} <= keys
    labels = {s.layer: s.layer_class for s in result.stages if s.layer is not None}
    assert labels[1] == "encoder.T5Block" and labels[2] == "decoder.T5Block"


@pytest.mark.parametrize(
    "family, child, layer",
    [("unet", "mid_block.resnets.1", 2), ("t5", "decoder.block.0.layer.1", 2)],
)
def test_a_tap_inside_a_renumbered_block_carries_its_execution_order_number(
    family, child, layer, request, tmp_path, monkeypatch
):
    """UNet's mid block is registered last (L004) and T5's first decoder block shares one list
    with the encoder's, yet both run third: a free tap made inside one, in every call, is a stage
    of L002 like the block's hidden_out, never of its registration number."""
    from ffdebug.store.reader import open_side

    model, call = request.getfixturevalue(family)
    module = model.get_submodule(child)
    forward = module.forward

    def tapped(*args, **kwargs):
        out = forward(*args, **kwargs)
        ffdebug.tap("probe", out[0] if isinstance(out, tuple) else out)
        return out

    monkeypatch.setattr(module, "forward", tapped)
    records = open_side(_dump(model, tmp_path, "ref", [call, call])).records
    probes = sorted((r.key, r.layer, r.call) for r in records if r.key.endswith(".probe"))
    key = f"L{layer:03d}.probe"
    assert probes == [(key, layer, 0), (key, layer, 1)]
    block_path = child.rsplit(".", 2)[0] if family == "t5" else "mid_block"
    out = {r.key: r for r in records if r.call == 0 and r.module_path == block_path}
    assert out[f"L{layer:03d}.hidden_out"].layer == layer


@pytest.fixture(scope="module")
def vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=37, num_labels=3)  # fmt: skip
    return ViTForImageClassification(config).eval()


def test_vit_norm_after_attention_bug(vit, tmp_path, monkeypatch):
    model = vit
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    result, where = _located(
        model, "vit.layers.0.layernorm_after", [dict(pixel_values=pixels)], tmp_path, monkeypatch
    )
    assert where == (0, "ffn_norm_out")
    assert {"embed.pixel_values", "L000.attn_norm_out", "final.norm_out"} <= _keys(result)


def test_multi_step_pipeline_scheduler_difference_names_the_call(sd3, tmp_path):
    """diffusers' `StableDiffusion3Pipeline`, 3 steps, from the reference trainer's tiny SD3
    fixtures (CLIP text encoder and tokenizer as both SD3 encoders, VAE, scheduler config; no T5)
    and the tiny transformer; the target's scheduler uses shift 1 instead of the fixture's 3.
    Step 0 starts at sigma 1 on both sides (a shift leaves 1 unchanged), so the first difference
    is call 1's timestep: an input that is compared, never gated."""
    from pathlib import Path

    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import AutoTokenizer, CLIPTextModelWithProjection

    from ffdebug.report.text import compare_conclusion

    fixtures = Path(__file__).resolve().parents[1] / "reference_trainer" / "fixtures" / "sd3_tiny"
    transformer, _ = sd3
    text_encoder = CLIPTextModelWithProjection.from_pretrained(fixtures / "text_encoder").eval()
    tokenizer = AutoTokenizer.from_pretrained(fixtures / "tokenizer")
    vae = AutoencoderKL.from_pretrained(fixtures / "vae").eval()

    def run(side, shift):
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(fixtures / "scheduler", shift=shift)
        pipe = StableDiffusion3Pipeline(
            transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
            tokenizer=tokenizer, text_encoder_2=text_encoder, tokenizer_2=tokenizer, text_encoder_3=None,
            tokenizer_3=None,
        )  # fmt: skip
        pipe.set_progress_bar_config(disable=True)
        with ffdebug.capture(pipe.transformer, dir=str(tmp_path), side=side), torch.no_grad():
            pipe("a cat", height=32, width=32, num_inference_steps=3, guidance_scale=1.0,
                 output_type="latent", generator=torch.Generator().manual_seed(0))  # fmt: skip
        return tmp_path / side

    assert FlowMatchEulerDiscreteScheduler.from_pretrained(fixtures / "scheduler").config.shift == 3.0
    result = ffdebug.compare(run("ref", 3.0), run("target", 1.0))
    assert {s.call for s in result.stages} == {0, 1, 2}
    first = result.first_divergence
    assert (first.call, first.key) == (1, "embed.timestep")
    assert all(s.ok for s in result.stages if s.call == 0)
    assert compare_conclusion(result).startswith("First divergence at call 1, embed.timestep")


def test_decode_only_bug_reports_generation_diverged(tmp_path, monkeypatch):
    """Greedy generation with a KV cache: prefill (call 0) is clean, every decode call's MLP of
    layer 1 is wrong. Call 1 computes the wrong next token, so call 2's ids differ: the gate says
    "generation diverged at call 2" (not exit 3) and names call 1's first divergent stage."""
    from helpers.tiny_models import tiny_llama

    from ffdebug.report.text import compare_conclusion

    model = tiny_llama(num_layers=2)
    prompt = torch.randint(3, 1000, (1, 5), generator=torch.Generator().manual_seed(8))

    tokens = {}

    def generate(side):
        with ffdebug.capture(model, dir=str(tmp_path), side=side), torch.no_grad():
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False
            )
        tokens[side] = out[0, 6].item()  # call 1's token: the input of call 2
        return tmp_path / side

    ref = generate("ref")
    mlp = model.model.layers[1].mlp
    forward = mlp.forward

    def decode_bug(x):
        out = forward(x)
        # one token per sequence: a decode step. Large, so that the random model's next token
        # changes (its residual stream is dominated by the embeddings)
        return -40 * out if x.shape[1] == 1 else out

    monkeypatch.setattr(mlp, "forward", decode_bug)
    result = ffdebug.compare(ref, generate("target"))
    assert result.generation is not None and result.generation.call == 2
    assert result.exit_code() == 1
    assert {s.call for s in result.stages} == {0, 1}  # calls before k compared, k on not
    assert all(s.ok for s in result.stages if s.call == 0)
    first = next(s for s in result.stages if not s.ok)
    assert (first.call, first.layer, first.stage) == (1, 1, "ffn_out")
    sentence = compare_conclusion(result)
    assert tokens["ref"] != tokens["target"]
    expected = (
        f"Generation diverged at call 2 (position [0, 0]: ref {tokens['ref']} vs target {tokens['target']})"
    )
    assert sentence.startswith(
        expected + "; first divergence of call 1: layer 1 (LlamaDecoderLayer), ffn_out"
    )
    assert sentence.endswith("FAILED")
    assert result.to_json()["generation_diverged"]["call"] == 2
    bisected = ffdebug.bisect(ref, tmp_path / "target")  # the same rule, the same sentence head
    assert bisected.exit_code() == 1 and bisected.call.call == 1
    assert bisected.conclusion.startswith(
        expected + "; first divergence of call 1: layer 1 (LlamaDecoderLayer), ffn_out"
    )
    assert bisected.to_json()["generation_diverged"]["call"] == 2


def test_a_generation_that_diverged_fails_bisect_when_the_calls_before_are_ok(tmp_path):
    """Sampling with another seed: the prefill is bit-identical, the first sampled token differs.
    No band fails, yet the run is not the reference's: compare and bisect both fail it."""
    from helpers.tiny_models import tiny_llama

    model = tiny_llama(num_layers=1)
    prompt = torch.randint(3, 1000, (1, 5), generator=torch.Generator().manual_seed(8))

    def generate(side, seed):
        torch.manual_seed(seed)
        with ffdebug.capture(model, dir=str(tmp_path), side=side), torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, do_sample=True,
                           top_k=0, temperature=5.0)  # fmt: skip
        return tmp_path / side

    ref, tgt = generate("ref", 0), generate("target", 1)
    compared = ffdebug.compare(ref, tgt)
    assert compared.generation is not None and compared.generation.call == 1
    assert all(s.ok for s in compared.stages) and compared.exit_code() == 1
    bisected = ffdebug.bisect(ref, tgt)
    assert bisected.first_divergence is None and bisected.exit_code() == 1
    assert bisected.conclusion.startswith("Generation diverged at call 1 (position [0, 0]: ref ")
    assert "every stage of the calls before it is ok" in bisected.conclusion
    assert bisected.conclusion.endswith("FAILED")


def test_different_pixel_values_are_gated_and_named(vit, tmp_path):
    """An external input other than token ids: exit 3 names it, without "tokenization"."""
    from ffdebug.errors import InputIdsMismatch

    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    ref = _dump(vit, tmp_path, "ref", [dict(pixel_values=pixels)])
    other = pixels.clone()
    other[0, 1, 2, 3] += 1.0
    tgt = _dump(vit, tmp_path, "target", [dict(pixel_values=other)])
    with pytest.raises(InputIdsMismatch) as err:
        ffdebug.compare(ref, tgt)
    message = str(err.value)
    assert "embed.pixel_values differ at call 0" in message and "position [0, 1, 2, 3]" in message
    assert "tokenization" not in message and "same pixel_values" in message
    assert err.value.exit_code == 3


def test_pixels_rounded_to_a_bf16_run_are_the_same_input(vit, tmp_path):
    """The bf16 run is fed the fp32 pixels rounded to bf16: the gate compares them in bf16 and lets
    the numbers be judged (precision); pixels that differ beyond that rounding are still exit 3."""
    import copy

    from ffdebug.errors import InputIdsMismatch

    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    ref = _dump(vit, tmp_path, "ref", [dict(pixel_values=pixels)])
    low = copy.deepcopy(vit).to(torch.bfloat16)
    tgt = _dump(low, tmp_path, "bf16", [dict(pixel_values=pixels.to(torch.bfloat16))])
    assert ffdebug.compare(ref, tgt).stages  # no InputIdsMismatch: compared
    other = pixels.to(torch.bfloat16)
    other[0, 1, 2, 3] += 1.0
    with pytest.raises(InputIdsMismatch, match="position \\[0, 1, 2, 3\\]"):
        ffdebug.compare(ref, _dump(low, tmp_path, "bf16_other", [dict(pixel_values=other)]))


def test_a_child_called_twice_gets_invocation_indices(tmp_path):
    """One module run twice inside a block: two records of one stage, invocations 0 and 1."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(8)
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return x + self.proj(self.proj(self.norm(x)))

    from ffdebug.store.reader import open_side

    torch.manual_seed(0)
    side = _dump(block_stack(Block), tmp_path, "ref", [dict(x=torch.randn(2, 3, 8))])
    proj = sorted(
        (r.key, r.invocation) for r in open_side(side).records if r.key.startswith("L000.branch_out")
    )
    assert proj == [("L000.branch_out", 0), ("L000.branch_out", 1)]


def test_legend_labels_that_differ_stay_distinct():
    from ffdebug.report.html import distinct_labels

    names = [
        "JointTransformerBlock[norm1_context=AdaLayerNormZero]",
        "JointTransformerBlock[norm1_context=AdaLayerNormContinuous]",
        "dense",
    ]
    labels = distinct_labels(names, 18)
    assert len(set(labels.values())) == 3 and labels["dense"] == "dense"
    assert all(len(v) <= 18 for v in labels.values())


def test_different_latents_are_compared_never_gated(sd3, tmp_path):
    model, inputs = sd3
    ref = _dump(model, tmp_path, "ref", [inputs])
    tgt = _dump(model, tmp_path, "target", [dict(inputs, hidden_states=inputs["hidden_states"] * 1.5)])
    result = ffdebug.compare(ref, tgt)  # no InputIdsMismatch: latents are a stage
    assert result.first_divergence.key == "embed.latents" and result.exit_code() == 1
    assert next(s for s in result.stages if s.key == "embed.timestep").ok


def test_a_norm_followed_by_two_branches_names_the_last_one_ffn_out():
    """ViT's older layout: layernorm_after, then intermediate and output (which adds the residual)."""
    from ffdebug.models.roles import BRANCH, NORM, place_children

    called = [
        ("ln_b", NORM),
        ("attention", BRANCH),
        ("ln_a", NORM),
        ("intermediate", BRANCH),
        ("output", BRANCH),
    ]
    placement = place_children(called, {})
    assert placement.names == {
        "ln_b": "attn_norm_out",
        "attention": "attn_out",
        "ln_a": "ffn_norm_out",
        "intermediate": "intermediate.out",
        "output": "ffn_out",
    }
    assert placement.unplaced == ()
