"""Test helpers: review."""
