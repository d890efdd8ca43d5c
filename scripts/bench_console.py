"""How much a failed run prints when many ranks fail alike: this tree against a baseline tree, same
machine, same run.

Runs ``task=fail_alike`` (tests/user_tasks/wf_identity_tasks.py: every rank raises the same
ValueError at the same line) on N ranks with this checkout's code and, given ``--baseline DIR``
(another checkout, e.g. ``git worktree add /tmp/base 218f5b9``), with that one's, alternating, and
prints the console lines and tracebacks each prints, and their ratio.

    python scripts/bench_console.py [--ranks 8 64] [--baseline /tmp/base] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "user_tasks"


def console(tree: Path, ranks: int) -> tuple[int, int, int]:
    """(lines, tracebacks, exit code) of one failed launch's console, with ``tree``'s code."""
    with tempfile.TemporaryDirectory(prefix="wf-bench-console-") as tmp:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(tree), str(TASKS), os.environ.get("PYTHONPATH", "")]
            ),
        }
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "wf_launch",
                "task=fail_alike",
                "task.modules=[wf_identity_tasks]",
                f"engine.dp_size={ranks}",
                "launcher.oversubscribe=true",
                f"hydra.run.dir={tmp}/run",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,
            timeout=600,
        )
        text = proc.stdout + proc.stderr
        return (
            len(text.splitlines()),
            text.count("Traceback (most recent call last)"),
            proc.returncode,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to compare with")
    args = ap.parse_args()
    for ranks in args.ranks:
        lines, tracebacks, code = console(ROOT, ranks)
        text = (
            f"{ranks} ranks failing alike: {lines} console lines, "
            f"{tracebacks} traceback(s) (exit {code})"
        )
        if args.baseline is not None:
            base_lines, base_tbs, _ = console(args.baseline.resolve(), ranks)
            text += (
                f"; baseline {base_lines} lines, {base_tbs} traceback(s): "
                f"{lines / max(base_lines, 1):.2f}x the "
                "lines"
            )
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
