"""The public functions re-exported by `ffdebug` (`capture`: dumping; `analysis`: comparing)."""
