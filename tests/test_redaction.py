"""Secrets in a config stay out of readable places (issue 29, item 9): tracker parameters, printed
commands and the tune's record of its command show a secret-looking value as ``***``, and the
default MLflow store beside a run is owner-only."""

from __future__ import annotations

from pathlib import Path

import pytest

from wf_launch.config.redact import is_secret, redact_config, redact_overrides
from wf_launch.rank.trackers import open_trackers
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
