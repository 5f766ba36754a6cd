"""Localisation: first divergent layer per layer class, the pattern, the sub-stage, attribution,
partial sums and shards, slot invariance. Entry point: `ffdebug.bisect(ref, target, **opts)`."""
