"""A full disk never loses the story (issue 29, item 10): a save that fails for want of space
leaves a record naming the full disk, ``status`` shows it, a resume on a disk still full says so
in one line, and a launcher that cannot write its own record still ends in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import cli_env, result, run_cli, run_python_m

from wf_launch.rundir import files
from wf_launch.rundir.record import RunRecord, Status
from wf_launch.rundir.space import release_space, reserve_space

TASKS = "task.modules=[wf_test_tasks]"


def _fill(path: Path, leave: int = 0) -> None:
    """Write ``path`` until the file system holding it has about ``leave`` bytes free."""
    info = os.statvfs(path.parent)
    size = max(0, info.f_bavail * info.f_frsize - leave)
    try:
        with open(path, "ab", buffering=0) as f:
            f.write(b"\0" * size)
            while not leave:
                f.write(b"\0" * 4096)
    except OSError:
        pass


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs (root only: mounting needs it)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _status(run_dir: Path) -> subprocess.CompletedProcess:
    return run_python_m(
        "wf_launch.status",
        [str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )


@pytest.mark.slow
def test_a_save_on_a_full_disk_names_it_and_a_resume_there_is_one_line(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    # room for one checkpoint (1.3 MB), not two, beside the launch's reserve (1 MiB)
    _fill(small_disk / "filler", leave=3 << 20)
    args = ["task=train", "task.checkpoint_every=1", "task.steps=4"]
    proc = run_cli(args, run_dir)
    assert proc.returncode == 1, proc.stderr[-3000:]
    failure = result(run_dir)["failure"]
    assert failure["type"] == "OSError", failure
    assert "[Errno 28] No space left on device" in failure["message"], failure
    assert str(run_dir / "checkpoints") in failure["message"], failure
    assert "checkpoint step 2 not saved" in failure["message"], failure
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step_00000001"], kept  # the partial one is gone, the complete one kept
    assert (run_dir / "checkpoints" / "step_00000001" / "COMMIT").is_file()
    shown = _status(run_dir)
    assert shown.returncode == 1 and "[Errno 28] No space left on device" in shown.stdout, shown

    _fill(small_disk / "filler2")  # still full when the run is resumed
    again = run_cli([*args, "launcher.resume=true"], run_dir)
    assert again.returncode != 0
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1, again.stderr
    assert lines[0].startswith(f"wf_launch: cannot write the run directory {run_dir}"), lines
    assert "[Errno 28]" in lines[0]
    shown = _status(run_dir)  # the run's own story is still the one shown
    assert "[Errno 28] No space left on device" in shown.stdout, shown


@pytest.mark.slow
def test_a_run_whose_rank_fills_the_disk_still_records_why(small_disk: Path) -> None:
    """The rank fills the disk before it fails: the room the launch kept at its claim takes the
    rank's failure record and the launcher's, so ``status`` tells the story."""
    run_dir = small_disk / "run"
    proc = run_cli(["task=misbehave", TASKS, "task.how=fill_disk", "task.rank=0"], run_dir)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Logging error in Loguru" not in proc.stderr
    assert "During handling of the above exception" not in proc.stderr
    # its failure record, written in the reserve, names the cause as any failure record does
    assert "failed first: ValueError: rank 0 refuses: bad batch 17" in proc.stderr
    assert "the disk is full: [Errno 28] No space left on device" in proc.stderr
    assert f"could not write {run_dir / 'result.json'}" not in proc.stderr
    record = result(run_dir)
    assert record["status"] == "failed" and record["failure"]["type"] == "ValueError", record
    assert not (run_dir / files.RESERVE).exists()  # freed for the record, then gone
    shown = _status(run_dir)
    assert shown.returncode == 1 and "rank 0 refuses: bad batch 17" in shown.stdout, shown


def test_a_record_with_no_room_at_all_is_returned_unwritten(small_disk: Path) -> None:
    """No reserve (a disk already full at the claim), and no room: ``finalize`` never raises; the
    launcher prints the record's ``unwritten`` reason as its last line."""
    run_dir = small_disk / "run"
    run_dir.mkdir()
    assert reserve_space(run_dir) and release_space(run_dir)
    _fill(small_disk / "filler")
    record = RunRecord.finalize(run_dir, Status.FAILED)
    assert record.unwritten is not None
    assert record.unwritten.startswith(f"could not write {run_dir / 'result.json'}")
    assert "[Errno 28]" in record.unwritten
    assert not (run_dir / "result.json").exists()
