"""Classifier-free guidance in both adapters (``BaseAdapter.guided_forward``): scale ≤ 1 is the plain
conditional forward; scale s > 1 equals v_u + s·(v_c − v_u) from two separate forwards (conditional and
empty-prompt), for the live module and for a snapshot used functionally."""

from __future__ import annotations

import pytest
import torch

from reference_trainer.registry import resolve_adapter


@pytest.mark.parametrize("name", ["sd3-tiny", "flux-tiny"])
def test_guided_forward_is_uncond_plus_scale_times_difference(name):
    adapter = resolve_adapter(name)()
    adapter.load_pipeline()
    condition = adapter.encode_prompt(["a red cat", "a blue dog"])
    x = torch.randn((2, *adapter.latent_shape), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        v_cond = adapter.forward(x, sigma, condition)
        v_uncond = adapter.forward(x, sigma, adapter.unconditional(2))
        assert torch.equal(adapter.guided_forward(x, sigma, condition, guidance_scale=1.0), v_cond)
        guided = adapter.guided_forward(x, sigma, condition, guidance_scale=4.5)
        torch.testing.assert_close(guided, v_uncond + 4.5 * (v_cond - v_uncond), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(guided, v_cond)  # the empty prompt differs: guidance moves the velocity
        module = adapter.trainable_module()
        shifted = {k: p.detach() + 0.01 for k, p in module.named_parameters()}
        v_c = adapter.forward(x, sigma, condition, parameters=shifted)
        v_u = adapter.forward(x, sigma, adapter.unconditional(2), parameters=shifted)
        torch.testing.assert_close(
            adapter.guided_forward(x, sigma, condition, guidance_scale=2.0, parameters=shifted),
            v_u + 2.0 * (v_c - v_u),
            rtol=1e-5,
            atol=1e-6,
        )
