"""Rendering for people (rich tables, one closing sentence) and machines (JSON). No torch here."""
