"""Test helpers: bisect."""
