"""Generated hostile inputs for the fuzz suite (docs/architecture.md, "Hostile stores").

A store case mutates a copy of a small valid dump (`DUMP/ref`, `DUMP/target`); a CLI case is an
argument list run against such a dump. `store_cases()` / `cli_cases()` return descriptors only (a
name and a function), so counting them is cheap. `FFDEBUG_FUZZ_CASES=N` adds seeded random store
mutations until there are N (the deterministic cases always run).
"""

from __future__ import annotations

import json
import os
import pickle
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

FIELDS = (
    "key",
    "seq",
    "file",
    "tensor",
    "side",
    "rank",
    "world_size",
    "call",
    "invocation",
    "phase",
    "step",
    "layer",
    "layer_class",
    "module_class",
    "module_path",
    "io",
    "dtype",
    "shape",
    "stats",
    "shard",
    "reduction",
    "writer",
    "persistent",
    "over_budget",
    "extra",
)
WRONG_VALUES = (
    ("int", 7),
    ("negative", -3),
    ("float", 1.5),
    ("str", "x"),
    ("bool", True),
    ("null", None),
    ("empty_list", []),
    ("list", [1, "a"]),
    ("empty_dict", {}),
    ("dict", {"a": [1]}),
    ("huge_int", 10**30),
)
MARKUP_KEYS = (
    "[/]",
    "[bold]x",
    "x\\",
    "[link=file:///etc/passwd]x[/link]",
    "[red]L000.attn_out[/red]",
    "a]b[c",
)


@dataclass(frozen=True)
class Case:
    name: str
    apply: Callable  # (dump_dir, outside_dir) -> None; mutates dump_dir/target (or ref)


# ---------------------------------------------------------------------------------------------
# helpers


def rank_dir(dump: str, side: str = "target") -> str:
    return os.path.join(dump, side, "rank000")


def manifest_path(dump: str, side: str = "target") -> str:
    return os.path.join(rank_dir(dump, side), "manifest.jsonl")


