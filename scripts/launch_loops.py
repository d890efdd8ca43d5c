"""Launch wf_launch over and over and count the launches that fail or stall.

Two loops:

* ``--runs N`` sequential launches of ``task=noop engine.dp_size=R`` (``--ranks R``);
* ``--rounds K`` rounds of ``--concurrent C`` simultaneous 8-rank launches
  (``engine.cp_size=4 engine.pp_size=2``).

Every launch is a subprocess in its own process group with a wall-clock limit
(``--limit-s``); on overrun the whole group is killed and the launch counts as
a stall. Prints each launch's wall time, pass/fail counts, and for a failure the
run dir and the tail of the launcher's output. Exits 1 on any failure.

    python scripts/launch_loops.py --runs 20 --ranks 32 --timeout-min 0.5
    python scripts/launch_loops.py --runs 0 --rounds 10 --concurrent 3
    PYTHONPATH=tests/user_tasks python scripts/launch_loops.py --runs 20 --ranks 4 --task fsdp_step
    \
        --overrides launcher=slurm launcher.nodes=2 'task.modules=[wf_slurm_test_tasks]'
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_RUN_DIR = re.compile(r"run dir (\S+)")


@dataclass
class Launch:
    label: str
    ok: bool
    wall_s: float
    rc: int | None
    stalled: bool
    run_dir: str | None
    output: str


def _start(
    overrides: list[str], out_root: str, extra_env: dict[str, str], task: str = "noop"
) -> tuple[subprocess.Popen, float]:
    cmd = [
        sys.executable,
        "-m",
        "wf_launch",
        f"task={task}",
        f"hydra.run.dir={out_root}/${{now:%H-%M-%S}}-${{wf_uid:}}",
        *overrides,
    ]
    env = {**os.environ, **extra_env}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    return proc, time.monotonic()


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return sorted(pids)


def _dump_stacks(pgid: int, dest: Path) -> None:
    """py-spy dump (if installed) of every process in the stalled launch, into ``dest``."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return
    with open(dest, "w") as f:
        for pid in _group_pids(pgid):
            f.write(f"===== pid {pid} ppid {_ppid(pid)} =====\n")
            f.flush()
            subprocess.run(
                [spy, "dump", "--native", "--pid", str(pid)],
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=30,
                check=False,
            )


def _ppid(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except OSError:
        return "?"


def _finish(
    label: str, proc: subprocess.Popen, t0: float, limit_s: float, dump_dir: Path | None = None
) -> Launch:
    stalled = False
    try:
        out, _ = proc.communicate(timeout=max(0.1, limit_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        stalled = True
        if dump_dir is not None:
            dest = dump_dir / f"stacks-{proc.pid}.txt"
            _dump_stacks(proc.pid, dest)
            print(f"    stacks of the stalled launch: {dest}", flush=True)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
    wall = time.monotonic() - t0
    m = _RUN_DIR.search(out or "")
    rc = None if stalled else proc.returncode
    return Launch(
        label, rc == 0, wall, rc, stalled, m.group(1).rstrip(",") if m else None, out or ""
    )


def _report(launch: Launch, tail: int) -> None:
    state = "ok" if launch.ok else ("STALL (killed)" if launch.stalled else f"FAIL rc={launch.rc}")
    print(f"  {launch.label:<24} {launch.wall_s:7.2f}s  {state}", flush=True)
    if not launch.ok:
        print(f"    run dir: {launch.run_dir}")
        for line in launch.output.strip().splitlines()[-tail:]:
            print(f"    | {line}")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=6, help="sequential launches (default 6)")
    p.add_argument(
        "--ranks", type=int, default=32, help="ranks of each sequential launch (dp_size)"
    )
    p.add_argument(
        "--timeout-min",
        type=float,
        default=0.5,
        help="engine.distributed_timeout_minutes for every launch (default 0.5)",
    )
    p.add_argument(
        "--limit-s",
        type=float,
        default=120.0,
        help="wall-clock limit per launch; the process group is killed on overrun",
    )
    p.add_argument("--rounds", type=int, default=0, help="rounds of concurrent 8-rank launches")
    p.add_argument("--concurrent", type=int, default=3, help="launches per round (default 3)")
    p.add_argument("--tail", type=int, default=15, help="launcher output lines shown for a failure")
    p.add_argument("--out", default=None, help="run dirs go here (default: a temp dir)")
    p.add_argument(
        "--dump",
        action="store_true",
        help="on a stall, py-spy dump every process of the launch (into the out dir) before "
        "killing",
    )
    p.add_argument("--stop-on-fail", action="store_true", help="stop at the first failure")
    p.add_argument("--task", default="noop", help="task of the sequential launches (default noop)")
    p.add_argument(
        "--overrides",
        nargs="*",
        default=[],
        help="more overrides for every launch, e.g. launcher=slurm launcher.nodes=2",
    )
    args = p.parse_args(argv)

    out_root = args.out or tempfile.mkdtemp(prefix="wf_launch_loops-")
    env = {"PYTHONUNBUFFERED": "1"}
    common = [f"engine.distributed_timeout_minutes={args.timeout_min}", *args.overrides]
    results: list[Launch] = []
    dump = Path(out_root) if args.dump else None
    print(f"run dirs under {out_root}", flush=True)

    if args.runs:
        print(f"{args.runs} sequential launch(es) of {args.ranks} ranks", flush=True)
    for i in range(args.runs):
        proc, t0 = _start([f"engine.dp_size={args.ranks}", *common], out_root, env, args.task)
        launch = _finish(f"seq {i + 1}/{args.runs} ({args.ranks}r)", proc, t0, args.limit_s, dump)
        results.append(launch)
        _report(launch, args.tail)
        if args.stop_on_fail and not launch.ok:
            break

    if args.rounds and not (args.stop_on_fail and any(not r.ok for r in results)):
        print(f"{args.rounds} round(s) of {args.concurrent} concurrent 8-rank launches", flush=True)
    for k in range(args.rounds):
        if args.stop_on_fail and any(not r.ok for r in results):
            break
        started = [
            _start(["engine.cp_size=4", "engine.pp_size=2", *common], out_root, env)
            for _ in range(args.concurrent)
        ]
        for j, (proc, t0) in enumerate(started):
            launch = _finish(f"round {k + 1}/{args.rounds} #{j + 1}", proc, t0, args.limit_s, dump)
            results.append(launch)
            _report(launch, args.tail)

    failed = [r for r in results if not r.ok]
    walls = sorted(r.wall_s for r in results if r.ok)
    print(
        f"\n{len(results) - len(failed)}/{len(results)} ok, {len(failed)} failed "
        f"({sum(r.stalled for r in failed)} stalled past {args.limit_s:.0f}s)"
    )
    if walls:
        print(
            f"ok wall time: min {walls[0]:.2f}s  median {walls[len(walls) // 2]:.2f}s  max "
            f"{walls[-1]:.2f}s"
        )
    for r in failed:
        print(f"  failed: {r.label}: {r.run_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
