"""The zoo tables of docs/bisect.md ("The zoo") from `ffdebug selftest --zoo --json` output.

ffdebug selftest --zoo --json > zoo.json
python bench/zoo_table.py zoo.json            # per case (and how many the deciding attribution run
                                               # answered), pooled, per architecture
python bench/zoo_table.py zoo.json --failing  # also the failing cases, one line each
"""

from __future__ import annotations

import argparse
import json
from collections import Counter


def _rate(holds: int, counted: int) -> str:
    return f"{holds}/{counted} ({100 * holds / counted:.0f}%)" if counted else "0/0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_file")
    parser.add_argument("--failing", action="store_true", help="list every failing case")
    args = parser.parse_args()
    with open(args.json_file) as f:
        data = json.load(f)
    models = data["models"]
    built = [m for m in models if m["built"]]
    cases: dict[str, list[int]] = {}
    groups: dict[str, list[int]] = {}
    no_effect: Counter = Counter()
    attributed: Counter = Counter()  # cases whose first bisect was not decided (attribution answered)
    for m in built:
        for c in m["cases"]:
            attributed[c["name"]] += bool(c.get("attributed"))
            if c["status"] in ("holds", "fails"):
                for d, k in ((cases, c["name"]), (groups, c["group"])):
                    d.setdefault(k, [0, 0])
                    d[k][0] += c["status"] == "holds"
                    d[k][1] += 1
            else:
                no_effect[c["name"]] += 1
    print(f"{len(models)} architectures attempted, {len(built)} built and run\n")
    print("| case | holds / counted | no effect or skipped | after attribution |\n|---|---|---|---|")
    for name, (h, n) in cases.items():
        print(f"| {name} | {_rate(h, n)} | {no_effect[name]} | {attributed[name]} |")
    for name, (h, n) in groups.items():
        print(f"| **{name}** (pooled) | {_rate(h, n)} | | |")
    print("\nPer architecture (holds / counted; the failing cases named):\n")
    print("| architecture | class | copy | precision | mutations | failing |\n|---|---|---|---|---|---|")
    for m in built:
        per = {}
        for c in m["cases"]:
            if c["status"] in ("holds", "fails"):
                per.setdefault(c["group"], [0, 0])
                per[c["group"]][0] += c["status"] == "holds"
                per[c["group"]][1] += 1
        failing = ", ".join(c["name"] for c in m["cases"] if c["status"] == "fails")
        cells = " | ".join(_rate(*per.get(g, [0, 0])) for g in ("copy", "precision", "mutations"))
        print(f"| {m['spec']} | {m['model_class']} | {cells} | {failing} |")
    not_built = [m for m in models if not m["built"]]
    if not_built:
        print(f"\nNot built ({len(not_built)}), with the reason:\n")
        for m in not_built:
            print(f"- `{m['spec']}`: {m['error']}")
    if args.failing:
        print()
        for m in built:
            for c in m["cases"]:
                if c["status"] == "fails":
                    print(f"- {m['spec']} / {c['name']}: expected {c['expected']}; got {c['got']}")


if __name__ == "__main__":
    main()
