"""Test helpers: hunt."""
