"""Pairing, float64 metrics and severity verdicts (docs/comparing.md "Comparing")."""
