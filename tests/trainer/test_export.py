"""The checkpoint's model export is a diffusers component folder: ``model/<variant>/config.json`` +
``diffusion_pytorch_model.safetensors``, which the transformer class's ``from_pretrained`` loads with no
missing or unexpected key, to the trained weights bit for bit (not the fixture's), with the same
forward. Both tiny transformers of ``reference_trainer/fixtures/`` (SD3, Flux), after one GRPO step."""

from __future__ import annotations

import pytest
import torch
from helpers.trainer.trainer_utils import GRPO_CONFIG, load

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one


def without_path(config) -> dict:
    """A diffusers config less ``_name_or_path`` (where it was loaded from)."""
    return {key: value for key, value in config.items() if key != "_name_or_path"}


@pytest.mark.parametrize(
    ("adapter", "class_name"),
    [("sd3-tiny", "SD3Transformer2DModel"), ("flux-tiny", "FluxTransformer2DModel")],
)
def test_export_round_trips_through_from_pretrained(adapter, class_name, tmp_path):
    import diffusers

    from reference_trainer.checkpoint import EXPORT_WEIGHTS
    from reference_trainer.run import build_trainer

    trainer = build_trainer(load(GRPO_CONFIG, f"model.adapter={adapter}", max_steps=1), tmp_path)
    trainer.start()
    export = tmp_path / "checkpoints/step-000001/model/policy"
    assert sorted(path.name for path in export.iterdir()) == sorted(["config.json", EXPORT_WEIGHTS])
    model_class = getattr(diffusers, class_name)
    loaded, info = model_class.from_pretrained(export, output_loading_info=True)
    assert type(loaded) is model_class
    assert {key: value for key, value in info.items() if value} == {}, info  # nothing missing / unexpected
    policy = trainer.variants.variant("policy")
    assert without_path(loaded.config) == without_path(policy.config)
    trained, restored = policy.state_dict(), loaded.state_dict()
    assert trained.keys() == restored.keys()
    for key, value in trained.items():
        assert restored[key].dtype == value.dtype and torch.equal(restored[key], value), key
    # the export is the trained policy, not the fixture it started from
    fixture = model_class.from_pretrained(trainer.adapter.fixture_dir / "transformer")
    assert any(not torch.equal(value, fixture.state_dict()[key]) for key, value in trained.items())
    # and it computes the same velocities
    condition = trainer.adapter.encode_prompt(["a red cat", "a blue dog"])
    x = torch.randn((2, *trainer.adapter.latent_shape), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.3, 0.7])
    with torch.no_grad():
        expected = trainer.adapter.forward(x, sigma, condition, module=policy)
        assert torch.equal(trainer.adapter.forward(x, sigma, condition, module=loaded.eval()), expected)
