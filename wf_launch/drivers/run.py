"""``python -m wf_launch.run`` / ``wf-run``: torchrun's command line, run as ``task=script`` on the
local launcher.

::

    python -m wf_launch.run [--nproc-per-node N] [--nnodes 1] [--max-restarts K] [--run-dir DIR]
    [--] train.py ARGS...
    python -m wf_launch.run --nproc-per-node 4 -m pkg.train ARGS...

Replace ``torchrun`` with ``python -m wf_launch.run`` in a command and the script runs
the same (torchrun's environment, its arguments untouched, exit code 1 when a rank
fails), with wf_launch's forked fast start, the run directory, the root cause, the
live view and the hang autopsy (docs/scripts.md). torchrun's flags that make sense on
one node are honoured; the others are refused (exit 2) before anything starts, with
what to do instead. Every argument after the script (or ``-m MODULE``) is the
script's, passed as it is: no Hydra parsing, no interpolation.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from worldfoundry.core.distributed.backends import local_gpu_count

from ..cli import main as cli_main

__all__ = ["RunCommandError", "hydra_quote", "main", "overrides_for", "parse"]

LOOPBACK = ("", "localhost", "127.0.0.1", "::1")


class RunCommandError(ValueError):
    """A flag that cannot be honoured, or a value that is not allowed (exit 2, nothing started)."""


def hydra_quote(text: str) -> str:
    """``text`` as a Hydra override value that reaches the code exactly as it is.

    A single-quoted Hydra string (quotes, and backslashes before a quote or the end,
    escaped) whose OmegaConf interpolations are escaped (``${`` -> ``\\${``).
    """
    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
    return "'" + text.replace("'", "\\'") + "'"


_REFUSED = {
    "no_python": "wf_launch runs Python scripts in its ranks; run other programs with torchrun",
    "log_dir": "every rank logs into the run directory's logs folder; choose the run directory "
    "with --run-dir",
    "rdzv_id": "wf_launch names each launch itself (TORCHELASTIC_RUN_ID); drop the flag",
    "rdzv_conf": "the rendezvous is wf_launch's own (loopback c10d); drop the flag",
    "logs_specs": "every rank logs into the run directory's logs folder; drop the flag",
    "numa_binding": "not supported by wf_launch's local launcher; bind in the script if needed",
    "event_log_handler": "wf_launch records the run in its run directory (its record and the "
    "launcher's log); "
    "drop the flag",
    "virtual_local_rank": "not supported: LOCAL_RANK is the rank's real local rank",
    "signals_to_handle": "wf_launch handles SIGINT/SIGTERM itself (every rank stops, exit "
    "130/143); drop the flag",
    "max_nodes": "one node: several nodes are launcher=slurm's (python -m wf_launch "
    "launcher=slurm task=script ...)",
    "min_nodes": "one node: several nodes are launcher=slurm's (python -m wf_launch "
    "launcher=slurm task=script ...)",
}
"""torchrun's flags that wf_launch.run refuses (exit 2), and why."""
_SWITCHES = frozenset({"no_python", "virtual_local_rank"})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m wf_launch.run",
        description="torchrun's command line on wf_launch: every rank runs the script "
        "(task=script, launcher=local) "
        "with torchrun's environment, and the run gets a run directory, a root cause on failure, "
        "the "
        "live view and the hang autopsy. Flags torchrun has that cannot be honoured on one node "
        "are "
        "refused.",
        epilog="examples:\n  python -m wf_launch.run --nproc-per-node 4 train.py --lr 0.1\n"
        "  python -m wf_launch.run --nproc-per-node 8 --max-restarts 2 -m pkg.train --epochs 3\n"
        "  python -m wf_launch.run --nproc-per-node 8 --set engine.cp_size=2 train.py   # dp = 8 "
        "/ 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    _add_torchrun_flags(p.add_argument)
    _add_wf_launch_flags(p.add_argument)
    return p


def _add_torchrun_flags(add: Callable[..., object]) -> None:
    """torchrun's own flags, each honoured or accepted as torchrun means it."""
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        default="1",
        metavar="N",
        help="ranks on this node: an integer, or auto / cpu / gpu as torchrun (default 1)",
    )
    add("--nnodes", default="1", help="must be 1 (or 1:1): several nodes are launcher=slurm's")
    add("--node-rank", "--node_rank", default="0", help="must be 0")
    add(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        metavar="K",
        help="restarts of the whole rank group after a failure (launcher.max_restarts)",
    )
    add(
        "--monitor-interval",
        "--monitor_interval",
        type=float,
        default=None,
        metavar="S",
        help="seconds between checks of the ranks (launcher.monitor_interval_s)",
    )
    add(
        "--start-method",
        "--start_method",
        default=None,
        choices=("spawn", "fork", "forkserver"),
        help="how ranks start (default: fork where safe, the fast start)",
    )
    add(
        "--standalone",
        action="store_true",
        help="accepted: a single-node launch always rendezvouses on loopback",
    )
    add(
        "--rdzv-backend",
        "--rdzv_backend",
        default="static",
        help="c10d or static (accepted, c10d is used)",
    )
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default="",
        help="HOST:PORT on loopback (the rendezvous port)",
    )
    add("--master-addr", "--master_addr", default="127.0.0.1", help="must be this host's loopback")
    add(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="the rendezvous port (launcher.rdzv_port)",
    )
    add("--local-addr", "--local_addr", default=None, help="must be loopback")
    add("--role", default="default", help="must be 'default'")
    add(
        "-r",
        "--redirects",
        default="0",
        help="0: console and rank logs; 1-3: rank logs only (no per-rank map)",
    )
    add(
        "-t",
        "--tee",
        default="0",
        help="accepted: every rank always writes its log and echoes to the console",
    )
    add(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default="",
        help="ranks echoed to the console, e.g. 0,1",
    )
    add("-m", "--module", action="store_true", help="the script is a module: python -m MODULE")
    add(
        "--run-path",
        "--run_path",
        action="store_true",
        help="accepted: scripts always run through runpy",
    )


