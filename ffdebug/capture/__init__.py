"""Capturing: sessions, module hooks, taps, reference patching and weight dumps (README "Dumping your own runs")."""
