"""The run record: the one reader and writer of result.json, statuses and their exit codes."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from wf_launch.readers.sweep.points import UNREADABLE, collect_points
from wf_launch.readers.sweep.report import sweep_exit_code, write_report
from wf_launch.rundir.outcome import RunOutcome
from wf_launch.rundir.record import EXIT_CODES, RecordError, RunRecord, Status, exit_code_of


def test_every_status_has_one_exit_code() -> None:
    assert set(EXIT_CODES) == set(Status)
    assert [s for s in Status if not s.is_failure] == [Status.OK, Status.SUBMITTED, Status.DRY_RUN]
    assert exit_code_of(Status.INVALID) == 2 and exit_code_of("failed") == 1
    assert exit_code_of(Status.INTERRUPTED, "SIGTERM") == 128 + signal.SIGTERM
    assert exit_code_of(Status.INTERRUPTED) == 128 + signal.SIGINT
    assert RunOutcome(Status.TIMEOUT).exit_code == 124
    assert str(Status.DRY_RUN) == "dry_run" and Status("cancelled") is Status.CANCELLED


def test_rank0_record_then_launcher_finalize(tmp_path: Path) -> None:
    RunRecord(
        Status.OK,
        run_dir=str(tmp_path),
        task="demo",
        results={"0": {"summary": "all good", "x": 1}},
        timings={"ranks": {"0": {"init_s": 0.1}}},
        finished_at=1.0,
    ).write()
    first = RunRecord.read(tmp_path)
    assert (
        first is not None
        and not first.final
        and "exit_code" not in json.loads((tmp_path / "result.json").read_text())
    )
    final = RunRecord.finalize(
        tmp_path, Status.OK, launcher="local", timings={"wall_s": 2.5}, slurm={"job_id": "7"}
    )
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["status"] == "ok" and data["exit_code"] == 0 and data["launcher"] == "local"
    assert data["timings"] == {"ranks": {"0": {"init_s": 0.1}}, "wall_s": 2.5}
    assert data["slurm"] == {"job_id": "7"} and data["finished_at"] == 1.0
    assert final.summary == "all good"
    again = RunRecord.read(tmp_path)
    assert again is not None and again.final and again.extra == {"slurm": {"job_id": "7"}}
    assert again.to_json() == data


def test_failed_finalize_keeps_results_but_not_rank0_finish_time(tmp_path: Path) -> None:
    RunRecord(Status.OK, run_dir=str(tmp_path), results={"0": {}}, finished_at=1.0).write()
    rec = RunRecord.finalize(
        tmp_path,
        Status.INTERRUPTED,
        signal_name="SIGTERM",
        failure={"cause": "interrupt", "signal": "SIGTERM"},
    )
    assert rec.exit_code == 143 and rec.finished_at != 1.0
    assert json.loads((tmp_path / "result.json").read_text())["exit_code"] == 143


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{"status": "ok", "results": {"0"', "invalid JSON"),
        ("[1, 2]", "expected a JSON object, found list"),
        ('{"status": "great"}', "unknown status 'great'"),
        ('{"status": "ok", "results": [1]}', "field 'results' is a list"),
    ],
)
def test_unreadable_record_names_the_file(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / "result.json").write_text(text)
    with pytest.raises(RecordError) as err:
        RunRecord.read(tmp_path)
    assert str(tmp_path / "result.json") in str(err.value) and fragment in str(err.value)


def test_missing_record_is_none(tmp_path: Path) -> None:
    assert RunRecord.read(tmp_path) is None


def test_sweep_report_lists_an_unreadable_point_and_goes_on(tmp_path: Path) -> None:
    for job, status in ((0, Status.OK), (1, None), (2, Status.FAILED)):
        job_dir = tmp_path / str(job)
        job_dir.mkdir()
        if status is None:
            (job_dir / "result.json").write_text('{"status": "ok", "resu')
        else:
            RunRecord.finalize(job_dir, status, results={"0": {"tokens_per_s": 10.0 + job}})
    points = collect_points(tmp_path)
    assert [p["status"] for p in points] == ["ok", UNREADABLE, "failed"]
    assert str(tmp_path / "1" / "result.json") in points[1]["failure"]
    written = write_report(tmp_path, points, chart=False)
    assert "unreadable" in written["md"].read_text()
    assert sweep_exit_code(points[:2]) == 1


def test_records_carry_the_format_version_and_old_ones_still_read(tmp_path: Path) -> None:
    from wf_launch.rundir.files import FORMAT_VERSION

    RunRecord(Status.OK, run_dir=str(tmp_path), task="noop", results={"0": {}}).write()
    written = json.loads((tmp_path / "result.json").read_text())
    assert written["format_version"] == FORMAT_VERSION >= 1
    assert RunRecord.read(tmp_path).format_version == FORMAT_VERSION
    old = {
        "status": "ok",
        "exit_code": 0,
        "task": "demo",
        "results": {"0": {"ok": True}},
    }  # before versions
    (tmp_path / "result.json").write_text(json.dumps(old))
    record = RunRecord.read(tmp_path)
    assert record.format_version == 0 and record.final and record.results == {"0": {"ok": True}}
    assert "format_version" not in record.extra
    record.write(tmp_path)
    assert json.loads((tmp_path / "result.json").read_text())["format_version"] == FORMAT_VERSION
    (tmp_path / "result.json").write_text(json.dumps({**old, "format_version": "one"}))
    with pytest.raises(RecordError, match="format_version 'one' is not a version number"):
        RunRecord.read(tmp_path)


@pytest.mark.parametrize(
    ("exits", "cause"),
    [
        # the agent SIGTERMs the survivors of a kill -9: the killed rank is the cause, whatever
        # its number
        ({0: -signal.SIGTERM, 1: -signal.SIGKILL}, "rank 1 killed by SIGKILL"),
        # a rank that raised (exit 1) explains the ranks the agent stopped after it
        ({0: -signal.SIGTERM, 2: 1, 3: -signal.SIGTERM}, "rank 2 exited with code 1"),
        ({3: 1, 1: 7}, "rank 1 exited with code 7"),
        ({2: -signal.SIGTERM, 1: -signal.SIGTERM}, "rank 1 killed by SIGTERM"),
        ({}, "failed"),
    ],
)
def test_the_rank_that_explains_an_attempt_is_not_one_the_agent_stopped(
    exits: dict[int, int], cause: str
) -> None:
    from wf_launch.rundir.attempts import cause_of_exits

    assert cause_of_exits(exits) == cause
