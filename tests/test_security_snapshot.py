"""The code snapshot a SLURM job runs from: tracked files, no secrets, no nested runs, links
resolved inside the checkout and refused out of it, a size cap, submodules copied or named (issue
19, item 4)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from wf_launch.launchers.snapshot import SnapshotError, take

GIT = [
    "git",
    "-c",
    "user.name=t",
    "-c",
    "user.email=t@t",
    "-c",
    "commit.gpgsign=false",
    "-c",
    "protocol.file.allow=always",
]


def _git(cwd: Path, *args: str) -> None:
    subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True)


def _repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    _git(path, "init", "-q")
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    _git(path, "add", "-A")
    _git(path, "commit", "-qm", "init")
    return path


def _listing(dest: Path) -> set[str]:
    return {str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir() or p.is_symlink()}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = _repo(
        tmp_path / "project",
        {
            "pkg/__init__.py": "",
            "pkg/run.sh": "#!/bin/sh\n",
            ".gitignore": "*.log\n",
            "data/table.csv": "a,b\n",
        },
    )
    (root / "pkg" / "run.sh").chmod(0o775)
    (root / "pkg" / "mod.py").write_text("X = 1\n")  # untracked, not ignored
    (root / ".env").write_text("TOKEN=sekrit\n")
    (root / "deploy.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    (root / "debug.log").write_text("ignored\n")
    old_run = root / "outputs" / "old"
    (old_run / "checkpoints").mkdir(parents=True)
    (old_run / ".wf_launch.lock").write_text("1 h\n")
    (old_run / "checkpoints" / "model.pt").write_bytes(b"\0" * 100)
    (old_run / "code" / "SNAPSHOT.json").parent.mkdir()
    (old_run / "code" / "SNAPSHOT.json").write_text("{}")
    return root


def test_tracked_files_only_by_default_with_owner_only_modes(project: Path, tmp_path: Path) -> None:
    dest = tmp_path / "run" / "code"
    dest.parent.mkdir()
    manifest = take(dest, project)
    assert _listing(dest) == {
        "pkg/__init__.py",
        "pkg/run.sh",
        ".gitignore",
        "data/table.csv",
        "SNAPSHOT.json",
    }
    assert manifest["untracked_left_out"] >= 2 and manifest["untracked"] is False
    assert stat.S_IMODE(dest.stat().st_mode) == 0o700
    assert stat.S_IMODE((dest / "pkg" / "run.sh").stat().st_mode) == 0o700
    assert stat.S_IMODE((dest / "data" / "table.csv").stat().st_mode) == 0o600


def test_untracked_files_when_asked_but_never_secrets_or_earlier_runs(
    project: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "code"
    (project / "pkg" / ".env.local").write_text("K=V\n")
    _git(project, "add", "-f", "pkg/.env.local")  # a tracked secret is left out too
    manifest = take(dest, project, untracked=True)
    listing = _listing(dest)
    assert "pkg/mod.py" in listing
    assert not {".env", "deploy.pem", "pkg/.env.local", "debug.log"} & listing
    assert not [p for p in listing if p.startswith("outputs/")], listing
    assert {".env", "deploy.pem", "pkg/.env.local"} <= set(manifest["excluded"])


def test_links_inside_are_resolved_and_links_out_are_refused(project: Path, tmp_path: Path) -> None:
    os.symlink("../data/table.csv", project / "pkg" / "table_link.csv")
    os.symlink("../data", project / "pkg" / "data_dir")
    _git(project, "add", "pkg")
    dest = tmp_path / "code"
    take(dest, project)
    link = dest / "pkg" / "table_link.csv"
    assert link.is_file() and not link.is_symlink() and link.read_text() == "a,b\n"
    assert (dest / "pkg" / "data_dir").is_symlink()
    assert (dest / "pkg" / "data_dir").resolve() == (dest / "data").resolve()

    os.symlink("/etc/passwd", project / "pkg" / "escape")
    _git(project, "add", "pkg/escape")
    with pytest.raises(
        SnapshotError, match=r"pkg/escape is a link out of the checkout \(/etc/passwd"
    ):
        take(tmp_path / "code2", project)
    assert not (tmp_path / "code2").exists() and not list(tmp_path.glob(".code2.tmp-*"))


def test_a_snapshot_over_the_cap_is_refused_with_the_biggest_files_named(
    project: Path, tmp_path: Path
) -> None:
    (project / "data" / "big.bin").write_bytes(os.urandom(3 << 20))
    _git(project, "add", "data/big.bin")
    with pytest.raises(
        SnapshotError,
        match=r"would copy 3\.0 MB in \d+ files, more than "
        r"launcher\.snapshot_max_mb=1; the largest: data/big\.bin \(3\.0 MB\)",
    ):
        take(tmp_path / "code", project, max_bytes=1 << 20)
    assert not (tmp_path / "code").exists()
    assert take(tmp_path / "code", project, max_bytes=4 << 20)["files"] == 5


def test_submodules_are_copied_when_checked_out_and_named_when_not(tmp_path: Path) -> None:
    lib = _repo(tmp_path / "lib", {"lib.py": "Y = 2\n"})
    root = _repo(tmp_path / "project", {"main.py": ""})
    _git(root, "submodule", "add", "-q", str(lib), "vendor/lib")
    _git(root, "commit", "-qm", "submodule")
    manifest = take(tmp_path / "code", root)
    assert (tmp_path / "code" / "vendor" / "lib" / "lib.py").read_text() == "Y = 2\n"
    assert manifest["submodules_missing"] == []

    clone = tmp_path / "clone"
    subprocess.run(
        [*GIT, "clone", "-q", str(root), str(clone)], check=True, capture_output=True
    )  # not checked out
    manifest = take(tmp_path / "code2", clone)
    assert manifest["submodules_missing"] == ["vendor/lib"]
    assert json.loads((tmp_path / "code2" / "SNAPSHOT.json").read_text())["submodules_missing"] == [
        "vendor/lib"
    ]
