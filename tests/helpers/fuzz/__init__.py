"""Test helpers: fuzz."""
