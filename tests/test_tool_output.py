"""What the run-reading tools write and print (issue 29, items 7, 11 and 12): never through a
link out of a run directory, never a raw byte of a file name, never 3,000 panels."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli_env, run_python_m

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fuzz_rundirs as fuzz

from wf_launch.rundir.io import UnreadableFile, atomic_write_json, read_json


def _tool(name: str, args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The tool as a user runs it, under the C locale (where Python writes undecodable bytes of
    a file name back raw: a \\x9b is an 8-bit CSI to the terminal)."""
    return subprocess.run(
        [sys.executable, "-m", f"wf_launch.{name}", *(os.fsencode(a) for a in args)],
        capture_output=True,
        env=cli_env({"LC_ALL": "C", "PYTHONIOENCODING": ""}),
        timeout=120,
        cwd=cwd,
    )


def _no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert b"Traceback" not in proc.stderr, proc.stderr.decode(errors="replace")


def test_plot_never_writes_through_a_link(tmp_path: Path) -> None:
    run = fuzz.build(tmp_path)["ok"]
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    (run / "metrics.png").symlink_to(victim)
    proc = _tool("plot", [str(run)])
    assert proc.returncode == 0, proc.stderr
    assert victim.read_text() == "mine\n"
    assert not (run / "metrics.png").is_symlink()
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_status_tail_never_reads_through_a_link(tmp_path: Path) -> None:
    run = fuzz.build(tmp_path)["ok"]
    secret = tmp_path / "secret"
    secret.write_text("the private key\n")
    log = run / "logs" / "rank0.log"
    log.unlink()
    log.symlink_to(secret)
    proc = _tool("status", [str(run), "--tail", "5"])
    _no_traceback(proc)
    assert b"the private key" not in proc.stdout + proc.stderr
    assert b"symbolic link" in proc.stdout + proc.stderr


def test_a_link_in_place_of_a_runs_own_folder_is_never_followed(tmp_path: Path) -> None:
    """``logs/`` or ``checkpoints/`` swapped for a link: no tool reads or writes through it."""
    runs = fuzz.build(tmp_path)
    run, other = runs["ok"], tmp_path / "other"
    other.mkdir()
    (other / "rank0.log").write_text("the private key\n")
    shutil.rmtree(run / "logs")
    (run / "logs").symlink_to(other)
    (other / "checkpoints").mkdir()
    victim = other / "checkpoints"
    shutil.copytree(run / "checkpoints", victim, dirs_exist_ok=True)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(victim)
    shown = _tool("status", [str(run), "--tail", "5"])
    _no_traceback(shown)
    assert b"the private key" not in shown.stdout + shown.stderr
    assert b"is a symbolic link (refusing to follow it)" in shown.stdout + shown.stderr
    listed = _tool("checkpoint", ["list", str(run), "--json"])
    _no_traceback(listed)
    assert b"checkpoints is a symbolic link (refusing to follow it)" in listed.stdout
    out = tmp_path / "w.pt"
    exported = _tool("checkpoint", ["export", str(run), "--out", str(out)])
    assert exported.returncode != 0 and not out.exists(), exported.stderr
    with pytest.raises(OSError) as caught:
        atomic_write_json(run / "logs" / "attempt0.json", {"attempt": 0})
    assert caught.value.errno == errno.ELOOP
    assert sorted(p.name for p in other.iterdir()) == ["checkpoints", "rank0.log"]
    with pytest.raises(UnreadableFile, match="is a symbolic link"):
        read_json(run / "checkpoints" / "step_00000003" / "COMMIT")


def test_a_sweep_point_that_is_a_link_is_never_read(tmp_path: Path) -> None:
    """``SWEEP/1`` swapped for a link to another run: ``status SWEEP``, the report and ``runs``
    leave it out."""
    runs = fuzz.build(tmp_path)
    sweep, elsewhere = runs["sweep"], tmp_path / "elsewhere"
    shutil.copytree(runs["failed"], elsewhere)
    shutil.rmtree(sweep / "1")
    (sweep / "1").symlink_to(elsewhere)
    for name, args in (("status", [str(sweep)]), ("runs", [str(sweep.parent)])):
        proc = _tool(name, args)
        _no_traceback(proc)
        assert b"failed" not in proc.stdout, (name, proc.stdout)
        assert str(sweep / "0").encode() in proc.stdout, (name, proc.stdout)
    assert "elsewhere" not in (sweep / "sweep_summary.md").read_text()


def test_non_utf8_run_names_are_shown_escaped(tmp_path: Path) -> None:
    root = tmp_path / "outputs"
    odd = os.fsdecode(b"run\x9b31m\xff")
    run = fuzz.build(tmp_path)["ok"].rename(root / odd)
    for name, args in (
        ("runs", [str(root)]),
        ("runs", [str(root), "--json"]),
        ("status", [str(run)]),
        ("plot", [str(run)]),
    ):
        proc = _tool(name, args)
        _no_traceback(proc)
        assert proc.returncode == 0, (name, proc.stderr)
        assert b"\x9b" not in proc.stdout + proc.stderr, (name, proc.stdout)
        shown = b"run\\udc9b31m\\udcff" if "--json" in args else b"run\\x9b31m\\xff"
        if name != "plot":
            assert shown in proc.stdout, (name, proc.stdout)
    assert (run / "metrics.png").is_file()


def test_plot_caps_the_metrics_it_draws_and_says_so(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    row = {"rank": 0, "step": 1, **{f"m{i:04d}": float(i) for i in range(3000)}}
    (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    proc = _tool("plot", [str(run)])
    assert proc.returncode == 0, proc.stderr
    assert b"256+ metrics; drawing 16 (m0000, m0001" in proc.stderr
    assert b"name the metrics to draw others" in proc.stderr
    named = _tool("plot", [str(run), "m0007", "m0100"])
    assert named.returncode == 0 and named.stderr == b""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a directory owned by another user")
def test_a_launch_into_another_users_open_directory_is_one_line(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 65534, 65534)
    os.chmod(shared, 0o777)
    proc = run_python_m(
        "wf_launch",
        ["task=noop", f"hydra.run.dir={shared}"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "owned by uid 65534" in proc.stderr, proc.stderr
