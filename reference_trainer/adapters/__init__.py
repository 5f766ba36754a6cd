"""Model adapters: the only code that knows a model family's components, shapes and conventions.

Every adapter subclasses ``BaseAdapter`` directly and implements its four abstract methods
(``load_pipeline``, ``decode_latents``, ``inference``, ``forward``). Built-in adapters:
``sd3-tiny`` (``sd3.py``) and ``flux-tiny`` (``flux.py``).
"""
