"""Model adapters: the only code that knows a model family's components, shapes and conventions.

Every adapter is a ``BaseAdapter`` and implements its four abstract methods (``load_pipeline``,
``decode_latents``, ``inference``, ``forward``). Built-in adapters: ``sd3-tiny`` (``sd3.py``) and
``flux-tiny`` (``flux.py``); both are ``LatentFlowAdapter``s (``latent_flow.py``: the shared tiny CLIP,
VAE, scheduler and sampling loop) and add only their transformer (``load_transformer``, ``forward``).
"""
