"""Checkpoint tools against hostile outputs and crafted checkpoints (issue 29, items 3-6 and the
``list | head`` of item 11): one line and exit 2 where something is refused, never a traceback,
a hang, a read outside the step directory, or a special file replaced."""

from __future__ import annotations

import json
import os
import pickle
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from wf_launch.checkpoint import Checkpointer, complete_checkpoints
from wf_launch.rank.checkpoint.safe_read import CheckpointRefused, read_metadata
from wf_launch.readers.checkpoint import main
from wf_launch.rundir.checkpoints import CheckpointUnreadable


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


# ------------------------------------------------------------------ items 4-6: crafted checkpoints
def _metadata(step_dir: Path) -> Any:
    """The step's metadata, read with plain pickle: the test wrote it, so it is trusted here."""
    return pickle.loads((step_dir / ".metadata").read_bytes())


def _rewrite(step_dir: Path, change: Callable[[Any], None]) -> None:
    md = _metadata(step_dir)
    change(md)
    (step_dir / ".metadata").write_bytes(pickle.dumps(md))


def _retarget(path: str) -> Callable[[Any], None]:
    def change(md: Any) -> None:
        for info in md.storage_data.values():
            info.relative_path = path

    return change


def _first_item(**fields: Any) -> Callable[[Any], None]:
    def change(md: Any) -> None:
        info = next(iter(md.storage_data.values()))
        for key, value in fields.items():
            setattr(info, key, value)

    return change


def _first_tensor_size(size: tuple[int, ...]) -> Callable[[Any], None]:
    def change(md: Any) -> None:
        next(iter(md.state_dict_metadata.values())).size = torch.Size(size)

    return change


@pytest.mark.parametrize(
    "change, words",
    [
        ("victim", "only files directly in"),
        (_retarget("../step_00000001/__0_0.distcp"), "only files directly in"),
        ("fifo", "not a regular file"),
        ("zero", "not a regular file"),
        (_first_item(offset=1 << 40), "offset+length"),
        (_first_item(length=-5), "offset/length"),
        (_first_item(length="12"), "offset/length"),
        (_first_tensor_size((1 << 21, 1 << 21)), "more than the files hold"),
        (_first_tensor_size((-3, 4)), "dtype/size"),
    ],
)
def test_metadata_reads_only_inside_its_step_directory(
    tmp_path: Path, change: Any, words: str, export: Callable[..., tuple[int, str]]
) -> None:
    victim = tmp_path / "victim"
    _save(victim, 1, 42.0)
    bait = tmp_path / "bait"
    _save(bait, 1, 1.0)
    step_dir = _save(bait, 2, 2.0)
    [distcp] = list(step_dir.glob("*.distcp"))
    if change == "victim":
        change = _retarget(str(next((victim / "checkpoints").glob("step_*/*.distcp"))))
    elif change in ("fifo", "zero"):
        distcp.unlink()
        os.mkfifo(distcp) if change == "fifo" else distcp.symlink_to("/dev/zero")
        change = _first_item()
    _rewrite(step_dir, change)
    out = tmp_path / "out.pt"
    _one_line_refusal(export(bait, out, "--step", "2"), words)
    assert not out.exists()


def test_resume_and_export_skip_a_step_with_bad_metadata_for_the_newest_good(
    tmp_path: Path, export: Callable[..., tuple[int, str]]
) -> None:
    _save(tmp_path, 1, 1.0)
    _rewrite(_save(tmp_path, 2, 2.0), _first_item(length=1 << 50))
    model = Net(0.0)
    assert Checkpointer(tmp_path).load({"model": model}) == 1
    assert torch.equal(model.body.weight, torch.full_like(model.body.weight, 1.0))
    code, err = export(tmp_path, tmp_path / "m.pt")
    assert code == 0 and "skipped step 2" in err and "offset+length" in err, err
    assert torch.load(tmp_path / "m.pt", weights_only=True)["body.weight"][0, 0] == 1.0


def _pickle_ops(*parts: bytes) -> bytes:
    return b"\x80\x02" + b"".join(parts) + b"."


def test_a_small_metadata_cannot_grow_into_gigabytes(tmp_path: Path) -> None:
    """Nested path objects double a string at every level (12 KB became 5.3 GB in 31 s)."""
    ops = [b"cpathlib\nPurePosixPath\nq\x00", b"X\x00\x04\x00\x00" + b"a" * 1024 + b"q\x01"]
    for i in range(1, 13):  # 4 MiB at the end here; 30 levels would be 1 TiB
        ops.append(b"h\x00h" + bytes([i]) + b"h" + bytes([i]) + b"\x86R" + b"q" + bytes([i + 1]))
    step_dir = _save(tmp_path, 1, 1.0)
    (step_dir / ".metadata").write_bytes(_pickle_ops(*ops))
    with pytest.raises(CheckpointUnreadable, match="longer than 4096 characters"):
        read_metadata(step_dir)


def test_metadata_cannot_change_a_class_for_the_whole_process(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    before = dict(vars(_StorageInfo))
    step_dir = _save(tmp_path, 1, 1.0)
    (step_dir / ".metadata").write_bytes(
        _pickle_ops(
            b"ctorch.distributed.checkpoint.filesystem\n_StorageInfo\n",
            b"N}X\x0c\x00\x00\x00__getstate__cbuiltins\nfrozenset\ns\x86b",
        )
    )
    try:
        with pytest.raises(CheckpointRefused, match="BUILD on a class"):
            read_metadata(step_dir)
        assert dict(vars(_StorageInfo)) == before
    finally:
        for key in set(vars(_StorageInfo)) - set(before):
            delattr(_StorageInfo, key)
    _save(tmp_path, 2, 2.0)  # a later save still works


@pytest.mark.parametrize(
    "commit",
    [
        '{"step": 2, "world_size": 1, "seq": 1e999}',
        '{"step": 2, "world_size": 1, "seq": 5, "time": ' + "9" * 400 + "}",
        '{"step": 2, "world_size": 1, "layout": ' + "[" * 200_000 + "]" * 200_000 + "}",
        '{"step": "2", "world_size": 1}',
        '{"step": 2, "world_size": -1}',
        '{"step": 2, "world_size": 1, "entries": 7}',
    ],
)
def test_a_malformed_commit_is_named_and_skipped(
    tmp_path: Path, commit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path, 1, 1.0)
    (_save(tmp_path, 2, 2.0) / "COMMIT").write_text(commit)
    assert main(["list", str(tmp_path), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert "problem" in rows[2] and "COMMIT" in rows[2]["problem"]
    model = Net(0.0)
    assert Checkpointer(tmp_path).load({"model": model}) == 1
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 0
    assert "skipped step 2" in capsys.readouterr().err
