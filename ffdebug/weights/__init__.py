"""Weight comparison: rule out weight loading before any forward bisect (docs/weights-diff.md "Weights first", dump-bisect phase 1).

Modules, in the order data flows through them:
- `sources`: every checkpoint kind read one tensor at a time (safetensors file / HF folder / sharded
  index / diffusers component / `.pt` state dict / weight dump store / `module:function` entry);
- `names`: target-to-reference name mapping (prefixes, regex maps, alias files, fused tensors);
- `tp`: per-rank shards merged into full tensors, replicated tensors checked across ranks;
- `quant`: fp8 dequantisation with per-tensor / per-block / e8m0 scales;
- `transforms`: layout transforms (transpose, a user function);
- `schema`: rename suggestions from the only-in lists;
- `plan` (names mapped, --skip / --layers, a layer-selected dump, ranks, TP merge), `layout`
  (stacked experts, --fuse, fp8 scales), `schema_diff` (only-in / shape / dtype lists),
  `by_content` (what the names left unpaired, related by content): the planning steps, each
  taking and returning the logical tensor map; `loading` materialises a planned tensor;
- `numerics`, `findings` (one pair's finding: first-match rules), `explain` (swapped, permuted,
  not loaded);
- `diff`: `weights_diff(a, b) -> WeightsDiffResult`, the orchestrator (schema first, then float64
  numerics);
- `audit`: `load_audit(model, checkpoint)`: what a model really loaded.
"""
