"""Test helpers: peers."""
