"""Every command shown in README.md and docs/ runs, and every sample output matches the command it
follows.

The commands are read from the fenced code blocks (a line that starts with ``python -m wf_launch``,
``$ python -m wf_launch``, ``wf-launch`` or ``scripts/``/``bash scripts/``; ``\\`` continues a
line). Each runs through the real CLI in a scratch directory, at small sizes (``task.repeats=1`` for
the demo when the command leaves it, ``task.steps=4`` for ``train`` unless the command sets it),
with ``RUN_DIR`` / ``SWEEP_DIR`` standing for a run and a sweep made first (``status --stacks`` gets
a run still going), and a command's ``# exit N`` comment, or what its sample shows (a config error:
2, a failed run: 1, a Ctrl-C: 130, pressed once the ranks report progress), as its expected exit
code. Drills run as ``--dry-run`` (the arguments, the config and the injections are checked; two
full runs each would take minutes; tests/test_drill.py runs real drills). Python blocks that open
with ``# PATH.py`` are written out, so the commands that use the docs' own example tasks run them.

Tunes run as ``--dry-run`` too (the space, the pruning and the rounds are checked;
tests/test_tune*.py run real tunes). The docs' stand-ins for a user's code (``train.py``,
``my_pkg.train``, ``cfg.yaml``) are written into the scratch directory as small torchrun-style
programs; ``checkpoint`` commands get a run that saved one.

Skipped, and named in the output: commands that need a SLURM cluster (``launcher=slurm``,
``--backend slurm``, ``status --wait/--cancel``, the SLURM samples' run directories, the test
cluster's script) unless one answers ``sinfo``; commands that name a Ray cluster
(``launcher.address``, ``--backend ray``, ``ray_cluster.sh``: tests/test_ray_*.py run those paths on
the test cluster; ``launcher=ray`` alone starts a private instance and runs here); a ``tune
--resume`` of the docs' example directory; and the set-up lines that create a venv and run the whole
suite (what ``.ci/run`` does).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cli_helpers import cli_env, popen_argv, run_argv

pytestmark = pytest.mark.xdist_group("docs")  # its module-scoped runs, launched once

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
_COMMAND = re.compile(
    r"^(\$ )?((python3? -m (wf_launch\S*|venv)|wf-launch\S*|bash scripts/\S+|scripts/\S+)(\s.*)?)$"
)
_LAUNCH = re.compile(r"rank\(s\): tp=(\d+) cp=(\d+) pp=(\d+) dp=(\d+)")


@dataclass
class Shown:
    """A command in the docs, where it is, and the sample output shown under it (if any)."""

    doc: str
    line: int
    text: str
    comment: str
    output: list[str]
    after: list[str] = field(default_factory=list)


def _blocks(doc: Path) -> list[tuple[int, list[str], str]]:
    """(first line number, lines, info string) of each fenced block."""
    out, current, start, info = [], None, 0, ""
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if line.startswith("```"):
            if current is None:
                current, start, info = [], n + 1, line[3:].strip()
            else:
                out.append((start, current, info))
                current = None
        elif current is not None:
            current.append(line)
    return out


def shown_commands() -> list[Shown]:
    """Every command of the docs' code blocks, continuation lines joined, with the output lines that
    follow it."""
    found: list[Shown] = []
    for doc in DOCS:
        for start, lines, info in _blocks(doc):
            if info and info not in ("bash", "sh", "console", "shell", "text"):
                continue
            if (
                found
                and found[-1].doc == str(doc.relative_to(REPO))
                and not any(map(_COMMAND.match, lines))
            ):
                found[
                    -1
                ].after += (
                    lines  # a block of output only: perhaps what the command before it prints
                )
                continue
            i = 0
            while i < len(lines):
                match = _COMMAND.match(lines[i])
                if not match:
                    i += 1
                    continue
                text, first = match.group(2), i
                while text.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
                command, _, comment = text.partition("  #")
                output = []
                if match.group(1):  # a "$ " sample: its output runs to the next prompt
                    j = i + 1
                    while j < len(lines) and not lines[j].startswith("$ "):
                        output.append(lines[j])
                        j += 1
                found.append(
                    Shown(
                        str(doc.relative_to(REPO)),
                        start + first,
                        command.strip(),
                        comment.strip(),
                        output,
                    )
                )
                i += 1
    return found


def _slurm_reachable() -> bool:
    return (
        shutil.which("sinfo") is not None
        and run_argv(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
        and bool(os.environ.get("SLURM_CONF"))
    )


def skip_reason(shown: Shown) -> str | None:
    """Why a command cannot run here (None: it runs)."""
    words = shown.text.split()
    if "venv" in words or "pytest" in shown.text:
        return "sets up a venv and runs the whole suite (what .ci/run does)"
    needs_slurm = (
        "launcher=slurm" in words
        or "--backend slurm" in shown.text
        or "slurm_cluster.sh" in shown.text
        or {"--wait", "--cancel"} & set(words)
        or {"run1", "run2"} & set(words)
    )
    if needs_slurm and not _slurm_reachable():
        return "needs a SLURM cluster (none answers sinfo here)"
    if (
        any(w.startswith("launcher.address=") and w != "launcher.address=null" for w in words)
        or "--backend ray" in shown.text
        or "ray_cluster.sh" in shown.text
    ):
        return (
            "names a Ray cluster (tests/test_ray_*.py run this path on "
            "scripts/ray_cluster.sh's cluster)"
        )
    if words[:3] == ["python", "-m", "wf_launch.tune"] and "--resume" in words:
        return "continues the docs' example tune directory"
    return None


def _expected_code(shown: Shown) -> int:
    """The comment's ``# exit N``, else what the sample shows: a config error 2, a failed run 1,
    Ctrl-C 130."""
    said = re.search(r"exit (\d+)", shown.comment)
    if said:
        return int(said.group(1))
    shown_text = "\n".join(shown.output)
    for needle, code in (("config error", 2), ("run failed in", 1), ("run interrupted in", 130)):
        if needle in shown_text:
            return code
    return 0


def _small(args: list[str]) -> list[str]:
    """Small sizes for the shown command, where it leaves them to the defaults."""
    keys = {a.split("=", 1)[0].lstrip("+~") for a in args}
    task = next((a.split("=", 1)[1] for a in args if a.startswith("task=")), "demo")
    extra = []
    if task == "demo" and "task.repeats" not in keys:
        extra.append("task.repeats=1")
    if task == "train" and "task.steps" not in keys:
        extra.append("task.steps=4")
    return extra


def _run_dir(shown: Shown, args: list[str], own: Path, sweep: bool) -> Path:
    """``own``, except for a run directory the command names: the doc's commands that name one
    share it (a run stopped by Ctrl-C, then its resume)."""
    named = [a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")]
    if sweep or not named:
        return own
    return own.parent / f"named-{Path(shown.doc).stem}-{named[0].replace('/', '_')}"


def _argv(shown: Shown, scratch: Path, index: int, places: dict[str, str]) -> list[str]:
    """The command as argv: placeholders filled, a run directory of its own, small sizes, drills as
    dry runs."""
    text = re.sub(r"\s\[[^\]]*\]", "", shown.text)  # a synopsis' optional parts
    args = [places.get(a, a) for a in shlex.split(text)]
    if args[0] in ("bash",):
        return [args[0], str(REPO / args[1]), *args[2:]]
    if args[0].startswith("scripts/"):
        return [str(REPO / args[0]), *args[1:]]
    if args[0] == "wf-launch" or args[0].startswith("wf-launch-"):
        args = [
            "python",
            "-m",
            "wf_launch" + args[0][len("wf-launch") :].replace("-", "."),
            *args[1:],
        ]
    module, rest = args[2], args[3:]
    if module == "wf_launch" and not ({"--help", "-h", "--cfg", "--info"} & set(rest)):
        sweep = "-m" in rest or "--multirun" in rest
        key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
        where = _run_dir(shown, rest, scratch / f"{'sweep' if sweep else 'run'}{index}", sweep)
        rest = [a for a in rest if not a.startswith(key + "=")]
        rest += [*_small(rest), f"{key}={where}"]
    if module in ("wf_launch.drill", "wf_launch.tune") and "--dry-run" not in rest:
        rest += ["--dry-run"]
    return [sys.executable, "-m", module, *rest]


_USER_SCRIPT = """\
\"\"\"The docs' train.py: a torchrun-style script that reads its rank and takes the docs' arguments.\"\"\"
import argparse
import os


