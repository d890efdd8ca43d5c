"""The tuner on ``task=train``: end to end, and train's memory estimate against the measured peak
(RSS on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_helpers import cli_env

from wf_launch.tasks.train import TrainConfig
from wf_launch.tasks.train_memory import CPU_RUNTIME_GB

MODEL = {"hidden": 384, "depth": 3, "mlp_ratio": 2, "frames": 2, "height": 16, "width": 16}
"""Big enough that the model, its optimizer state and activations outweigh the runtime, small enough
for seconds."""


def test_estimate_follows_the_layout() -> None:
    cfg = TrainConfig(**MODEL)

    def est(**sizes: int) -> float:
        return cfg.estimate_memory_gb(
            {"tp": 1, "cp": 1, "pp": 1, "dp": 1, "device": "cpu", **sizes}
        )

    assert est(dp=4) < est(dp=2) < est()  # FSDP2 shards the state over dp x cp
    assert est(cp=2) < est() and est(pp=3) < est(pp=1)  # CP splits the tokens, PP the blocks
    assert est(tp=2) == est()  # train replicates over tp
    gpu = cfg.estimate_memory_gb({"tp": 1, "cp": 1, "pp": 1, "dp": 1, "device": "cuda"})
    assert gpu < est() - CPU_RUNTIME_GB  # device memory: no runtime, no host copies for the report
    more = TrainConfig(**{**MODEL, "micro_batches": 4})
    assert (
        more.estimate_memory_gb({"tp": 1, "cp": 1, "pp": 1, "dp": 1}) > est()
    )  # GPipe keeps every micro-batch
    fixed = TrainConfig(**{**MODEL, "global_batch": 8})  # batch 2: 4 micro-batches at dp1, 2 at dp2
    assert fixed.estimate_memory_gb(
        {"tp": 1, "cp": 1, "pp": 1, "dp": 1}
    ) == more.estimate_memory_gb({"tp": 1, "cp": 1, "pp": 1, "dp": 1})
    assert fixed.estimate_memory_gb({"tp": 1, "cp": 1, "pp": 1, "dp": 2, "device": "cpu"}) == est(
        dp=2
    )


def test_mem_gb_below_every_train_estimate_names_the_smallest(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch.tune",
            "task=train",
            "world_size=2",
            "--mem-gb",
            "0.1",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert (
        "--mem-gb 0.1 prunes every valid layout (4): the smallest estimate is 0.29" in proc.stderr
    )


@pytest.mark.slow
def test_estimate_is_within_30_percent_of_the_measured_peak(tmp_path: Path) -> None:
    group = tmp_path / "conf" / "mem_layout"
    group.mkdir(parents=True)
    layouts = {"dp2": {"dp_size": 2}, "cp2": {"cp_size": 2}, "pp2": {"pp_size": 2}}
    for name, sizes in layouts.items():
        (group / f"{name}.yaml").write_text(
            "# @package _global_\n" + yaml.safe_dump({"engine": sizes})
        )
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "-m",
            "task=train_peak",
            "task.modules=[wf_tune_tasks]",
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
            f"+mem_layout={','.join(layouts)}",
            "task.steps=2",
            *(f"task.{k}={v}" for k, v in MODEL.items()),
            "launcher.console_ranks=[]",
            f"hydra.sweep.dir={sweep}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    cfg = TrainConfig(**MODEL)
    for job, name in enumerate(layouts):
        result = json.loads((sweep / str(job) / "result.json").read_text())
        layout = result["layout"]
        assert layout[name[:2]] == 2, (name, layout)
        measured = result["results"]["0"]["peak_rss_gb"]  # the largest over the ranks
        estimate = cfg.estimate_memory_gb({**layout, "device": "cpu"})
        assert abs(estimate - measured) <= 0.3 * measured, (name, estimate, measured)
        assert estimate - CPU_RUNTIME_GB >= 0.4 * estimate, (
            name,
            estimate,
        )  # the model, not the runtime, dominates


@pytest.mark.slow
def test_tune_train_end_to_end(tmp_path: Path) -> None:
    d = tmp_path / "tune"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch.tune",
            "task=train",
            "world_size=2",
            "task.steps=12",
            "--warmup",
            "1",
            "--min-steps",
            "3",
            "--search",
            "halving",
            "--dir",
            str(d),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = json.loads((d / "tune.json").read_text())
    assert [p["verdict"]["status"] for p in state["space"]] == ["valid"] * 4  # tp2, cp2, pp2, dp2
    assert all(p["verdict"]["estimate_gb"] > CPU_RUNTIME_GB for p in state["space"])
    r0 = [m for m in state["measurements"] if m["round"] == 0]
    assert len(r0) == 4 and all(m["status"] == "ok" for m in r0)
    assert all(
        m["source"] == "tokens_per_step / steady step time"
        and m["value"] > 0
        and m["measured"] == 3
        for m in r0
    )
    assert state["winner"] in {p["id"] for p in state["space"]} and state["status"] == "done"
    best = yaml.safe_load((d / "best.yaml").read_text())
    assert best["command"].startswith(
        "python -m wf_launch task=train task.steps=12 engine.tp_size="
    )
    assert "winner:" in proc.stdout and "report:" in proc.stdout
