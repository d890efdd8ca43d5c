"""The CUDA/NCCL paths of the project, checked on a GPU machine: one line per check, then a summary.

Run through ``scripts/gpu_check.sh`` (which sets the project up first). Every check is a real
launch or a real multi-process program on the GPUs, with its own time limit, inside one overall
budget (``--budget-s``, 480 s: the 8 minutes a borrowed GPU machine gives). With one GPU it runs
what one device allows (NCCL refuses two ranks on one device) and names what it could not cover.
``--dry-run`` lists the checks and exits 0; ``--rehearse-on-cpu`` runs them on CPU ranks over gloo
(NCCL -> gloo, CUDA -> CPU, ``--pretend-gpus`` devices, 2 by default), which tests this script where
there is no GPU and proves nothing about CUDA. ``--missing`` and ``--requirements`` serve the set-up
(``gpu_check.sh``): what this interpreter lacks, and the pure-Python wheels to carry to a machine
that reaches no package index. Only the standard library is imported before a check runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_DEVICE = "NCCL forbids two ranks on one device"

DEPENDENCIES: tuple[tuple[str, str, bool], ...] = (
    ("hydra", "hydra-core", True),
    ("omegaconf", "omegaconf", True),
    ("antlr4", "antlr4-python3-runtime", True),
    ("loguru", "loguru", True),
    ("submitit", "submitit", True),
    ("cloudpickle", "cloudpickle", True),
    ("typing_extensions", "typing-extensions", True),
    ("tqdm", "tqdm", True),
    ("packaging", "packaging", True),
    ("yaml", "pyyaml", False),
    ("numpy", "numpy", False),
    ("matplotlib", "matplotlib", False),
)
"""(module, distribution, pure Python) for what the project imports besides torch: the pyproject's
dependencies
and theirs. A CUDA image usually has the binary ones; the pure-Python ones travel as wheels
(``--requirements``)."""


@dataclass
class Env:
    """Where the checks run: the devices, the backends to ask for, scratch space, the deadline."""

    gpus: int
    rehearse: bool
    scratch: Path
    deadline: float

    @property
    def nccl(self) -> str:
        return "gloo" if self.rehearse else "nccl"

    @property
    def mixed(self) -> str:
        return "gloo" if self.rehearse else "cpu:gloo,cuda:nccl"

    @property
    def device(self) -> str:
        return "cpu" if self.rehearse else "cuda"

    @property
    def world(self) -> int:
        """Ranks for the multi-rank checks: one per GPU, at most 8."""
        return max(1, min(self.gpus, 8))


Result = tuple[bool, str]


@dataclass
class Check:
    name: str
    what: str
    min_gpus: int
    timeout_s: float
    run: Callable[[Env], Result]


def _run(
    argv: list[str],
    env: Env,
    timeout: float,
    cwd: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    left = max(5.0, min(timeout, env.deadline - time.monotonic()))
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=left,
        cwd=cwd or env.scratch,
        env={**os.environ, **(extra_env or {})},
    )


def _launch(
    env: Env, name: str, overrides: list[str], timeout: float
) -> tuple[subprocess.CompletedProcess, dict]:
    run_dir = env.scratch / name
    proc = _run(
        [sys.executable, "-m", "wf_launch", *overrides, f"hydra.run.dir={run_dir}"], env, timeout
    )
    try:
        record = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        record = {}
    return proc, record


def _tail(proc: subprocess.CompletedProcess) -> str:
    return " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[-400:]


def check_env(env: Env) -> Result:
    code = textwrap.dedent("""
        import json, torch
        out = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available(),
               "devices": torch.cuda.device_count()}
        if out["available"]:
            out["names"] = sorted({torch.cuda.get_device_name(i) for i in range(out["devices"])})
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        print(json.dumps(out))
        """)
    proc = _run([sys.executable, "-c", code], env, 60)
    if proc.returncode:
        return False, _tail(proc)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = env.rehearse or (info["available"] and info["devices"] >= 1)
    return ok, (
        f"torch {info['torch']}, CUDA {info['cuda']}, {info['devices']} device(s) "
        f"{info.get('names', [])}, NCCL {info.get('nccl', '-')}"
    )


_NAMES = """
import json, torch, submitit
from worldfoundry.core import torch_private
from wf_launch.launchers.slurm import submitit_adapter
print(json.dumps(torch_private.check_names() + submitit_adapter.check_names()))
"""


def check_names(env: Env) -> Result:
    proc = _run([sys.executable, "-c", _NAMES], env, 120)
    if proc.returncode:
        return False, _tail(proc)
    problems = json.loads(proc.stdout.strip().splitlines()[-1])
    return (not problems), (
        "every private torch and submitit name the project relies on is there"
        if not problems
        else "; ".join(problems)[:400]
    )


def check_startup(env: Env) -> Result:
    proc, record = _launch(
        env,
        "startup",
        ["task=layout", f'engine.distributed_backend="{env.mixed}"', f"engine.dp_size={env.world}"],
        240,
    )
    rows = (record.get("results", {}).get("0") or {}).get("rows") or []
    devices = [r.get("device") for r in rows]
    want = [f"{env.device}:{r.get('local_rank')}" if env.device == "cuda" else "cpu" for r in rows]
    ok = proc.returncode == 0 and record.get("status") == "ok" and devices == want
    return ok, f"{env.world} rank(s) on {env.mixed}, devices {devices}" if ok else _tail(proc)


def check_groups(env: Env) -> Result:
    sizes = {
        1: [],
        2: ["engine.tp_size=2"],
        4: ["engine.tp_size=2", "engine.cp_size=2"],
        8: ["engine.tp_size=2", "engine.cp_size=2", "engine.pp_size=2"],
    }
    world = max(w for w in sizes if w <= env.world)
    proc, record = _launch(
        env, "groups", ["task=layout", f"engine.distributed_backend={env.nccl}", *sizes[world]], 240
    )
    ok = proc.returncode == 0 and (record.get("results", {}).get("0") or {}).get("ok") is True
    return ok, (
        f"every group's device group checked with all_reduce/all_gather on {world} rank(s) "
        f"({' '.join(sizes[world]) or 'world of one'})"
    ) if ok else _tail(proc)


def check_cp(env: Env) -> Result:
    cp = 2 if env.world >= 2 else 1
    proc, record = _launch(
        env, "cp", [f"engine.distributed_backend={env.nccl}", f"engine.cp_size={cp}"], 240
    )
    errs = [r.get("max_abs_err") for r in record.get("results", {}).values() if "max_abs_err" in r]
    ok = proc.returncode == 0 and record.get("status") == "ok"
    return (
        ok,
        f"demo cp={cp}: split/gather on {env.device} tensors, max_abs_err {errs}"
        if ok
        else _tail(proc),
    )


def check_pp(env: Env) -> Result:
    proc, record = _launch(
        env, "pp", [f"engine.distributed_backend={env.nccl}", "engine.pp_size=2"], 240
    )
    ok = proc.returncode == 0 and record.get("status") == "ok"
    return ok, "demo pp=2: PPScheduler send/recv of device tensors between stages" if ok else _tail(
        proc
    )


_RUN_CONTROL = """
import sys, time, torch
from worldfoundry.core.distributed import distributed_run, all_reduce, broadcast_from, gather_bytes
from worldfoundry.core.distributed.ema import DTensorFastEmaModelUpdater
with distributed_run(device=sys.argv[1]) as state:
    total = all_reduce("sum", lambda: state.rank + 1, sum)
    assert total == state.world_size * (state.world_size + 1) // 2, total
    assert broadcast_from("hello", lambda: f"from {state.rank}") == "from 0"
    parts = gather_bytes(bytes([state.rank]) * 1024, dst=0)
    assert state.rank != 0 or [p[:1] for p in parts] == [bytes([r]) for r in range(state.world_size)]
    src = [torch.randn(4096, 4096, device=state.device) for _ in range(8)]
    ema = [s.clone() for s in src]
    updater = DTensorFastEmaModelUpdater()
    sync = torch.cuda.synchronize if state.device.type == "cuda" else (lambda: None)
    moved = sum(s.numel() * s.element_size() for s in src) * 3  # read ema and src, write ema
    updater.update_average(src, ema, beta=0.99); sync()
    t0 = time.perf_counter()
    for _ in range(20):
        updater.update_average(src, ema, beta=0.99)
    sync(); ema_s = (time.perf_counter() - t0) / 20
    a, b = torch.empty(moved // 8, dtype=torch.float32, device=state.device), None
    b = torch.empty_like(a); b.copy_(a); sync()
    t0 = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    sync(); copy_s = (time.perf_counter() - t0) / 20
    if state.is_main:
        print(f"RESULT ranks={state.world_size} ema_GBps={moved / ema_s / 1e9:.1f} copy_GBps={2 * a.numel() * 4 / copy_s / 1e9:.1f} "
              f"ratio={(moved / ema_s) / (2 * a.numel() * 4 / copy_s):.2f}")
"""


def check_run_control(env: Env) -> Result:
    script = env.scratch / "run_control.py"
    script.write_text(_RUN_CONTROL)
    proc = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={env.world}",
            str(script),
            env.device,
        ],
        env,
        240,
        extra_env={
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        },
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    return (proc.returncode == 0 and line is not None), (line[7:] if line else _tail(proc))


def check_train(env: Env) -> Result:
    drill = env.scratch / "drill"
    proc = _run(
        [
            sys.executable,
            "-m",
            "wf_launch.drill",
            "task=train",
            f"engine.distributed_backend={env.nccl}",
            f"engine.dp_size={min(env.world, 2)}",
            "task.steps=12",
            "task.checkpoint_every=3",
            "task.step_sleep_s=0.2",
            "--inject",
            "kill9@5,sigterm@8",
            "--dir",
            str(drill),
        ],
        env,
        300,
    )
    ok = proc.returncode == 0 and "drill verdict: IDENTICAL" in proc.stdout
    return ok, (
        f"task=train (FSDP2) on {env.device}: killed at step 5 (restart from a checkpoint), "
        "SIGTERM at step 8 "
        "(saved, resumed): bitwise identical to an uninterrupted run"
    ) if ok else _tail(proc)


def check_demo(env: Env) -> Result:
    proc, record = _launch(
        env, "demo", ["engine.distributed_backend=auto", f"engine.dp_size={env.world}"], 240
    )
    ok = proc.returncode == 0 and record.get("status") == "ok"
    return ok, f"task=demo, backend auto on {env.world} rank(s)" if ok else _tail(proc)


CHECKS = [
    Check("environment", "torch, CUDA, the GPUs, NCCL's version", 1, 60, check_env),
    Check(
        "upstream-names",
        "the private torch and submitit names the project relies on, in this machine's torch",
        1,
        120,
        check_names,
    ),
    Check(
        "startup-mixed",
        "cpu:gloo,cuda:nccl start-up; ctx.device is cuda:LOCAL_RANK on every rank",
        1,
        240,
        check_startup,
    ),
    Check(
        "device-groups",
        "every group object's device group (NCCL) checked with real collectives",
        1,
        240,
        check_groups,
    ),
    Check(
        "cp-helpers",
        "context-parallel split/gather/broadcast on CUDA tensors (the demo, cp=2)",
        1,
        240,
        check_cp,
    ),
    Check(
        "pp-scheduler",
        "the PP scheduler moving CUDA tensors between stages (the demo, pp=2)",
        2,
        240,
        check_pp,
    ),
    Check(
        "run-control-ema",
        "distributed_run, all_reduce, broadcast_from, gather_bytes; EMA bytes/s against a "
        "device copy",
        1,
        240,
        check_run_control,
    ),
    Check(
        "train-fsdp2",
        "task=train (FSDP2) on CUDA with a checkpoint, a kill -9 restart and a resume (the drill)",
        1,
        300,
        check_train,
    ),
    Check("demo", "task=demo on every GPU, backend auto", 1, 240, check_demo),
]


def gpu_count(rehearse: bool, pretend: int) -> int:
    if rehearse:
        return pretend
    proc = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0


def missing() -> list[str]:
    """The distributions of :data:`DEPENDENCIES` this interpreter cannot import (for the set-up to
    install)."""
    from importlib.util import find_spec

    return [dist for module, dist, _ in DEPENDENCIES if find_spec(module) is None]


def requirements() -> list[str]:
    """The pure-Python dependencies as requirements, pinned to this interpreter's versions where it
    has them."""
    from importlib import metadata

    out = []
    for _, dist, pure in DEPENDENCIES:
        if pure:
            try:
                out.append(f"{dist}=={metadata.version(dist)}")
            except metadata.PackageNotFoundError:
                out.append(dist)
    return out


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list the checks, run nothing")
    ap.add_argument(
        "--budget-s", type=float, default=480.0, help="the whole run's time limit (default 480)"
    )
    ap.add_argument(
        "--rehearse-on-cpu",
        action="store_true",
        help="run the checks on CPU/gloo (tests this script)",
    )
    ap.add_argument(
        "--pretend-gpus",
        type=int,
        default=2,
        choices=range(1, 9),
        metavar="1..8",
        help="devices a rehearsal pretends to have (default 2; 1 rehearses a one-GPU machine)",
    )
    ap.add_argument("--only", nargs="*", default=None, help="run only these checks")
    ap.add_argument(
        "--keep", metavar="DIR", default=None, help="run in DIR and keep its run dirs and logs"
    )
    ap.add_argument(
        "--missing", action="store_true", help="print the dependencies this interpreter lacks"
    )
    ap.add_argument(
        "--requirements", action="store_true", help="print the pure-Python dependencies, pinned"
    )
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only or ()) - {c.name for c in CHECKS})
    if unknown:
        ap.error(
            f"--only {' '.join(unknown)}: no such check; the checks: "
            f"{' '.join(c.name for c in CHECKS)}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.missing or args.requirements:
        for line in missing() if args.missing else requirements():
            print(line)
        return 0
    chosen = [c for c in CHECKS if args.only is None or c.name in args.only]
    if args.dry_run:
        for c in chosen:
            print(f"{c.name:<16} needs {c.min_gpus} GPU(s), up to {c.timeout_s:.0f} s: {c.what}")
        print(
            f"{len(chosen)} checks; budget {args.budget_s:.0f} s; with one GPU the checks that "
            "need two are skipped "
            f"({ONE_DEVICE}) and named"
        )
        return 0
    start = time.monotonic()
    gpus = gpu_count(args.rehearse_on_cpu, args.pretend_gpus)
    if gpus == 0:
        print(
            "gpu_check: no CUDA device here (torch.cuda.device_count() == 0); nothing to check. "
            "--rehearse-on-cpu runs the checks on CPU ranks to test this script."
        )
        return 2
    results: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="wf-gpu-check-") as scratch:
        kept = Path(args.keep) if args.keep else None
        if kept is not None:
            kept.mkdir(parents=True, exist_ok=True)
        env = Env(gpus, args.rehearse_on_cpu, kept or Path(scratch), start + args.budget_s)
        for check in chosen:
            results.append((check.name, _one(check, env)))
    return _summary(results, gpus, args.rehearse_on_cpu, time.monotonic() - start)


def _one(check: Check, env: Env) -> str:
    if env.gpus < check.min_gpus:
        print(
            f"SKIP {check.name:<16} needs {check.min_gpus} GPUs, this machine has {env.gpus} "
            f"({ONE_DEVICE})",
            flush=True,
        )
        return "skip"
    if time.monotonic() > env.deadline - 10:
        print(f"SKIP {check.name:<16} the time budget is spent", flush=True)
        return "skip"
    t0 = time.monotonic()
    try:
        ok, detail = check.run(env)
    except subprocess.TimeoutExpired:
        ok, detail = False, "timed out"
    except Exception as exc:
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    print(
        f"{'PASS' if ok else 'FAIL'} {check.name:<16} {time.monotonic() - t0:6.1f} s  {detail}",
        flush=True,
    )
    return "pass" if ok else "fail"


def _summary(results: list[tuple[str, str]], gpus: int, rehearse: bool, wall: float) -> int:
    counts = {k: sum(1 for _, r in results if r == k) for k in ("pass", "fail", "skip")}
    where = (
        f"a CPU rehearsal of {gpus} GPU(s) (gloo; proves nothing about CUDA)"
        if rehearse
        else f"{gpus} GPU(s)"
    )
    print(
        f"summary: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped on "
        f"{where} "
        f"in {wall:.0f} s"
    )
    if gpus == 1:
        print(
            f"not covered with one GPU ({ONE_DEVICE}): every multi-rank NCCL collective, the PP "
            "scheduler across "
            "devices, CP over more than one rank, FSDP2 sharding over ranks; run on a machine "
            "with 2+ GPUs"
        )
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
