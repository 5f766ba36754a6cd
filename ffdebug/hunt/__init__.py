"""Rounds that go from a symptom to a root cause without a person re-running both sides by hand
(docs/hunt.md "Hunt: from symptom to root cause"): `hunt` (weights, then a sketch of every layer, then
full dumps of the introducing layer), `isolate` (which fix matters), `replay` (kernel or input)."""
