"""The `ffdebug` command line: one thin module per command (parse, call, render)."""
