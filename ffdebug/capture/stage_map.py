"""A stage map: rename stage kinds that role detection could not name, on either side.

The syntax is weights-diff's (`--map OLD=NEW`, `--alias-file FILE`; `ffdebug.name_rules`):
OLD is a regular expression (`{L}` / `{N}` match a number and carry it to NEW), applied with
`re.sub` to the stage *kind*, the key without its `L{NNN}.` prefix, which is kept:
`mix.out=attn_out` turns `L003.mix.out` into `L003.attn_out`; `final.out=final.logits` renames the
root output. Used by `install(model, stage_names=...)` (at capture time) and by compare / bisect
(`--map`, `--alias-file`, on both sides' records). A rule that renames nothing is reported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ffdebug.name_rules import parse_map, read_alias_file

_PREFIX = re.compile(r"^(L\d+\.)(.*)$", re.S)


@dataclass
class StageMap:
    rules: tuple = ()
    used: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, spec=None, alias_file: str | None = None) -> StageMap:
        """From a dict {OLD: NEW}, a list of 'OLD=NEW' strings, and / or an alias file."""
        if spec is None and not alias_file:
            return cls()
        if isinstance(spec, dict):
            items = [f"{k}={v}" for k, v in spec.items()]
        elif isinstance(spec, str):
            items = [spec]
        else:
            items = list(spec or ())
        rules = [parse_map(item, "stage map") for item in items]
        if alias_file:
            rules.extend(read_alias_file(alias_file))
        return cls(tuple(rules))

    def apply(self, key: str) -> str:
        if not self.rules:
            return key
        m = _PREFIX.match(key)
        prefix, kind = (m.group(1), m.group(2)) if m else ("", key)
        for rule in self.rules:
            new = rule.apply(kind)
            if new != kind:
                self.used.add(rule.spec)
                kind = new
        return prefix + kind

    def unused(self) -> list[str]:
        """Rules that renamed nothing so far."""
        return [r.spec for r in self.rules if r.spec not in self.used]
