"""Regenerate the sample outputs in the docs from real runs: ``python scripts/doc_samples.py
[--list] [ID ...]``.

A sample is a fenced block right after a ``<!-- sample: ID -->`` line in a doc; :data:`SAMPLES` says
which commands it shows and which of their output lines it keeps. Each command runs here, in a
scratch directory (so run directories read ``outputs/DATE/TIME-ID``), and the block is replaced by
``$ COMMAND`` and the lines kept (a ``...`` where lines were left out). tests/test_docs_commands.py
checks that every sample agrees with its command and that every command still runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
Keep = Callable[[list[str]], list[str]]


def first_last(first: int, last: int) -> Keep:
    def keep(lines: list[str]) -> list[str]:
        return lines if len(lines) <= first + last else [*lines[:first], "...", *lines[-last:]]

    return keep


def from_line(pattern: str, last: int | None = None) -> Keep:
    def keep(lines: list[str]) -> list[str]:
        start = next((i for i, line in enumerate(lines) if re.search(pattern, line)), 0)
        kept = lines[start:] if last is None else lines[start : start + last]
        return (["..."] if start else []) + kept

    return keep


def matching(*patterns: str) -> Keep:
    def keep(lines: list[str]) -> list[str]:
        out: list[str] = []
        for line in lines:
            if any(re.search(p, line) for p in patterns):
                out.append(line)
            elif out and out[-1] != "...":
                out.append("...")
        return out[:-1] if out and out[-1] == "..." else out

    return keep


@dataclass
class Sample:
    """Commands shown in one block; ``keep`` trims each one's output; ``interrupt_after``: Ctrl-C
    after that many seconds of the first command (the Ctrl-C sample)."""

    doc: str
    commands: list[str]
    keep: Keep = field(default=lambda lines: lines)
    interrupt_after: float | None = None
    env: dict[str, str] = field(default_factory=dict)


SAMPLES: dict[str, Sample] = {
    "guide-quickstart": Sample("docs/guide.md", ["python -m wf_launch"], first_last(1, 2)),
    "guide-config-errors": Sample(
        "docs/guide.md",
        [
            "python -m wf_launch engine.cp_size=0",
            "python -m wf_launch engine.cp_size=5",
            "python -m wf_launch engine.cp_sise=2",
            "python -m wf_launch task=trian",
            "python -m wf_launch engine.pp_size=two",
        ],
    ),
    "guide-failed-alike": Sample(
        "docs/guide.md",
        [
            "python -m wf_launch task=fail_alike 'task.modules=[wf_identity_tasks]' "
            "engine.dp_size=8 'task.odd=[5]'"
        ],
        from_line(r"run failed in"),
        env={"PYTHONPATH": str(REPO / "tests" / "user_tasks")},
    ),
    "guide-ctrl-c": Sample(
        "docs/guide.md",
        ["python -m wf_launch task=train engine.dp_size=2 task.steps=200 task.checkpoint_every=50"],
        matching(
            "launching", "Ctrl-C", "stop agreed", "run interrupted", "interrupted by", "continue it"
        ),
        interrupt_after=12.0,
    ),
    "checkpointing-drill": Sample(
        "docs/checkpointing.md",
        [
            "python -m wf_launch.drill task=train engine.cp_size=2 engine.dp_size=2 task.steps=28 "
            "task.checkpoint_every=4 "
            "--inject kill9@6,sigterm@10"
        ],
        from_line(r"^drill: interrupted run"),
    ),
    "tracking-resume": Sample(
        "docs/tracking.md",
        [
            "python -m wf_launch.drill task=train engine.dp_size=2 task.steps=20 "
            "task.checkpoint_every=4 "
            "tracking=[tensorboard,mlflow,wandb] --inject kill9:0@6,sigterm@12"
        ],
        from_line(r"^drill verdict"),
        env={"WANDB_MODE": "offline"},
    ),
}


def run(command: str, cwd: Path, sample: Sample) -> list[str]:
    env = {**os.environ, "COLUMNS": "110", **sample.env}
    if "PYTHONPATH" in sample.env and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = f"{sample.env['PYTHONPATH']}{os.pathsep}{os.environ['PYTHONPATH']}"
    argv = shlex.split(command)
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    if sample.interrupt_after is not None:
        time.sleep(sample.interrupt_after)
        os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=900)
    return [line.rstrip() for line in out.replace(str(cwd) + "/", "").splitlines() if line.strip()]


def render(sample: Sample, scratch: Path) -> list[str]:
    lines: list[str] = []
    for command in sample.commands:
        lines += [f"$ {command}", *sample.keep(run(command, scratch, sample))]
    return lines


def replace_block(doc: Path, key: str, lines: list[str]) -> None:
    text = doc.read_text().splitlines()
    marker = text.index(f"<!-- sample: {key} -->")
    start = marker + 1
    if not text[start].startswith("```"):
        raise SystemExit(f"{doc}: a fenced block must follow <!-- sample: {key} -->")
    end = next(i for i in range(start + 1, len(text)) if text[i].startswith("```"))
    doc.write_text("\n".join([*text[: start + 1], *lines, *text[end:]]) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "ids", nargs="*", help=f"samples to regenerate (default: all of {sorted(SAMPLES)})"
    )
    ap.add_argument(
        "--list", action="store_true", help="list the samples and their commands, run nothing"
    )
    args = ap.parse_args(argv)
    chosen = args.ids or sorted(SAMPLES)
    unknown = [k for k in chosen if k not in SAMPLES]
    if unknown:
        print(f"doc_samples: no sample {unknown[0]!r}; known: {sorted(SAMPLES)}", file=sys.stderr)
        return 2
    for key in chosen:
        sample = SAMPLES[key]
        if args.list:
            print(f"{key} ({sample.doc}): " + " ; ".join(sample.commands))
            continue
        with tempfile.TemporaryDirectory(prefix="wf-doc-sample-") as scratch:
            lines = render(sample, Path(scratch))
        replace_block(REPO / sample.doc, key, lines)
        print(f"{key}: {len(lines)} lines into {sample.doc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
