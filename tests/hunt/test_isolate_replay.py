"""`ffdebug isolate` on a temporary git repository with three fix commits, and `ffdebug replay`
on a dumped stage (docs/hunt.md "Hunt: from symptom to root cause")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import ffdebug
from ffdebug.cli.app import app

# The buggy model: a block output scaled by 2 (critical), the RMS of a norm taken in bfloat16
# (fine-tuning: error ~2^-9 relative, inside the ok band), and a helper named `make` (renamed).
MODEL = """import torch
import torch.nn as nn


class Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        var = x.to(torch.bfloat16).pow(2).mean(-1, keepdim=True).float()
        return x * torch.rsqrt(var + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.lin = Norm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.lin(self.norm(x)) * 2.0


class Net(nn.Module):
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make():
    torch.manual_seed(0)
    return Net().eval()
"""

RUN = """import torch
import ffdebug
import mymodel.model as mm

torch.set_num_threads(1)
net = mm.make()
ffdebug.install(net)
with torch.no_grad():
    net(torch.arange(16).reshape(1, 16))
"""

FIXES = (
    ("x + self.lin(self.norm(x)) * 2.0", "x + self.lin(self.norm(x))", "model.py"),  # critical
    (
        "x.to(torch.bfloat16).pow(2).mean(-1, keepdim=True).float()",
        "x.pow(2).mean(-1, keepdim=True)",
        "model.py",
    ),
    ("def make():", "def build():", "model.py"),  # a rename (run.py follows)
)


def _git(repo, *args):
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def fixed_repo(tmp_path):
    repo = tmp_path / "repo"
    (repo / "mymodel").mkdir(parents=True)
    (repo / "mymodel" / "__init__.py").write_text("")
    (repo / "mymodel" / "model.py").write_text(MODEL)
    (repo / "run.py").write_text(RUN)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "buggy")
    shas = []
    for old, new, name in FIXES:
        path = repo / "mymodel" / name
        path.write_text(path.read_text().replace(old, new))
        if old == "def make():":
            (repo / "run.py").write_text(RUN.replace("mm.make()", "mm.build()"))
        _git(repo, "commit", "-qam", f"fix {old[:20]}")
        shas.append(
            subprocess.run(
                ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
        )
    return repo, shas


@pytest.fixture(scope="module")
def reference_command(tmp_path_factory):
    """One reference run per module: the fully fixed code run once with isolate's reference
    variables (final stages only); each test's --ref command copies that side into its dump
    directory, so both isolate tests compare against the same real run."""
    fixed = tmp_path_factory.mktemp("fixed")
    (fixed / "mymodel").mkdir()
    (fixed / "mymodel" / "__init__.py").write_text("")
    model = MODEL
    for old, new, _ in FIXES:
        model = model.replace(old, new)
    (fixed / "mymodel" / "model.py").write_text(model)
    (fixed / "run.py").write_text(RUN.replace("mm.make()", "mm.build()"))
    cache = fixed / "dump"
    env = {**os.environ, "FFDEBUG_FWD_DUMP_DIR": str(cache), "FFDEBUG_FWD_DUMP_SIDE": "ref"}
    env["FFDEBUG_FWD_DUMP_STAGES"] = "final.*"
    subprocess.run([sys.executable, "run.py"], cwd=fixed, env=env, check=True, capture_output=True)
    return f'cp -R {cache / "ref"} "$FFDEBUG_FWD_DUMP_DIR/$FFDEBUG_FWD_DUMP_SIDE"'


@pytest.mark.integration
def test_isolate_classes_three_fixes(fixed_repo, reference_command, tmp_path):
    """The scale fix is critical, the fp32 norm fine-tuning, the rename has no effect; the user's
    checkout is untouched and all fixes together equal the reference (the fixed checkout)."""
    repo, shas = fixed_repo
    args = [
        "isolate",
        "--ref",
        reference_command,
        "--target",
        f"{sys.executable} run.py",
        "--repo",
        str(repo),
        "--dir",
        str(tmp_path / "iso"),
        "--json",
    ]
    for sha in shas:
        args += ["--fix", sha]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert [f["class"] for f in result["fixes"]] == ["critical", "fine-tuning", "no effect"]
    assert result["fixes"][1]["bit_equal"] < 1.0 and result["fixes"][1]["severity"] == "ok"
    assert result["all_fixes_equal_reference"] is True
    assert all(not f["outside_imports"] for f in result["fixes"])
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout == ""
    worktrees = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True)
    assert len(worktrees.stdout.strip().splitlines()) == 1


@pytest.mark.integration
def test_isolate_classes_patch_files(fixed_repo, reference_command, tmp_path):
    """The same three fixes as patch files on top of the buggy HEAD: applied in each worktree
    except the one reverted, the same classes, the user's checkout still untouched."""
    repo, shas = fixed_repo
    patches = []
    for i, sha in enumerate(shas):
        diff = subprocess.run(
            ["git", "-C", str(repo), "diff", f"{sha}~1", sha], capture_output=True, text=True, check=True
        ).stdout
        patches.append(tmp_path / f"fix{i}.patch")
        patches[-1].write_text(diff)
    _git(repo, "reset", "-q", "--hard", f"{shas[0]}~1")
    args = ["isolate", "--ref", reference_command]
    args += ["--target", f"{sys.executable} run.py", "--repo", str(repo)]
    args += ["--dir", str(tmp_path / "iso"), "--json"]
    for patch in patches:
        args += ["--fix", str(patch)]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert [f["class"] for f in result["fixes"]] == ["critical", "fine-tuning", "no effect"]
    assert result["all_fixes_equal_reference"] is True
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout == ""
    assert (repo / "mymodel" / "model.py").read_text() == MODEL  # still the buggy checkout


def test_isolate_refuses_a_commit_not_in_head(fixed_repo, tmp_path):
    repo, _ = fixed_repo
    out = CliRunner().invoke(
        app,
        [
            "isolate",
            "--ref",
            "true",
            "--target",
            "true",
            "--repo",
            str(repo),
            "--fix",
            "nosuchrev",
            "--dir",
            str(tmp_path / "iso"),
        ],
    )
    assert out.exit_code == 2 and "--fix nosuchrev: neither a commit" in out.output


FNS = """import torch


def softmax_ref(x):
    return torch.softmax(x, dim=-1)


def softmax_wrong_dim(x):
    return torch.softmax(x, dim=0)


def softmax_manual(x):
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)
"""


def _dump_stage(directory, side, x):
    with ffdebug.capture(dir=str(directory), side=side):
        ffdebug.tap("L001.attn.softmax.in", x, layer=1)
        ffdebug.tap("L001.attn.softmax.out", torch.softmax(x, -1), layer=1)


@pytest.mark.parametrize(
    ("target_fn", "perturb", "verdict"),
    [("softmax_wrong_dim", 0.0, "kernel"), ("softmax_manual", 0.5, "input"), ("softmax_manual", 0.0, "none")],
)
def test_replay_tells_kernel_from_input(tmp_path, target_fn, perturb, verdict):
    """Same inputs and a wrong kernel: kernel. A correct kernel fed a moved input: input."""
    fns = tmp_path / "fns.py"
    fns.write_text(FNS)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0))
    _dump_stage(tmp_path / "d", "ref", x)
    _dump_stage(
        tmp_path / "d",
        "target",
        x + perturb * torch.randn(x.shape, generator=torch.Generator().manual_seed(1)),
    )
    out = CliRunner().invoke(
        app,
        [
            "replay",
            str(tmp_path / "d"),
            "--stage",
            "L001.attn.softmax",
            "--ref-fn",
            f"{fns}:softmax_ref",
            "--target-fn",
            f"{fns}:{target_fn}",
            "--json",
        ],
    )
    assert out.exit_code == (0 if verdict == "none" else 1), out.output
    result = json.loads(out.stdout)
    assert result["verdict"] == verdict and result["inputs"] == ["L001.attn.softmax.in"]
    runs = {(r["function"], r["inputs"]): r for r in result["runs"]}
    assert runs[("ref", "ref")]["bit_equal"] == 1.0
    assert (runs[("target", "ref")]["severity"] == "ok") == (verdict != "kernel")


def test_replay_names_a_missing_stage(tmp_path):
    _dump_stage(tmp_path / "d", "ref", torch.ones(2, 3))
    _dump_stage(tmp_path / "d", "target", torch.ones(2, 3))
    out = CliRunner().invoke(
        app,
        [
            "replay",
            str(tmp_path / "d"),
            "--stage",
            "L001.mlp",
            "--ref-fn",
            "torch:relu",
            "--target-fn",
            "torch:relu",
        ],
    )
    assert out.exit_code == 2 and "no input record for stage 'L001.mlp'" in out.output