def _add_wf_launch_flags(add: Callable[..., object]) -> None:
    """The flags wf_launch.run refuses (torchrun's, with a reason) and those it adds."""
    for name in _REFUSED:  # torchrun's spellings, with - and _; switches take no value
        flags = [f"--{name.replace('_', '-')}", f"--{name}"]
        kind = {"action": "store_true", "default": None} if name in _SWITCHES else {"default": None}
        add(*dict.fromkeys(flags), dest=f"refused_{name}", help=argparse.SUPPRESS, **kind)
    add(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="the run directory (default: outputs/DATE/TIME-ID)",
    )
    add(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any wf_launch override, e.g. engine.cp_size=2 (dp becomes nproc / cp), "
        "launcher.console_ranks=[0]",
    )
    add(
        "--dry-run",
        action="store_true",
        help="print the layout, the plan and every rank's command; start nothing",
    )
    add(
        "training_script",
        metavar="SCRIPT",
        help="the script (or, with -m, the module) every rank runs",
    )
    add(
        "training_script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="its arguments, as they are",
    )


@dataclass
class RunCommand:
    """The parsed command: what to run, how many ranks, and the wf_launch overrides it maps to."""

    nproc: int
    script: str
    args: list[str]
    module: bool
    run_dir: str | None
    overrides: list[str] = field(default_factory=list)
    dry_run: bool = False


def _nproc(value: str) -> int:
    """``--nproc-per-node``: an integer >= 1, or torchrun's ``auto`` / ``cpu`` / ``gpu``."""
    if value in ("auto", "cpu", "gpu"):
        gpus = local_gpu_count()
        if value == "gpu" and not gpus:
            raise RunCommandError(
                "--nproc-per-node gpu: this host has no CUDA GPU; give a number, or cpu"
            )
        return gpus if value == "gpu" or (value == "auto" and gpus) else (os.cpu_count() or 1)
    if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
        raise RunCommandError(
            f"--nproc-per-node {value}: expected an integer >= 1, or auto, cpu, gpu"
        )
    return int(value)


def _single_node(ns: argparse.Namespace) -> None:
    """Refuse every flag that asks for more than this node, or for something wf_launch cannot do."""
    for dest, why in _REFUSED.items():
        if getattr(ns, f"refused_{dest}", None) is not None:
            raise RunCommandError(f"--{dest.replace('_', '-')}: cannot be honoured: {why}")
    if ns.nnodes not in ("1", "1:1"):
        raise RunCommandError(
            f"--nnodes {ns.nnodes}: wf_launch.run runs on one node; for several, use "
            "python -m wf_launch launcher=slurm launcher.nodes=N task=script task.path=..."
        )
    if ns.node_rank != "0":
        raise RunCommandError(
            f"--node-rank {ns.node_rank}: one node, so 0 (several nodes: launcher=slurm)"
        )
    if ns.rdzv_backend not in ("c10d", "static"):
        raise RunCommandError(
            f"--rdzv-backend {ns.rdzv_backend}: one node rendezvouses with c10d on loopback; "
            "use c10d or drop the flag"
        )
    for flag, host in (
        ("--master-addr", ns.master_addr),
        ("--local-addr", ns.local_addr or ""),
        (
            "--rdzv-endpoint",
            ns.rdzv_endpoint.rpartition(":")[0] if ":" in ns.rdzv_endpoint else ns.rdzv_endpoint,
        ),
    ):
        if host.strip("[]") not in LOOPBACK:
            raise RunCommandError(
                f"{flag} {host}: one node: the rendezvous listens on 127.0.0.1 only; drop the flag "
                "(several nodes: launcher=slurm)"
            )
    if ns.role != "default":
        raise RunCommandError(f"--role {ns.role}: one role per launch ('default')")
    if ns.redirects not in ("0", "1", "2", "3") or ns.tee not in ("0", "1", "2", "3"):
        raise RunCommandError(
            f"--redirects {ns.redirects} / --tee {ns.tee}: one of 0-3 for every rank (per-rank "
            "maps are not supported; every rank writes its log in the run directory)"
        )