def read_records(dump: str, side: str = "target") -> list[dict]:
    with open(manifest_path(dump, side), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_records(dump: str, records: list, side: str = "target") -> None:
    with open(manifest_path(dump, side), "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def edit_record(index: int, fn: Callable[[dict], None]) -> Callable:
    def apply(dump: str, outside: str) -> None:
        recs = read_records(dump)
        fn(recs[index])
        write_records(dump, recs)

    return apply


def payload_of(dump: str, index: int = 1) -> str:
    return os.path.join(rank_dir(dump), read_records(dump)[index]["file"])


def replace_with(kind: str, target: Callable[[str], str]) -> Callable:
    """Replace the file at `target(dump)` by a FIFO, a directory or a symlink to /dev/zero."""

    def apply(dump: str, outside: str) -> None:
        path = target(dump)
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil

            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "dir":
            os.mkdir(path)
        elif kind == "devzero":
            os.symlink("/dev/zero", path)
        elif kind == "outside_file":
            os.symlink(os.path.join(outside, "secret.safetensors"), path)
        elif kind == "outside_fifo":
            os.symlink(os.path.join(outside, "fifo"), path)
        elif kind == "outside_dir":
            os.symlink(outside, path)

    return apply


def truncate(target: Callable[[str], str], keep: float | int) -> Callable:
    def apply(dump: str, outside: str) -> None:
        path = target(dump)
        with open(path, "rb") as f:
            data = f.read()
        n = int(len(data) * keep) if isinstance(keep, float) else keep
        with open(path, "wb") as f:
            f.write(data[:n])

    return apply


def write_bytes(target: Callable[[str], str], data: bytes) -> Callable:
    def apply(dump: str, outside: str) -> None:
        with open(target(dump), "wb") as f:
            f.write(data)

    return apply


def deep(n: int) -> str:
    return "[" * n + "]" * n


def _save_payload(path: str, tensor) -> None:
    import safetensors.torch

    safetensors.torch.save_file({"tensor": tensor}, path)


def payload_tensor(
    tensor_fn: Callable[[], torch.Tensor], index: int = 1, fix_manifest: bool = False
) -> Callable:
    def apply(dump: str, outside: str) -> None:
        t = tensor_fn()
        _save_payload(payload_of(dump, index), t)
        if fix_manifest:
            recs = read_records(dump)
            recs[index]["dtype"] = str(t.dtype).replace("torch.", "")
            recs[index]["shape"] = list(t.shape)
            recs[index]["stats"] = None
            write_records(dump, recs)

    return apply


def nan_ids(dump: str, outside: str) -> None:
    for side in ("ref", "target"):
        recs = read_records(dump, side)
        ids = recs[0]
        t = torch.tensor([[1.0, float("nan"), 3.0, 4.0]])
        _save_payload(os.path.join(rank_dir(dump, side), ids["file"]), t)
        ids["dtype"], ids["shape"], ids["stats"] = "float32", [1, 4], None
        write_records(dump, recs, side)


def evil_pickle_payload(dump: str, outside: str) -> None:
    with open(payload_of(dump), "wb") as f:
        pickle.dump(Evil(os.path.join(outside, "pwned")), f)


class Evil:
    """Unpickling this runs `touch marker`: it must never happen."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def two_writers(dump: str, outside: str) -> None:
    recs = read_records(dump)
    recs[-1]["writer"] = "otherhost:1:1"
    write_records(dump, recs)


def duplicate_seq(dump: str, outside: str) -> None:
    recs = read_records(dump)
    recs[-1]["seq"] = recs[0]["seq"]
    write_records(dump, recs)


def appended_second_run(dump: str, outside: str) -> None:
    """What two writers on one side used to leave: the same captures twice."""
    recs = read_records(dump)
    again = [dict(r, writer="otherhost:2:2") for r in recs]
    write_records(dump, recs + again)


def json_file(name: str) -> Callable[[str], str]:
    def target(dump: str) -> str:
        return (
            os.path.join(dump, "target", name) if name == "run.json" else os.path.join(rank_dir(dump), name)
        )

    return target


def manifest(dump: str) -> str:
    return manifest_path(dump)


# ---------------------------------------------------------------------------------------------
# the cases


def _field_cases() -> list[Case]:
    out = []
    for field in FIELDS:
        for label, value in WRONG_VALUES:

            def set_field(rec, field=field, value=value):
                rec[field] = value

            out.append(Case(f"field-{field}-{label}", edit_record(1, set_field)))

        def drop(rec, field=field):
            rec.pop(field, None)

        out.append(Case(f"field-{field}-absent", edit_record(1, drop)))
    return out


def _file_cases() -> list[Case]:
    names = {
        "parent": "../../outside/secret.safetensors",
        "parent-fifo": "../../outside/fifo",
        "subdir": "sub/x.safetensors",
        "dot": ".",
        "dotdot": "..",
        "empty": "",
        "nul": "a\0b",
        "backslash": "..\\..\\x",
        "via-rank": "../rank000/000001_L000.attn_out.safetensors",
        "manifest": "manifest.jsonl",
        "missing": "nope.safetensors",
    }
    out = [
        Case(f"file-{k}", edit_record(1, lambda r, v=v: r.__setitem__("file", v))) for k, v in names.items()
    ]

    def absolute(which):
        def apply(dump, outside):
            edit_record(1, lambda r: r.__setitem__("file", os.path.join(outside, which)))(dump, outside)

        return apply

    out += [
        Case("file-absolute", absolute("secret.safetensors")),
        Case("file-absolute-fifo", absolute("fifo")),
    ]
    out.append(Case("file-etc-passwd", edit_record(1, lambda r: r.__setitem__("file", "/etc/passwd"))))
    return out


def _special_file_cases() -> list[Case]:
    out = []
    targets = {
        "payload": lambda d: payload_of(d),
        "ids-payload": lambda d: payload_of(d, 0),
        "manifest": manifest,
        "run.json": json_file("run.json"),
        "status.json": json_file("status.json"),
    }
    for tname, target in targets.items():
        for kind in ("fifo", "dir", "devzero", "outside_file", "outside_fifo"):
            out.append(Case(f"{kind}-as-{tname}", replace_with(kind, target)))
    out.append(Case("outside_dir-as-rank", replace_with("outside_dir", lambda d: rank_dir(d))))
    out.append(Case("file-as-rank", write_bytes(lambda d: os.path.join(d, "target", "rank001"), b"x")))
    return out


def _truncation_cases() -> list[Case]:
    out = []
    for keep in (0, 1, 7, 8, 9, 20, 0.5, 0.9, -1):
        out.append(Case(f"truncate-payload-{keep}", truncate(lambda d: payload_of(d), keep)))
    for keep in (0, 1, 10, 0.3, 0.5, 0.7, 0.99, -1, -2):
        out.append(Case(f"truncate-manifest-{keep}", truncate(manifest, keep)))
    for name in ("run.json", "status.json"):
        for keep in (0, 1, 0.5, -2):
            out.append(Case(f"truncate-{name}-{keep}", truncate(json_file(name), keep)))
    return out


def _json_cases() -> list[Case]:
    out = []
    for depth in (62, 63, 100_000):  # the line nests depth + 2 levels: 64 is allowed, 65 is not
        # the raw line holds the nesting (json.dumps would recurse on a 100,000-deep object)
        out.append(
            Case(
                f"deep-line-{depth}",
                _raw_line(lambda n=depth: '{"key": "deep", "seq": 99, "step": {"a": ' + deep(n) + "}}"),
            )
        )
        for name in ("run.json", "status.json"):
            out.append(
                Case(
                    f"deep-{name}-{depth}",
                    write_bytes(json_file(name), ('{"a": ' + deep(depth) + "}").encode()),
                )
            )
    out.append(
        Case(
            "line-over-1MiB", _raw_line(lambda: json.dumps({"key": "big", "seq": 99, "pad": "x" * (1 << 20)}))
        )
    )
    out.append(Case("manifest-binary", write_bytes(manifest, bytes(range(256)) * 4 + b"\n")))
    out.append(Case("manifest-empty", write_bytes(manifest, b"")))
    out.append(Case("manifest-blank-lines", write_bytes(manifest, b"\n\n  \n")))
    out.append(Case("manifest-array-line", write_bytes(manifest, b"[1, 2]\n")))
    out.append(Case("manifest-nan", _raw_line(lambda: '{"key": "n", "seq": NaN}')))
    out.append(
        Case("manifest-unknown-fields", edit_record(1, lambda r: r.update(zzz=[1], extra_field={"x": None})))
    )
    for label, body in (
        ("list", b"[1, 2]"),
        ("number", b"5"),
        ("string", b'"complete"'),
        ("null", b"null"),
        ("garbage", b"{not json"),
        ("latin1", b'{"a": "\xff\xfe"}'),
        ("huge", b'{"a": "' + b"x" * ((1 << 20) + 10) + b'"}'),
        ("wrong-types", b'{"complete": "yes", "over_budget": "[/]", "records": [], "writer": 5}'),
        ("empty-object", b"{}"),
    ):
        for name in ("run.json", "status.json"):
            out.append(Case(f"{name}-{label}", write_bytes(json_file(name), body)))
    out.append(
        Case(
            "run.json-side-markup", write_bytes(json_file("run.json"), b'{"side": "[/]", "world_size": "x"}')
        )
    )
    return out


def _raw_line(make: Callable[[], str]) -> Callable:
    """Append a hand-written line, stamped with the store's writer and world size (else it reads
    as a second writer or another run)."""

    def apply(dump: str, outside: str) -> None:
        first = read_records(dump)[0]
        stamp = f'"writer": {json.dumps(first["writer"])}, "world_size": {first["world_size"]}, '
        with open(manifest(dump), "a", encoding="utf-8") as f:
            f.write(make().replace("{", "{" + stamp, 1) + "\n")

    return apply


def _key_cases() -> list[Case]:
    out = []
    lengths = {"200": 200, "201": 201, "1024": 1024, "1025": 1025, "100k": 100_000}
    for label, n in lengths.items():
        out.append(
            Case(
                f"key-len-{label}",
                edit_record(1, lambda r, n=n: r.__setitem__("key", "L000." + "k" * (n - 5))),
            )
        )
    for i, key in enumerate(MARKUP_KEYS):
        out.append(Case(f"key-markup-{i}", edit_record(1, lambda r, k=key: r.__setitem__("key", k))))
        out.append(Case(f"key-markup-both-sides-{i}", _both_sides_key(key)))
    for label, key in (
        ("newline", "a\nb"),
        ("ansi", "\x1b[31mred"),
        ("unicode", "λ→∑"),
        ("empty", ""),
        ("spaces", "   "),
    ):
        out.append(Case(f"key-{label}", edit_record(1, lambda r, k=key: r.__setitem__("key", k))))
    out.append(Case("layer-class-markup", edit_record(1, lambda r: r.__setitem__("layer_class", "[/]"))))
    out.append(Case("step-markup", edit_record(1, lambda r: r.__setitem__("step", {"[/]": "[bold]"}))))
    out.append(Case("stats-markup-name", edit_record(1, lambda r: r["stats"].__setitem__("[/]", 1.0))))
    out.append(Case("stats-string-value", edit_record(1, lambda r: r["stats"].__setitem__("mean", "big"))))
    out.append(Case("stats-list-value", edit_record(1, lambda r: r["stats"].__setitem__("nan", [1]))))
    out.append(Case("stats-wrong-number", edit_record(1, lambda r: r["stats"].__setitem__("mean", 12345.0))))
    out.append(Case("shape-disagrees", edit_record(1, lambda r: r.__setitem__("shape", [3, 3]))))
    out.append(Case("dtype-disagrees", edit_record(1, lambda r: r.__setitem__("dtype", "float16"))))
    return out


def _both_sides_key(key: str) -> Callable:
    def apply(dump: str, outside: str) -> None:
        for side in ("ref", "target"):
            recs = read_records(dump, side)
            recs[1]["key"] = key
            write_records(dump, recs, side)

    return apply


def _payload_cases() -> list[Case]:
    return [
        Case("payload-pickle", evil_pickle_payload),
        Case(
            "payload-complex",
            payload_tensor(lambda: torch.randn(2, 3, dtype=torch.complex64), fix_manifest=True),
        ),
        Case("payload-complex-unfixed", payload_tensor(lambda: torch.randn(2, 3, dtype=torch.complex64))),
        Case("payload-other-shape", payload_tensor(lambda: torch.ones(5))),
        Case("payload-nan", payload_tensor(lambda: torch.full((2, 8), float("nan")), fix_manifest=True)),
        Case("payload-int", payload_tensor(lambda: torch.arange(16).reshape(2, 8), fix_manifest=True)),
        Case("payload-bool", payload_tensor(lambda: torch.ones(2, 8, dtype=torch.bool), fix_manifest=True)),
        Case("payload-empty", payload_tensor(lambda: torch.ones(0, 8), fix_manifest=True)),
        Case("payload-ids-nan", nan_ids),
        Case(
            "payload-header-huge",
            write_bytes(lambda d: payload_of(d), (10**12).to_bytes(8, "little") + b"{}"),
        ),
        Case(
            "payload-header-deep",
            write_bytes(
                lambda d: payload_of(d), len(deep(100_000)).to_bytes(8, "little") + deep(100_000).encode()
            ),
        ),
        Case("payload-header-list", write_bytes(lambda d: payload_of(d), (2).to_bytes(8, "little") + b"[]")),
        Case("payload-zeros", write_bytes(lambda d: payload_of(d), b"\0" * 64)),
        Case("payload-text", write_bytes(lambda d: payload_of(d), b"root:x:0:0:root:/root:/bin/bash\n")),
        Case("two-writer-ids", two_writers),
        Case("duplicate-seq", duplicate_seq),
        Case("second-run-appended", appended_second_run),
        Case("mixed-writer-none", edit_record(2, lambda r: r.pop("writer"))),
        Case("world-size-mismatch", _stale_rank),
        Case(
            "stale-lock-left",
            write_bytes(json_file("writer.lock"), b'{"host": "h", "pid": 1, "claimed_ns": 1}'),
        ),
    ]


def _stale_rank(dump: str, outside: str) -> None:
    import shutil

    other = os.path.join(dump, "target", "rank003")
    shutil.copytree(rank_dir(dump), other)
    recs = read_records(dump)
    for r in recs:
        r["world_size"], r["rank"] = 4, 3
    with open(os.path.join(other, "manifest.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


def _random_cases(n: int, seed: int = 17) -> list[Case]:
    """Seeded random mutations: a random field given a random value, or random bytes flipped."""
    rng = random.Random(seed)
    pool = [v for _, v in WRONG_VALUES] + ["[/]", "../x", "/etc/passwd", 0, 2**63, {"dim": 0}, [[]]]
    out = []
    for i in range(n):
        kind = rng.choice(("field", "flip-manifest", "flip-payload", "cut-manifest"))
        if kind == "field":
            field, value, index = rng.choice(FIELDS), rng.choice(pool), rng.randrange(3)
            out.append(
                Case(
                    f"random-{i}-field-{field}",
                    edit_record(index, lambda r, f=field, v=value: r.__setitem__(f, v)),
                )
            )
        elif kind == "cut-manifest":
            out.append(Case(f"random-{i}-cut", truncate(manifest, rng.random())))
        else:
            target = manifest if kind == "flip-manifest" else (lambda d: payload_of(d))
            out.append(Case(f"random-{i}-{kind}", _flip(target, rng.randrange(1 << 30), rng.randrange(1, 8))))
    return out


def _flip(target: Callable[[str], str], seed: int, count: int) -> Callable:
    def apply(dump: str, outside: str) -> None:
        path = target(dump)
        with open(path, "rb") as f:
            data = bytearray(f.read())
        rng = random.Random(seed)
        for _ in range(count):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        with open(path, "wb") as f:
            f.write(bytes(data))

    return apply


def store_cases() -> list[Case]:
    cases = (
        _field_cases()
        + _file_cases()
        + _special_file_cases()
        + _truncation_cases()
        + _json_cases()
        + _key_cases()
        + _payload_cases()
    )
    wanted = int(os.environ.get("FFDEBUG_FUZZ_CASES", "0") or 0)
    if wanted > len(cases):
        cases += _random_cases(wanted - len(cases))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "fuzz case names must be unique"
    return cases


# ---------------------------------------------------------------------------------------------
# CLI argument cases: (name, argv builder (dump, outside) -> list[str])


def cli_cases() -> list[tuple[str, Callable]]:
    def R(d):
        return os.path.join(d, "ref")

    def T(d):
        return os.path.join(d, "target")

    out: list[tuple[str, Callable]] = []
    for label, value in (("neg9", "-9"), ("neg1", "-1"), ("huge", "1000000"), ("big-int", str(10**30))):
        out.append(
            (
                f"slot-dim-{label}",
                lambda d, o, v=value: ["slot-invariance", T(d), "--slots", "2", "--slot-dim", v],
            )
        )
    for label, value in (("zero", "0"), ("neg", "-4"), ("one", "1"), ("huge", "1000000000"), ("text", "two")):
        out.append((f"slots-{label}", lambda d, o, v=value: ["slot-invariance", T(d), "--slots", v]))
    html_targets = {
        "existing-dir": lambda d, o: o,
        "missing-parent": lambda d, o: os.path.join(o, "nope", "r.html"),
        "under-a-file": lambda d, o: os.path.join(o, "secret.safetensors", "r.html"),
        "fifo": lambda d, o: os.path.join(o, "fifo"),
        "proc": lambda d, o: "/proc/ffdebug-report.html",
    }
    for label, where in html_targets.items():
        out.append((f"bisect-html-{label}", lambda d, o, w=where: ["bisect", R(d), T(d), "--html", w(d, o)]))
    options = {
        "layers-text": ["--layers", "x"],
        "layers-open": ["--layers", "1-"],
        "layers-neg": ["--layers", "-999999"],
        "layers-markup": ["--layers", "[/]"],
        "threshold-garbage": ["--threshold", "garbage"],
        "threshold-nan": ["--threshold", "*:cos>=abc"],
        "threshold-markup": ["--threshold", "[/]:cos>=0.9"],
        "fail-on-bogus": ["--fail-on", "nope"],
        "rank-neg": ["--rank", "-1"],
        "rank-huge": ["--rank", "99"],
        "step-noeq": ["--step", "noeq"],
        "stages-markup": ["--stages", "[/]"],
        "stages-none": ["--stages", "zzz*"],
    }
    for cmd in ("compare", "bisect"):
        for label, opts in options.items():
            if cmd == "compare" and label.startswith("layers"):
                continue
            out.append((f"{cmd}-{label}", lambda d, o, c=cmd, x=opts: [c, R(d), T(d), *x]))
    paths = {
        "fifo": lambda d, o: os.path.join(o, "fifo"),
        "fifo-safetensors": lambda d, o: os.path.join(o, "fifo.safetensors"),
        "fifo-pt": lambda d, o: os.path.join(o, "fifo.pt"),
        "dev-null": lambda d, o: "/dev/null",
        "missing": lambda d, o: os.path.join(o, "missing"),
        "dir-safetensors": lambda d, o: os.path.join(o, "dir.safetensors"),
        "evil-pt": lambda d, o: os.path.join(o, "evil.pt"),
        "index-5": lambda d, o: os.path.join(o, "idx5", "model.safetensors.index.json"),
        "index-null": lambda d, o: os.path.join(o, "idxnull", "model.safetensors.index.json"),
        "index-escape": lambda d, o: os.path.join(o, "idxesc", "model.safetensors.index.json"),
        "index-deep": lambda d, o: os.path.join(o, "idxdeep", "model.safetensors.index.json"),
        "markup-name": lambda d, o: os.path.join(o, "[bold]x.safetensors"),
    }
    for label, path in paths.items():
        out.append((f"inspect-{label}", lambda d, o, p=path: ["inspect", p(d, o)]))
        out.append((f"compare-ref-vs-{label}", lambda d, o, p=path: ["compare", R(d), p(d, o)]))
    out.append(
        (
            "weights-diff-index-5",
            lambda d, o: ["weights-diff", paths["index-5"](d, o), paths["index-null"](d, o)],
        )
    )
    out.append(
        ("compare-dir-fifo", lambda d, o: ["compare", "ref-vs-target", "--dir", os.path.join(o, "fifo")])
    )
    out.append(("compare-dir-markup-pair", lambda d, o: ["compare", "[/]-vs-target", "--dir", d]))
    out.append(("inspect-manifest-only", lambda d, o: ["inspect", T(d), "--manifest-only", "--json"]))
    return out


def prepare_outside(outside: str) -> None:
    """The files CLI cases point at (all outside the dump; only the named path may be read)."""
    os.makedirs(outside, exist_ok=True)
    _save_payload(os.path.join(outside, "secret.safetensors"), torch.full((2, 8), 42.0))
    for name in ("fifo", "fifo.safetensors", "fifo.pt"):
        os.mkfifo(os.path.join(outside, name))
    os.mkdir(os.path.join(outside, "dir.safetensors"))
    with open(os.path.join(outside, "evil.pt"), "wb") as f:
        pickle.dump({"w": Evil(os.path.join(outside, "pwned"))}, f)
    for name, body in (
        ("idx5", {"weight_map": {"a": 5}}),
        ("idxnull", {"weight_map": {"a": None}}),
        ("idxesc", {"weight_map": {"a": "../secret.safetensors"}}),
    ):
        os.mkdir(os.path.join(outside, name))
        with open(os.path.join(outside, name, "model.safetensors.index.json"), "w") as f:
            json.dump(body, f)
    os.mkdir(os.path.join(outside, "idxdeep"))
    with open(os.path.join(outside, "idxdeep", "model.safetensors.index.json"), "w") as f:
        f.write('{"weight_map": ' + deep(100_000) + "}")
    _save_payload(os.path.join(outside, "[bold]x.safetensors"), torch.ones(3))
