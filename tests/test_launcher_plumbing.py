"""Without a cluster: the SLURM batch scope, the offline sweep expansion, and ``python -m
wf_launch.status`` finding a third-party detached launcher's runs through their config.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from wf_launch.launchers import DetachedLauncher, LauncherConfig, get_launcher, register_launcher
from wf_launch.launchers.slurm import SlurmBatch, current_batch
from wf_launch.readers import status
from wf_launch.readers.sweep.points import expand_sweep
from wf_launch.rundir.outcome import RunOutcome
from wf_launch.rundir.record import RunRecord, Status


def test_batch_scope_is_set_and_reset() -> None:
    assert current_batch() is None
    outer, inner = SlurmBatch(Path("/tmp/a")), SlurmBatch(Path("/tmp/b"))
    with outer.collecting():
        assert current_batch() is outer
        with inner.collecting():
            assert current_batch() is inner
        assert current_batch() is outer
    assert current_batch() is None


def test_an_exception_drops_what_the_batch_prepared() -> None:
    batch = SlurmBatch(Path("/tmp/a"))
    with pytest.raises(KeyboardInterrupt), batch.collecting():
        batch.add(object())  # type: ignore[arg-type]
        assert len(batch) == 1
        raise KeyboardInterrupt
    assert len(batch) == 0 and not batch and current_batch() is None


@pytest.mark.parametrize(
    "args, jobs",
    [
        (
            ["a=1,2", "b=x,y", "c=3"],
            [
                ["a=1", "b=x", "c=3"],
                ["a=1", "b=y", "c=3"],
                ["a=2", "b=x", "c=3"],
                ["a=2", "b=y", "c=3"],
            ],
        ),
        (
            ["a=1", "b=2,3", "a=7,8"],
            [["a=7", "b=2"], ["a=7", "b=3"], ["a=8", "b=2"], ["a=8", "b=3"]],
        ),
        (
            ["engine.cp_size=range(1,3)", "+x=choice(p,q)"],
            [
                ["engine.cp_size=1", "+x=p"],
                ["engine.cp_size=1", "+x=q"],
                ["engine.cp_size=2", "+x=p"],
                ["engine.cp_size=2", "+x=q"],
            ],
        ),
        (
            ["a='x,y'", "~b", "++c=1,2"],
            [["a='x,y'", "~b=null", "++c=1"], ["a='x,y'", "~b=null", "++c=2"]],
        ),
        ([], [[]]),
    ],
)
def test_expand_sweep_as_the_basic_sweeper(args: list[str], jobs: list[list[str]]) -> None:
    assert expand_sweep(OverridesParser.create().parse_overrides(args)) == jobs


def test_expand_sweep_refuses_an_interval() -> None:
    with pytest.raises(ValueError, match="not a discrete sweep"):
        expand_sweep(OverridesParser.create().parse_overrides(["a=interval(0,1)"]))


@dataclass
class _QueueConfig(LauncherConfig):
    name: str = "toyqueue"


@register_launcher
class _ToyQueue:
    """A third-party detached launcher: its 'scheduler' is a file in the run directory."""

    name: ClassVar[str] = "toyqueue"
    config_class: ClassVar[type[LauncherConfig]] = _QueueConfig
    cancelled: ClassVar[list[Path]] = []

    def validate(self, cfg: dict[str, Any], layout: Any, engine: dict[str, Any]) -> None: ...
    def describe(self, plan: Any) -> str:
        return "toy"

    def launch(self, plan: Any) -> RunOutcome:
        return RunOutcome(Status.SUBMITTED, plan.run_dir)

    def status(self, run_dir: Path) -> tuple[str, RunOutcome | None]:
        state = (run_dir / "toy_state").read_text()
        if state == "DONE":
            return state, RunOutcome.of(RunRecord.finalize(run_dir, Status.OK), run_dir, "")
        return state, None

    def cancel(self, run_dir: Path) -> str | None:
        self.cancelled.append(run_dir)
        return "toy-1"


def _run_dir(path: Path, launcher: str, state: str) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"launcher": {"name": launcher}}))
    (path / "toy_state").write_text(state)
    return path


def test_status_finds_a_third_party_detached_launchers_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert isinstance(get_launcher("toyqueue"), DetachedLauncher)
    sweep = tmp_path / "sweep"
    done = _run_dir(sweep / "0", "toyqueue", "DONE")
    running = _run_dir(sweep / "1", "toyqueue", "RUNNING")
    _run_dir(sweep / "2", "local", "n/a")  # not detached: not listed
    assert status.main([str(done)]) == 0
    assert f"{done}: toyqueue run DONE -> ok (exit 0)" in capsys.readouterr().out
    assert RunRecord.read(done).status is Status.OK
    assert status.main([str(sweep), "--cancel", "--timeout", "0.1"]) == 0
    out = capsys.readouterr()
    assert f"{running}: toyqueue run RUNNING" in out.out and f"{sweep / '2'}" not in out.out
    assert _ToyQueue.cancelled == [done, running]
    assert f"cancelling toyqueue run ({running})" in out.err


def test_status_of_local_runs_and_of_directories_without_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    _run_dir(run, "local", "n/a")  # no record and no live launcher: it ended without one
    assert status.main([str(run)]) == 3
    assert f"{run}: local run ended -> unknown (exit 3)" in capsys.readouterr().out
    assert status.main([str(run), "--cancel"]) == 2
    assert "no detached run in" in capsys.readouterr().err
    (run / "result.json").write_text('{"status": "ok", "exit_co')  # truncated
    assert status.main([str(run)]) == 0
    assert f"{run}: unreadable: " in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert status.main([str(tmp_path / "empty")]) == 2
    assert "no run in" in capsys.readouterr().err
