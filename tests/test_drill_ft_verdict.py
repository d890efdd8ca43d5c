"""The ft drill's printed verdict: a failing one names every recovery (a flake explains itself)."""

from __future__ import annotations

from typing import Any

from wf_launch.drivers.drill_ft import render


def _summary(ok: bool) -> dict[str, Any]:
    recoveries = [
        {
            "replica": 1,
            "rank": 0,
            "cause": "SIGKILL",
            "failed_at_step": 4,
            "rejoined_at_step": 5,
            "healed_from": 0,
            "seconds_to_rejoin": 1.2,
        },
        {
            "replica": 0,
            "rank": 0,
            "cause": "exit 1",
            "failed_at_step": 14,
            "rejoined_at_step": 0,
            "healed_from": None,
            "seconds_to_rejoin": 1.4,
        },
    ]
    return {
        "ok": ok,
        "checks": {"runs_ok": True, "survivors_never_restarted": ok},
        "atol": 0.05,
        "final_loss": {"reference": 1.9, "interrupted": 1.9, "abs_diff": 0.0},
        "seconds_to_rejoin": [1.2, 1.4],
        "survivor_steps_lost": 0,
        "failed_replica_steps_missed": [1, -14],
        "recoveries": recoveries,
    }


def test_a_failing_verdict_names_each_recovery_and_how_it_came_back() -> None:
    text = render(_summary(ok=False))
    assert "ft drill: FAIL" in text and "FAIL survivors_never_restarted" in text
    killed = "recovery: replica 1 rank 0 (SIGKILL) failed at step 4, back at step 5 healed from"
    assert f"{killed} replica 0" in text
    assert "recovery: replica 0 rank 0 (exit 1) failed at step 14, back at step 0 (no heal)" in text


def test_a_passing_verdict_stays_short() -> None:
    text = render(_summary(ok=True))
    assert text.startswith("ft drill: PASS") and "recovery:" not in text
