"""Pairing, float64 metrics and severity verdicts (README "Comparing")."""
