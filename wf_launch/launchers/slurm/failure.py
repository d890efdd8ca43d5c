"""Why a SLURM job failed: what its ranks recorded, a rank that died without a record, or
SLURM's own word.

SLURM gives the launcher no exit code per rank, so a rank that was killed (``kill -9``, the OOM
killer, a crash) is known by what it did not leave: submitit writes every task's result file,
an exception included (``{job}_{task}_result.pkl``), and a rank's failure record is written
before it leaves; a rank that started and left neither died. Its peers' errors ("connection
reset by peer") are consequences, so it is named first, with srun's word on its task.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ...config.layout import rank_label, run_layout
from ...observe.rootcause import death_of, explain_failure, group_failures
from ...rundir import files
from ...rundir.failures import PEER_LOSS, load_failure_records
from ...rundir.io import open_regular

__all__ = ["explain_job_failure", "silent_ranks", "srun_word"]

_SRUN = re.compile(r"^srun: error: [^:]+: tasks? ([0-9,\-]+): (.+)$", re.M)
_ERR_TAIL = 65536
"""How much of the batch log's end is searched for srun's words on its tasks."""


def silent_ranks(run_dir: Path, job: dict[str, Any], world_size: int) -> list[int]:
    """Ranks that started (their log exists) and left neither a failure record nor a result
    file: they died."""
    folder, job_id = job.get("folder"), job.get("job_id")
    if not folder or not job_id:
        return []
    recorded = {r["rank"] for r in load_failure_records(run_dir)}
    return [
        rank
        for rank in range(world_size)
        if rank not in recorded
        and files.rank_log(run_dir, rank).exists()
        and not (Path(folder) / f"{job_id}_{rank}_result.pkl").exists()
    ]


def _tasks(text: str) -> set[int]:
    """srun's task list ('1', '0-3', '0,2-3') as task ids."""
    out: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            out.update(range(int(low), int(high or low) + 1))
    return out


def srun_word(job: dict[str, Any], rank: int) -> str | None:
    """What srun said of the rank's task ('Killed', 'Exited with exit code 3'), from the batch
    log; None when it said nothing."""
    path = Path(str(job.get("folder"))) / f"{job.get('job_id')}_0_log.err"
    try:
        with open(open_regular(path), "rb") as f:
            f.seek(max(0, f.seek(0, 2) - _ERR_TAIL))
            text = f.read().decode(errors="replace")
    except (OSError, ValueError):
        return None
    for tasks, word in _SRUN.findall(text):
        if rank in _tasks(tasks):
            return word.strip()
    return None


def explain_job_failure(
    run_dir: Path, job: dict[str, Any], state: str
) -> tuple[dict[str, Any], str]:
    """A failed job's failure (shaped for ``result.json``) and summary."""
    layout = run_layout(files.read_config(run_dir, strict=True))
    label = lambda r: rank_label(r, layout.coords(r))  # noqa: E731
    explained = explain_failure(run_dir, {}, label, layout.coords, layout.world_size)
    only_peers = explained is None or bool(PEER_LOSS.search(str(explained[0].get("message"))))
    silent = silent_ranks(run_dir, job, layout.world_size) if only_peers else []
    if silent:
        return _died(run_dir, job, silent[0], label, layout.coords)
    if explained is not None:
        return explained
    job_id = job.get("job_id")
    message = (
        f"SLURM job {job_id} ended {state} and no rank left a failure record; "
        f"see {job.get('folder')}/{job_id}_*_log.err"
    )
    cause = {"rank": -1, "cause": "slurm", "type": state.split()[0], "message": message}
    return cause, message


def _died(
    run_dir: Path, job: dict[str, Any], rank: int, label: Any, coords: Any
) -> tuple[dict[str, Any], str]:
    how = death_of(run_dir, rank)
    word = srun_word(job, rank)
    log = files.rank_log(run_dir, rank)
    lines = [f"rank {rank} ({label(rank)}) died: {how}"]
    if word:
        lines.append(f"  srun: task {rank}: {word}")
    lines.append(f"  log: {log}")
    for group in group_failures(load_failure_records(run_dir)):
        lines += group.describe(label, run_dir)
    cause = {
        "rank": rank,
        "cause": "died",
        "type": "RankDied",
        "message": f"rank {rank} died: {how}",
        "coords": coords(rank),
        "log": str(log),
    }
    if word:
        cause["srun"] = word
    return cause, "\n".join(lines)
