"""Test helpers: weights."""
