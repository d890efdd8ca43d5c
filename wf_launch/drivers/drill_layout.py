"""The drill across a layout change: ``--resume-with`` relaunches at another layout, ``--atol``
compares within a tolerance.

``python -m wf_launch.drill task=train engine.dp_size=4 --inject sigterm@6 --resume-with
'engine.dp_size=2 engine.cp_size=2'``

- Every relaunch of the interrupted run (after ``sigterm@`` locally; after ``usr2@`` on
  SLURM, where the drill cancels the requeued job once the stop was saved and submits
  again) adds the ``--resume-with`` overrides: the run resumes its newest checkpoint at
  the new layout.
- A run continued at another layout cannot be bitwise identical (float reductions run in
  another order), so the verdict compares within ``--atol`` (default :data:`DEFAULT_ATOL`
  with ``--resume-with``): rank 0's loss curve and final loss, and the final weights of
  every module entry (``model``, ``ema``) of both runs' last checkpoints (consolidated
  without a process group), printing the largest differences.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ..rank.checkpoint.safe_read import CheckpointRefused, read_metadata
from ..readers.checkpoint import consolidate, module_entries
from ..rundir import attempts
from ..rundir.checkpoints import CheckpointUnreadable, complete_checkpoints

__all__ = [
    "DEFAULT_ATOL",
    "RELAUNCHING",
    "compare_within",
    "parse_resume_with",
    "relaunch_overrides",
    "render_tolerance",
    "wait_for_saved_stop",
]

DEFAULT_ATOL = 1e-4
"""The tolerance of a drill across layouts unless ``--atol`` says otherwise (see
docs/checkpointing.md)."""
RELAUNCHING = {"local": "sigterm", "slurm": "usr2"}
"""The injection after which the drill relaunches the run (and so can change its layout), per
backend."""
_LARGEST = 5


def parse_resume_with(text: str | None, backend: str, kinds: list[str] | None) -> list[str]:
    """``--resume-with`` as a list of Hydra overrides; ``ValueError`` when it cannot apply."""
    if text is None:
        return []
    overrides = shlex.split(text)
    if not overrides:
        raise ValueError(
            "--resume-with: no override given (e.g. --resume-with 'engine.dp_size=2 "
            "engine.cp_size=2')"
        )
    if kinds is None or RELAUNCHING[backend] not in kinds:
        raise ValueError(
            f"--resume-with needs --inject with a {RELAUNCHING[backend]}@STEP: on the {backend} "
            "backend "
            f"that is the interruption after which the run is launched again (at the new layout)"
        )
    return overrides


def relaunch_overrides(overrides: list[str], resume_with: list[str]) -> list[str]:
    """The run's overrides with the keys ``resume_with`` sets replaced, then
    ``launcher.resume=true``."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in resume_with}
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in keys]
    return [*kept, *resume_with, "launcher.resume=true"]


def _curve_diff(
    ref: dict[str, Any], got: dict[str, Any]
) -> tuple[float | None, int | None, str | None]:
    a, b = ref.get("loss_curve"), got.get("loss_curve")
    if not (isinstance(a, list) and isinstance(b, list)) or not a:
        return None, None, "no loss_curve in rank 0's results"
    if len(a) != len(b):
        return None, None, f"the loss curves have {len(a)} and {len(b)} steps"
    diffs = [abs(float(x) - float(y)) for x, y in zip(a, b)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return diffs[worst], worst + 1, None


def _final_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


def _weights_diff(reference: Path, interrupted: Path) -> tuple[dict[str, Any], str | None]:
    """Per module entry: max abs difference and the largest ones, between both runs' final
    checkpoints."""

    ref, got = _final_checkpoint(reference), _final_checkpoint(interrupted)
    if ref is None or got is None or ref[0] != got[0]:
        return {}, (
            f"no checkpoint at the same final step in both runs (reference: {ref and ref[0]}, "
            f"interrupted: {got and got[0]}); task=train saves one with task.save_final=true"
        )

    out: dict[str, Any] = {}
    try:
        entries = module_entries(ref[1], read_metadata(ref[1]))
        for entry in entries:
            a, b = consolidate(ref[1], entry), consolidate(got[1], entry)
            if sorted(a) != sorted(b):
                return (
                    {},
                    f"entry {entry!r}: the runs' parameter names differ: "
                    f"{sorted(set(a) ^ set(b))[:5]}",
                )
            diffs = sorted(
                ((float((a[k].double() - b[k].double()).abs().max()), k) for k in a), reverse=True
            )
            out[entry] = {
                "max_abs": diffs[0][0] if diffs else 0.0,
                "largest": [[k, d] for d, k in diffs[:_LARGEST]],
            }
    except (CheckpointRefused, CheckpointUnreadable, OSError, ValueError) as exc:
        return {}, f"the final checkpoints could not be read: {exc}"
    return out, None


def compare_within(
    ref: dict[str, Any], got: dict[str, Any], reference: Path, interrupted: Path, atol: float
) -> dict[str, Any]:
    """Rank 0's loss curve, final loss and the final weights of both runs, against ``atol``."""
    curve, at_step, curve_problem = _curve_diff(ref, got)
    final = None
    if isinstance(ref.get("final_loss"), (int, float)) and isinstance(
        got.get("final_loss"), (int, float)
    ):
        final = abs(float(ref["final_loss"]) - float(got["final_loss"]))
    weights, weights_problem = _weights_diff(reference, interrupted)
    measured = [
        v for v in (curve, final, *(w["max_abs"] for w in weights.values())) if v is not None
    ]
    within = curve is not None and final is not None and all(v <= atol for v in measured)
    return {
        "atol": atol,
        "within": within,
        "loss_curve_max_abs": curve,
        "loss_curve_worst_step": at_step,
        "final_loss_abs": final,
        "weights": weights,
        "problems": [p for p in (curve_problem, weights_problem) if p],
    }


def render_tolerance(tol: dict[str, Any]) -> list[str]:
    """The tolerance verdict's lines: the verdict, then the largest differences."""
    word = "WITHIN TOLERANCE" if tol["within"] else "OUT OF TOLERANCE"
    compared = ["loss curve", "final_loss", *(f"{e} weights" for e in tol["weights"])]
    lines = [f"drill verdict: {word} (atol={tol['atol']:g}: {', '.join(compared)})"]

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    step = tol["loss_curve_worst_step"]
    at = f" (step {step})" if step else ""
    lines.append(
        f"  largest differences: loss curve {fmt(tol['loss_curve_max_abs'])}{at}, "
        f"final_loss {fmt(tol['final_loss_abs'])}"
    )
    for entry, w in tol["weights"].items():
        shown = ", ".join(f"{name} {fmt(d)}" for name, d in w["largest"])
        lines.append(f"    {entry}: max {fmt(w['max_abs'])}: {shown}")
    lines += [f"  not compared: {p}" for p in tol["problems"]]
    return lines


def wait_for_saved_stop(
    run_dir: Path, attempt: int, proc: Any, deadline: float, poll_s: float = 0.2
) -> bool:
    """Wait until attempt ``attempt`` of the run recorded how it ended (the stop was agreed and
    saved).

    False when the launch ended first or the deadline passed.
    """
    import time

    while time.monotonic() < deadline:
        ended = proc.poll() is not None
        if (attempts.read(run_dir, attempt) or {}).get("ended_by"):
            return True
        if ended:
            return False
        time.sleep(poll_s)
    return False
