"""Checkpoint tools against hostile outputs and crafted checkpoints (issue 29, items 3-6 and the
``list | head`` of item 11): one line and exit 2 where something is refused, never a traceback,
a hang, a read outside the step directory, or a special file replaced."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from wf_launch.checkpoint import Checkpointer, complete_checkpoints
from wf_launch.tools.checkpoint import main


class Net(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(value)


def _save(run: Path, step: int, value: float) -> Path:
    Checkpointer(run, keep=5).save(step, {"model": Net(value)})
    return dict((s, p) for s, p in complete_checkpoints(run))[step]


@pytest.fixture
def export(capsys: pytest.CaptureFixture[str]):
    """``python -m wf_launch.checkpoint export RUN --out OUT ...`` in this process: (code, err)."""

    def run(run_dir: Path, out: Path, *extra: str) -> tuple[int, str]:
        code = main(["export", str(run_dir), "--out", str(out), *extra])
        return code, capsys.readouterr().err

    return run


def _one_line_refusal(result: tuple[int, str], words: str) -> None:
    code, err = result
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ item 3: export --out
def test_export_never_replaces_a_special_file_nor_an_unasked_one(
    tmp_path: Path, export: Callable[..., tuple[int, str]]
) -> None:
    run = tmp_path / "run"
    _save(run, 2, 2.0)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _one_line_refusal(export(run, fifo), "not a regular file (refusing to replace it)")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    folder = tmp_path / "folder"
    folder.mkdir()
    _one_line_refusal(export(run, folder), "a directory (refusing to replace it)")
    assert folder.is_dir() and not list(tmp_path.glob("*.part")) and not list(folder.iterdir())
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere.pt")
    _one_line_refusal(export(run, link), "a symbolic link")
    assert not (tmp_path / "elsewhere.pt").exists()
    if os.geteuid() == 0:  # a character device of its own, standing in for /dev/null
        null = tmp_path / "null"
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        _one_line_refusal(export(run, null), "not a regular file")
        assert stat.S_ISCHR(os.lstat(null).st_mode)
    kept = tmp_path / "kept.pt"
    kept.write_bytes(b"mine")
    _one_line_refusal(export(run, kept), "exists (--force replaces it)")
    assert kept.read_bytes() == b"mine"
    assert export(run, kept, "--force")[0] == 0
    assert set(torch.load(kept, weights_only=True)) == {"body.weight", "body.bias"}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_export_into_an_unwritable_folder_is_one_line(
    tmp_path: Path, export: Callable[..., tuple[int, str]]
) -> None:
    run = tmp_path / "run"
    _save(run, 2, 2.0)
    _one_line_refusal(export(run, Path("/proc/wf_export.pt")), "--out /proc/wf_export.pt")
    (tmp_path / "file").write_text("")
    _one_line_refusal(export(run, tmp_path / "file" / "x.pt"), "Not a directory")


def test_list_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _save(run, 1, 1.0)
    proc = subprocess.run(  # `true` has exited (unread) before the listing is printed
        f"{sys.executable} -m wf_launch.checkpoint list --json {run} | true",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