def _port(ns: argparse.Namespace) -> int | None:
    port = ns.rdzv_endpoint.rpartition(":")[2] if ":" in ns.rdzv_endpoint else ""
    if port and not port.isdigit():
        raise RunCommandError(f"--rdzv-endpoint {ns.rdzv_endpoint}: expected HOST:PORT")
    chosen = int(port) if port else ns.master_port
    if chosen is not None and not 0 <= chosen <= 65535:
        raise RunCommandError(f"--master-port {chosen}: expected a port, 0 to 65535")
    return chosen


def _sizes(sets: list[str], nproc: int) -> int:
    """``engine.dp_size`` for ``nproc`` ranks given the model-parallel sizes in ``--set``."""
    given = {k: v for k, _, v in (s.partition("=") for s in sets)}
    mp = 1
    for dim in ("tp", "cp", "pp"):
        raw = given.get(f"engine.{dim}_size", "1")
        if not raw.isdigit() or int(raw) < 1:
            raise RunCommandError(f"--set engine.{dim}_size={raw}: expected an integer >= 1")
        mp *= int(raw)
    if nproc % mp:
        raise RunCommandError(
            f"--nproc-per-node {nproc}: not a multiple of tp x cp x pp = {mp} (from --set); "
            "the data-parallel size is nproc / (tp x cp x pp)"
        )
    dp = given.get("engine.dp_size")
    if dp is not None and dp != str(nproc // mp):
        raise RunCommandError(
            f"--set engine.dp_size={dp}: {nproc} ranks / (tp x cp x pp = {mp}) = {nproc // mp}; "
            "drop it (wf_launch.run derives it)"
        )
    return nproc // mp


def parse(argv: list[str]) -> RunCommand:
    """The command line as a :class:`RunCommand`; :class:`RunCommandError` for a flag that cannot be
    honoured."""
    ns = _parser().parse_args(argv)
    _single_node(ns)
    args = list(ns.training_script_args)
    if args[:1] == ["--"]:
        args = args[1:]
    for s in ns.set:
        if "=" not in s or s.startswith("-"):
            raise RunCommandError(
                f"--set {s}: expected KEY=VALUE, a wf_launch override (e.g. engine.cp_size=2)"
            )
        if s.split("=", 1)[0].lstrip("+~") in (
            "task",
            "task.path",
            "task.module",
            "task.args",
            "launcher",
            "hydra.run.dir",
        ):
            raise RunCommandError(
                f"--set {s}: wf_launch.run sets {s.split('=', 1)[0]} itself from its arguments"
            )
    nproc = _nproc(ns.nproc_per_node)
    over = [
        "task=script",
        "launcher=local",
        f"engine.dp_size={_sizes(ns.set, nproc)}",
        f"launcher.max_restarts={ns.max_restarts}",
        f"task.{'module' if ns.module else 'path'}={hydra_quote(ns.training_script)}",
        "task.args=[" + ",".join(hydra_quote(a) for a in args) + "]",
    ]
    if ns.max_restarts < 0:
        raise RunCommandError(f"--max-restarts {ns.max_restarts}: expected an integer >= 0")
    if (port := _port(ns)) is not None:
        over.append(f"launcher.rdzv_port={port}")
    if ns.monitor_interval is not None:
        over.append(f"launcher.monitor_interval_s={ns.monitor_interval}")
    if ns.start_method is not None:
        over.append(f"launcher.start_method={ns.start_method}")
    if ns.local_ranks_filter:
        over.append(f"launcher.console_ranks=[{ns.local_ranks_filter}]")
    elif ns.redirects != "0":
        over.append("launcher.console_ranks=[]")
    return RunCommand(
        nproc, ns.training_script, args, ns.module, ns.run_dir, [*over, *ns.set], ns.dry_run
    )


def overrides_for(cmd: RunCommand) -> list[str]:
    """The ``python -m wf_launch`` command line the run command stands for."""
    out = list(cmd.overrides)
    if cmd.run_dir is not None:
        out.append(f"hydra.run.dir={hydra_quote(str(Path(cmd.run_dir).absolute()))}")
    if cmd.dry_run:
        out.append("launcher.dry_run=true")
    return out


def main(argv: list[str] | None = None) -> None:
    """Parse torchrun's flags, then run ``python -m wf_launch`` with the overrides they map to (in
    this process)."""
    try:
        cmd = parse(sys.argv[1:] if argv is None else argv)
    except RunCommandError as exc:
        print(f"wf_launch.run: {exc}", file=sys.stderr)
        sys.exit(2)

    sys.argv = [sys.argv[0], *overrides_for(cmd)]
    cli_main()
