"""Capturing: sessions, module hooks, taps, reference patching and weight dumps (DESIGN §2)."""
