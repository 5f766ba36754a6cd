"""Rename rules `OLD=NEW` (`--map`, `--alias-file`), parsed once for weights-diff's name map
(`weights/names.py`) and the stage map of capture and compare / bisect (`capture/stage_map.py`).

OLD is a regular expression applied with `re.sub`. `{L}` (or `{N}`) in OLD stands for a layer
number and is reused in NEW: `transformer.h.{L}.=model.layers.{L}.`.

Alias files: one `OLD=NEW` rule a line (`#` comments), or a JSON / YAML mapping (optionally under
an `aliases:` key) of OLD to NEW.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ffdebug.errors import FFDebugError, short_reason

_PLACEHOLDER = re.compile(r"\{(L|N)\}")


@dataclass(frozen=True)
class MapRule:
    pattern: re.Pattern
    repl: str
    spec: str

    def apply(self, name: str) -> str:
        return self.pattern.sub(self.repl, name)


def parse_map(spec: str, where: str = "--map") -> MapRule:
    if "=" not in spec:
        raise FFDebugError(
            f"{where} {spec!r} is invalid: use OLD=NEW, e.g. '^transformer\\.h\\.=model.layers.'"
        )
    old, new = spec.split("=", 1)
    if not old:
        raise FFDebugError(f"{where} {spec!r}: OLD is empty; use OLD=NEW")
    seen: set[str] = set()

    def group(m: re.Match) -> str:
        name = m.group(1)
        if name in seen:
            return f"(?P={name})"
        seen.add(name)
        return f"(?P<{name}>\\d+)"

    old_re = _PLACEHOLDER.sub(group, old)
    new_repl = _PLACEHOLDER.sub(lambda m: f"\\g<{m.group(1)}>", new)
    try:
        pattern = re.compile(old_re)
        pattern.sub(new_repl, "")  # validates group references in NEW
    except (re.error, IndexError) as err:
        raise FFDebugError(f"{where} {spec!r}: invalid regular expression ({err})") from None
    return MapRule(pattern, new_repl, spec)


def read_alias_file(path: str) -> list[MapRule]:
    if not os.path.isfile(path):
        raise FFDebugError(f"--alias-file {path}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    where = f"{path}"
    if path.endswith((".json", ".yaml", ".yml")):
        try:
            if path.endswith(".json"):
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as err:
            raise FFDebugError(f"{path}: unreadable alias file ({short_reason(err)})") from None
        if isinstance(data, dict) and isinstance(data.get("aliases"), dict):
            data = data["aliases"]
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise FFDebugError(f"{path}: expected a mapping OLD: NEW (optionally under 'aliases:')")
        return [parse_map(f"{k}={v}", where) for k, v in data.items()]
    rules = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        rules.append(parse_map(line, f"{where}:{lineno}"))
    return rules
