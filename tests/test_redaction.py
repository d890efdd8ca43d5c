"""Secrets in a config stay out of readable places (issue 29, item 9): tracker parameters, printed
commands and the tune's record of its command show a secret-looking value as ``***``, and the
default MLflow store beside a run is owner-only."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli_env

from wf_launch.config.redact import is_secret, redact_config, redact_overrides, redact_text
from wf_launch.rank.trackers import open_trackers
from wf_launch.rundir.io import open_log
from wf_launch.rundir.resume import resume_command


@pytest.mark.parametrize(
    "key, secret",
    [
        ("task.kwargs.api_token", True),
        ("tracking.wandb.API_KEY", True),
        ("+task.kwargs.db_password", True),
        ("task.kwargs.aws_secret_access", True),
        ("task.kwargs.gcp_credentials", True),
        ("tracking.wandb.entity", False),
        ("engine.cp_size", False),
    ],
)
def test_secret_looking_keys(key: str, secret: bool) -> None:
    assert is_secret(key) is secret


def test_config_and_overrides_are_redacted_and_the_rest_kept() -> None:
    config = {"task": {"kwargs": {"api_token": "s3cr3t", "lr": 0.1, "keys": [{"key": "k"}]}}}
    assert redact_config(config) == {
        "task": {"kwargs": {"api_token": "***", "lr": 0.1, "keys": "***"}}
    }
    assert config["task"]["kwargs"]["api_token"] == "s3cr3t"  # the run still gets it
    assert redact_overrides(["task.kwargs.api_token=s3cr3t", "engine.dp_size=2"]) == [
        "task.kwargs.api_token=***",
        "engine.dp_size=2",
    ]


def test_a_printed_resume_command_never_shows_a_secret(tmp_path: Path) -> None:
    line = resume_command(tmp_path, ["task=call", "task.kwargs.api_token=s3cr3t"])
    assert "s3cr3t" not in line and "'task.kwargs.api_token=***'" in line


def test_trackers_get_the_config_redacted_and_mlflows_store_is_owner_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    config = {
        "task": {"name": "call", "kwargs": {"api_token": "s3cr3t"}},
        "tracking": {"mlflow": {"enabled": True}},
    }

    class Log:
        def __getattr__(self, name: str):
            return lambda *a, **k: None

    hub = open_trackers(config, run_dir, 0, "r1", 0, Log())
    assert hub is not None
    hub.close("ok")
    store = tmp_path / "mlruns"
    assert store.is_dir() and store.stat().st_mode & 0o777 == 0o700
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    run = client.get_run((run_dir / "tracking" / "mlflow.run").read_text().strip())
    assert run.data.params["task.kwargs.api_token"] == "***"
    found = [p for p in store.rglob("*") if p.is_file() and b"s3cr3t" in p.read_bytes()]
    assert found == []


@pytest.mark.parametrize(
    "text, shown",
    [
        ("#0 : task=call +task.kwargs.api_token=s3cr3t e=1", "+task.kwargs.api_token=*** e=1"),
        ("task.kwargs={'api_token': 's3cr3t'} is not allowed", "{'api_token': ***} is not"),
        ("['task.kwargs.db_password=\"s3cr3t\"', 'x=1']", "db_password=***', 'x=1']"),
        ('{"WANDB_API_KEY": "s3cr3t"}', '{"WANDB_API_KEY": ***}'),
    ],
)
def test_secret_assignments_in_text_are_redacted(text: str, shown: str) -> None:
    assert "s3cr3t" not in redact_text(text) and shown in redact_text(text)
    for kept in (
        "tracking.wandb.entity=me engine.dp_size=2",
        "KeyError: 'api_token'",
        "KeyboardInterrupt: stopped; token bucket: 3",
    ):
        assert redact_text(kept) == kept


def test_hydras_sweep_lines_and_config_errors_never_show_a_secret(tmp_path: Path) -> None:
    """Hydra logs every sweep point's overrides (a tune's ``rounds/r0.log``, a drill's log, the
    terminal), and a refused value is named in the error: neither shows the secret."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "-m",
            "task=call",
            "task.target=os.path:exists",
            "+task.kwargs.api_token=s3cr3t",
            "engine.dp_size=1,2",
            "launcher.dry_run=true",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert "#1 : " in out and "+task.kwargs.api_token=***" in out, out
    assert "{'api_token': ***}" in out  # the config error names the field, not the value
    assert "s3cr3t" not in out


_CRASHING_APP = """
import sys
import wf_launch.cli as cli

def _crash(cfg, hc, run_dir):
    raise RuntimeError("a bug in the launcher")

cli._launch = _crash  # the app itself crashes: Hydra prints the job's overrides
sys.argv[0] = "wf_launch"
cli.main()
"""


def test_hydras_crash_line_never_shows_a_secret(tmp_path: Path) -> None:
    """When the app itself raises, Hydra prints ``Error executing job with overrides: [...]``
    straight to stderr; the callback in the primary config has redacted them first."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CRASHING_APP,
            "task=call",
            "task.target=os.path:exists",
            "+task.kwargs.api_token=s3cr3t",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "RuntimeError: a bug in the launcher" in proc.stderr
    assert "Error executing job with overrides: [" in proc.stderr, proc.stderr
    assert "'+task.kwargs.api_token=***'" in proc.stderr and "s3cr3t" not in proc.stderr


def test_a_tool_log_is_owner_only_and_never_written_through_a_link(tmp_path: Path) -> None:
    """A tune round's and a drill run's console output go to ``open_log``: ``0600`` whatever the
    umask or the mode an older version left, and a link there is refused."""
    old = os.umask(0)
    try:
        fd = open_log(tmp_path / "r0.log")
        os.close(fd)
        older = tmp_path / "reference.log"
        older.write_text("x")
        older.chmod(0o644)
        os.close(open_log(older))
    finally:
        os.umask(old)
    assert (tmp_path / "r0.log").stat().st_mode & 0o777 == 0o600
    assert older.stat().st_mode & 0o777 == 0o600
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "linked.log").symlink_to(target)
    with pytest.raises(OSError) as caught:
        open_log(tmp_path / "linked.log")
    assert caught.value.errno == errno.ELOOP and target.read_text() == "keep"


def test_the_sweep_report_never_shows_a_secret(tmp_path: Path) -> None:
    """Each point's overrides appear in the report's tables and charts: a secret as ``***``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import fuzz_rundirs as fuzz

    from wf_launch.readers.sweep.points import collect_points
    from wf_launch.readers.sweep.tables import render_csv, render_markdown

    sweep = fuzz.build(tmp_path)["sweep"]
    for n in range(2):
        path = sweep / str(n) / "result.json"
        record = json.loads(path.read_text())
        record["overrides"] = [f"engine.dp_size={n + 1}", "+task.kwargs.api_token=s3cr3t"]
        path.write_text(json.dumps(record))
    points = collect_points(sweep)
    shown = render_csv(points, "tokens_per_s") + render_markdown(points, "tokens_per_s", sweep)
    assert "api_token=***" in shown and "s3cr3t" not in shown
