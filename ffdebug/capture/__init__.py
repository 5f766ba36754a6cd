"""Capturing: sessions, module hooks, taps, reference patching and weight dumps (docs/dumping.md "Dumping your own runs")."""
