"""Test helpers: trainer."""
