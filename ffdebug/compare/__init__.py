"""Pairing, float64 metrics and severity verdicts (DESIGN §4)."""