def main(lr=0.1, steps=1, epochs=1, **rest):
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    print(f"rank {rank} of {world}: lr={lr} steps={steps} epochs={epochs}")
    return {"rank": rank, "lr": lr}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--lr", "--cp", "--pp", "--out", "--config", "--name", "--epochs"):
        parser.add_argument(flag)
    args, _ = parser.parse_known_args()
    main(lr=args.lr, epochs=args.epochs)
"""


def _write_user_code(scratch: Path) -> None:
    """The docs' stand-ins for a user's code: ``train.py`` and ``cfg.yaml`` where the commands run,
    and ``my_pkg.train`` (with ``main``) on the path."""
    (scratch / "train.py").write_text(_USER_SCRIPT)
    (scratch / "cfg.yaml").write_text("lr: 0.1\n")
    package = scratch / "examples" / "my_pkg"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").touch()
    (package / "train.py").write_text(_USER_SCRIPT)


def _write_examples(scratch: Path) -> None:
    """The docs' example modules (python blocks that open with ``# PATH.py``), so their commands can
    run."""
    for doc in DOCS:
        for _, lines, info in _blocks(doc):
            if info == "python" and lines and re.fullmatch(r"# [\w/]+\.py", lines[0].strip()):
                if (REPO / lines[0].strip()[2:].split("/")[0]).exists():
                    # a file of this repository shown as an example (a new launcher): not a user
                    # module
                    continue
                path = scratch / "examples" / lines[0].strip()[2:]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("\n".join(lines[1:]) + "\n")
                for parent in path.relative_to(scratch / "examples").parents:
                    if str(parent) != ".":
                        (scratch / "examples" / parent / "__init__.py").touch()


def _run(
    argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300, interrupt: bool = False
) -> subprocess.CompletedProcess:
    """Run ``argv``; ``interrupt``: press Ctrl-C (SIGINT to its process group) once its ranks report
    progress."""
    if not interrupt:
        return run_argv(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    run_dir = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")))
    proc = popen_argv(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while not (run_dir / "logs" / "rank0.progress.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _fixtures(scratch: Path, env: dict[str, str]) -> tuple[dict[str, str], subprocess.Popen]:
    """RUN_DIR (a run with metrics), SWEEP_DIR (a sweep of two such runs), and a run still going for
    ``--stacks``."""
    chatty = [
        sys.executable,
        "-m",
        "wf_launch",
        "task=chatty",
        "task.modules=[wf_identity_tasks]",
        "task.say_every=100",
    ]
    places = {
        "RUN_DIR": str(scratch / "fixture_run"),
        "SWEEP_DIR": str(scratch / "fixture_sweep"),
        "LIVE_RUN_DIR": str(scratch / "fixture_live"),
        "CKPT_RUN_DIR": str(scratch / "fixture_ckpt"),
        "task.path=tests/scripts/helpers_train.py": f"task.path={REPO / 'tests/scripts/helpers_train.py'}",
    }
    live = popen_argv(
        [
            *chatty,
            "task.steps=100000",
            "task.step_sleep_s=0.2",
            f"hydra.run.dir={places['LIVE_RUN_DIR']}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=scratch,
        start_new_session=True,
    )
    made = [
        _run(
            [*chatty, "task.steps=5", "task.step_sleep_s=0", f"hydra.run.dir={places['RUN_DIR']}"],
            scratch,
            env,
        ),
        _run(
            [
                chatty[0],
                "-m",
                "wf_launch",
                "-m",
                *chatty[3:],
                "task.steps=5",
                "task.step_sleep_s=0",
                "engine.dp_size=1,2",
                f"hydra.sweep.dir={places['SWEEP_DIR']}",
            ],
            scratch,
            env,
        ),
        _run(
            [
                chatty[0],
                "-m",
                "wf_launch",
                "task=train",
                "task.steps=2",
                "engine.dp_size=2",
                f"hydra.run.dir={places['CKPT_RUN_DIR']}",
            ],
            scratch,
            env,
        ),
    ]
    assert all(p.returncode == 0 for p in made), [p.stderr[-2000:] for p in made]
    return places, live


def _places_for(shown: Shown, places: dict[str, str]) -> dict[str, str]:
    """What the command's placeholders stand for: a run still going for ``--stacks``; for
    ``checkpoint``, a run that saved one (the docs' ``RUN_DIR``, ``run`` and the drill sample's run
    directory)."""
    words = shown.text.split()
    if "--stacks" in words:
        return {**places, "RUN_DIR": places["LIVE_RUN_DIR"]}
    if words[:3] == ["python", "-m", "wf_launch.checkpoint"]:
        run = places["CKPT_RUN_DIR"]
        return {**places, "RUN_DIR": run, "run": run, "drills/20261203-093812/interrupted": run}
    return places


@pytest.fixture(scope="module")
def docs_scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict, dict]]:
    """(scratch, environment, placeholders): the example code and the fixture runs, made once per
    worker; the run still going for ``--stacks`` ends with the module."""
    scratch = tmp_path_factory.mktemp("docs")
    _write_examples(scratch)
    _write_user_code(scratch)
    env = cli_env({"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    env["PYTHONPATH"] = os.pathsep.join([str(scratch / "examples"), env["PYTHONPATH"]])
    places, live = _fixtures(scratch, env)
    try:
        yield scratch, env, places
    finally:
        os.killpg(live.pid, signal.SIGTERM)
        live.wait(timeout=120)


DOC_NAMES = sorted({shown.doc for shown in shown_commands()})


def _key(argv: list[str]) -> str:
    """What makes two commands the same run: everything before the ``hydra.`` overrides."""
    return " ".join(argv[1:]).split(" hydra.")[0]


_PLACEHOLDERS = {name: name for name in ("RUN_DIR", "SWEEP_DIR", "LIVE_RUN_DIR", "CKPT_RUN_DIR")}


def _shared_key(shown: Shown) -> str:
    """The command as :func:`_key` sees it once its placeholders are filled (``export run`` and
    ``export RUN_DIR`` both read the run that saved a checkpoint)."""
    return _key(_argv(shown, Path("/scratch"), 0, _places_for(shown, _PLACEHOLDERS)))


def _first_docs() -> dict[str, str]:
    """Each command that names no run directory of its own -> the first document that shows it.
    A command shown in several documents runs once, for the first (in ``DOCS`` order)."""
    first: dict[str, str] = {}
    for shown in shown_commands():
        if skip_reason(shown) is None and "hydra.run.dir=" not in shown.text:
            first.setdefault(_shared_key(shown), shown.doc)
    return first


@pytest.mark.slow
# One document's commands (the largest, README.md, about 2 minutes on a quiet 2-core machine): the
# documents spread over the workers. A budget for the walk, not a wait.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("doc", DOC_NAMES)
def test_every_command_in_the_docs_runs(docs_scratch: tuple[Path, dict, dict], doc: str) -> None:
    scratch, env, places = docs_scratch
    cwd = (
        scratch / f"cwd-{doc.replace('/', '_')}"
    )  # what one document's commands write stays its own
    cwd.mkdir()
    _write_user_code(cwd)
    seen: set[str] = set()
    first = _first_docs()
    failures, skipped = [], []
    for index, shown in enumerate(shown_commands()):
        if shown.doc != doc:
            continue
        reason = skip_reason(shown)
        if reason is not None:
            skipped.append(f"{shown.doc}:{shown.line}: {shown.text} ({reason})")
            continue
        argv = _argv(shown, scratch, index, _places_for(shown, places))
        key = _key(argv)
        if first.get(_shared_key(shown), doc) != doc:
            skipped.append(f"{shown.doc}:{shown.line}: {shown.text} (runs for an earlier document)")
            continue
        if key in seen:
            continue
        seen.add(key)
        expected = _expected_code(shown)
        proc = _run(argv, cwd, env, interrupt=expected == 130)
        if proc.returncode != expected:
            failures.append(
                f"{shown.doc}:{shown.line}: {shown.text}\n  exit {proc.returncode}, expected "
                f"{expected}\n  {proc.stderr.strip()[-1500:]}"
            )
    print(f"ran {len(seen)} distinct commands; skipped {len(skipped)}:\n  " + "\n  ".join(skipped))
    assert failures == [], "\n".join(failures)


def _engine(text: str) -> tuple[int, ...]:
    sizes = dict(re.findall(r"engine\.(tp|cp|pp|dp)_size=(\d+)", text))
    return tuple(int(sizes.get(d, 1)) for d in ("tp", "cp", "pp", "dp"))


def test_sample_outputs_match_the_commands_they_follow() -> None:
    """A sample shows the layout its command launches, and a drill sample the injections its command
    asks for."""
    wrong = []
    for shown in shown_commands():
        for line in shown.output + shown.after:
            launched = _LAUNCH.search(line)
            sweep = re.search(r"wf_launch\s+(-m|--multirun)\s", shown.text + " ")
            if launched and not sweep and tuple(map(int, launched.groups())) != _engine(shown.text):
                wrong.append(
                    f"{shown.doc}:{shown.line}: `{shown.text}` but the sample launches "
                    f"{line.strip()}"
                )
            drilled = re.search(r"drill: interrupted run in .*: (.*)$", line)
            asked = re.search(r"--inject (\S+)", shown.text)
            if drilled and asked and drilled.group(1).replace(" ", "") != asked.group(1):
                wrong.append(
                    f"{shown.doc}:{shown.line}: `{shown.text}` but the sample injects "
                    f"{drilled.group(1)}"
                )
        wrong += _drill_sample(shown)
    assert wrong == [], "\n".join(wrong)


def _drill_sample(shown: Shown) -> list[str]:
    """A drill's verdict shows each injection at (or just after) the step asked, and no step past
    the task's last."""
    asked = re.search(r"--inject (\S+)", shown.text)
    injected = [
        (m.group(1), int(m.group(2)))
        for line in shown.output
        if (m := re.match(r"\s+(kill9|sigterm|usr2) at step (\d+)", line))
    ]
    if not asked or not injected:
        return []
    wanted = [
        (item.split("@")[0].split(":")[0], int(item.split("@")[1]))
        for item in asked.group(1).split(",")
    ]
    where = f"{shown.doc}:{shown.line}: `{shown.text}`"
    wrong = []
    if [k for k, _ in injected] != [k for k, _ in wanted] or any(
        not want <= got <= want + 2 for (_, got), (_, want) in zip(injected, wanted)
    ):
        wrong.append(f"{where} but the sample injects {injected}")
    steps = (
        int(re.search(r"task\.steps=(\d+)", shown.text).group(1))
        if "task.steps=" in shown.text
        else 10
    )
    reached = [
        int(m.group(1)) for line in shown.output if (m := re.search(r"reached step (\d+)", line))
    ]
    if any(r > steps for r in reached):
        wrong.append(f"{where} runs {steps} steps but the sample reaches step {max(reached)}")
    return wrong
