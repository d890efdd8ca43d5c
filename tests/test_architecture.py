"""How the code is organised, checked: floors that hold (no import runs back up, no cycles), imports
at the top, one owner of the run directory's file names, torch's private names in one adapter,
short functions, folders by where code runs, one writer of result.json, open launchers."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli_env

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("wf_launch", "worldfoundry", "hydra_plugins")
THIRD_PARTY = Path(__file__).parent / "third_party"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks (never executed: no runtime
    cycle).
    """
    skip: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
        ):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every repo module ``name`` imports when it runs, at module level or inside functions."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_import_graph_has_no_cycles() -> None:
    graph = _graph()
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


SHIMS = tuple(
    f"wf_launch.{name}"
    for name in ("status", "runs", "plot", "drill", "sweep_report", "checkpoint", "run", "tune")
)
FLOORS: list[tuple[str, ...]] = [
    ("worldfoundry", "wf_launch.conf"),
    ("wf_launch.config",),
    ("wf_launch.rundir",),
    ("wf_launch.rank",),
    ("wf_launch.observe",),
    ("wf_launch.launchers",),
    ("wf_launch.tasks", "hydra_plugins"),
    ("wf_launch.app", "wf_launch.readers"),
    ("wf_launch.cli",),
    ("wf_launch.drivers",),
    ("wf_launch", "wf_launch.__main__", *SHIMS),
]
"""The floors, from the ground up. A part imports only itself and the floors below it (never a
part beside it on its own floor): the runtime library and the YAML configs, then the config
schema and the run directory's format, what runs in a rank, what watches ranks, the launchers,
the built-in tasks and the Hydra launcher plugins, the app and the commands that read runs, the
CLI, the commands that start runs through it, and the package's face with the
``python -m wf_launch.NAME`` shims."""


def _part(module: str) -> str:
    """The part of the tree ``module`` is in: ``wf_launch.rank`` for ``wf_launch.rank.stop``."""
    parts = module.split(".")
    if parts[0] != "wf_launch":
        return parts[0]
    return ".".join(parts[:2])


def test_every_import_runs_down_a_floor() -> None:
    """Imports at module level and inside functions count; ``if TYPE_CHECKING:`` ones do not."""
    floor = {part: level for level, parts in enumerate(FLOORS) for part in parts}
    graph = _graph()
    unplaced = sorted({_part(m) for m in graph} - set(floor))
    assert unplaced == [], f"put these parts on a floor in FLOORS: {unplaced}"
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if _part(name) != _part(target) and floor[_part(target)] >= floor[_part(name)]
    )
    assert upward == [], f"imports that run up (or across) a floor: {upward}"


MAX_FUNCTION_LEVEL_IMPORTS = 20


def _function_level_project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of the project's own modules made inside a function."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    found: set[tuple[int, str]] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                name = "." * node.level + (node.module or "")
                if node.level or name.split(".")[0] in PACKAGES:
                    found.add((node.lineno, name))
            elif isinstance(node, ast.Import):
                found |= {
                    (node.lineno, a.name) for a in node.names if a.name.split(".")[0] in PACKAGES
                }
    return sorted(found)


def test_project_modules_are_imported_at_the_top() -> None:
    """At most 20 imports of the project's own modules sit inside functions, each with its reason
    (a comment on the import's line or the line above): a hidden import hides a real arrow."""
    found, unexplained = [], []
    for path in _code_files():
        lines = path.read_text().splitlines()
        for lineno, name in _function_level_project_imports(path):
            where = f"{path.relative_to(REPO)}:{lineno} {name}"
            found.append(where)
            if "#" not in lines[lineno - 1] and not lines[lineno - 2].strip().startswith("#"):
                unexplained.append(where)
    assert len(found) <= MAX_FUNCTION_LEVEL_IMPORTS, (
        f"{len(found)} function-level imports of project modules (at most "
        f"{MAX_FUNCTION_LEVEL_IMPORTS}): {found}"
    )
    assert unexplained == [], f"function-level imports without a reason: {unexplained}"


def test_no_module_imports_a_private_name_of_another() -> None:
    """``from .x import _name`` reaches into another module's insides: make the name public.

    Third-party private names live in their adapters (the two tests above)."""
    offenders = []
    for path in _code_files():
        for node in ast.walk(ast.parse(path.read_text())):
            own = isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").split(".")[0] in PACKAGES
            )
            if own:
                offenders += [
                    f"{path.relative_to(REPO)}:{node.lineno} {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert offenders == [], f"imports of private names: {offenders}"


def _code_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]


def test_no_module_imports_hydra_internals() -> None:
    offenders = []
    for path in _code_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith("hydra._internal")
            ]
    assert offenders == []


_SUBMITIT_PRIVATE = re.compile(
    r"\b(_make_sbatch_string|_convert_mem|core\._submit|submitit\.\w+(\.\w+)*\._\w+)"
)


def test_submitit_private_names_live_in_one_module() -> None:
    users = sorted(
        str(p.relative_to(REPO)) for p in _code_files() if _SUBMITIT_PRIVATE.search(p.read_text())
    )
    assert len(users) <= 1, (
        f"submitit's private names are used in {users}; keep them in one adapter module"
    )


def _code_strings_and_attrs(path: Path) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    strings = {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    }
    in_messages = {
        id(a) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for a in ast.walk(n)
    }
    attrs = {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and id(n) not in in_messages
    }
    return strings, attrs


def test_result_json_is_written_and_read_by_the_run_record_only() -> None:
    users = []
    for path in _code_files():
        strings, attrs = _code_strings_and_attrs(path)
        rel = str(path.relative_to(REPO))
        if rel in ("wf_launch/rundir/record.py", "wf_launch/rundir/files.py"):
            continue
        if "RESULT" in attrs or any(
            "result.json" in s for s in strings if "\n" not in s and len(s) < 40
        ):
            users.append(rel)
    assert users == [], (
        f"modules that touch result.json without wf_launch.rundir.record.RunRecord: {users}"
    )


RUN_DIR_NAMES = {
    "result.json",
    "config.yaml",
    "overrides.yaml",
    "environment.json",
    "launcher.log",
    ".wf_launch.lock",
    "logs",
    "metrics.jsonl",
    "metrics.png",
    "checkpoints",
    "code",
    "SNAPSHOT.json",
    "slurm_job.json",
    "ray_run.json",
    "multirun.yaml",
    "sweep_summary.csv",
    "sweep_summary.md",
    "sweep_chart.png",
    "sweep_scaling.png",
    "sweep_steps.png",
    ".hydra",
    ".elastic",
    "hydra.yaml",
}
_RANK_FILE = re.compile(
    r"rank\{[^}]*\}\.(log|error\.json|progress\.json|stacks|pid|preempt\.json|arrived|joined)|"
    r"attempt\{[^}]*\}\.json|(?<![\w.])(result|config|environment|metrics|slurm_job|ray_run)"
    r"\.(json|yaml|jsonl)\b"
)
RUN_DIR_OWNER = "wf_launch/rundir/files.py"


def _literals(path: Path) -> list[str]:
    """String literals and f-string templates of ``path``, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    inside_fstrings = {
        id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values
    }
    out = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr)]
    out += [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and id(n) not in docstrings
        and id(n) not in inside_fstrings
    ]
    return out


def _code_text(path: Path) -> str:
    """The module's code without docstrings and comments (what runs)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        ):
            node.body[0].value.value = ""
    return ast.unparse(tree)


def test_run_directory_file_names_are_spelled_in_one_module() -> None:
    """Every file name of a run (or sweep) directory is a literal in wf_launch/rundir/files.py."""
    offenders = []
    for path in _code_files():
        rel = str(path.relative_to(REPO))
        if rel == RUN_DIR_OWNER or not rel.startswith(("wf_launch/", "hydra_plugins/")):
            continue
        for text in _literals(path):
            if text in RUN_DIR_NAMES or _RANK_FILE.search(text):
                offenders.append(f"{rel}: {text!r}")
    assert offenders == [], f"run-directory file names outside {RUN_DIR_OWNER}: {offenders}"


def test_torch_private_names_live_in_one_adapter() -> None:
    """Private torch names (``torch...._x``, and every name the adapter lists) appear in the adapter
    only.
    """
    from worldfoundry.core import torch_private

    adapter = Path(torch_private.__file__).resolve()
    listed = {
        name.rpartition(".")[2]
        for _, name, _, _ in torch_private.PRIVATE_NAMES
        if name.rpartition(".")[2].startswith("_")
    }
    listed |= {
        module.rpartition(".")[2]
        for module, *_ in torch_private.PRIVATE_NAMES
        if module.rpartition(".")[2].startswith("_")
    }
    pattern = re.compile(
        r"\btorch(\.\w+)*\._[a-z]\w*|\b(" + "|".join(sorted(map(re.escape, listed))) + r")\b"
    )
    users = sorted(
        str(p.relative_to(REPO))
        for p in _code_files()
        if p.resolve() != adapter and pattern.search(_code_text(p))
    )
    assert users == [], (
        f"torch's private names are used outside {adapter.relative_to(REPO)}: {users}"
    )


def test_the_launcher_side_never_asks_the_cuda_runtime() -> None:
    """``torch.cuda.is_available()`` (the CUDA runtime) in a process that forks ranks makes every
    forked rank fail with "Cannot re-initialize CUDA in forked subprocess" (seen on an H200): the
    launcher side of ``wf_launch`` asks ``backends.local_gpu_count()`` (NVML) instead. Ranks and
    tasks may ask."""
    launcher_side = [
        str(p.relative_to(REPO))
        for p in _code_files()
        if "cuda.is_available()" in _code_text(p)
        and p.relative_to(REPO).parts[0] == "wf_launch"
        and not {"rank", "tasks"} & set(p.relative_to(REPO).parts)
    ]
    assert launcher_side == [], f"the CUDA runtime is asked by launcher-side code: {launcher_side}"


MAX_FUNCTION_LINES = 90


def test_no_function_is_longer_than_the_limit() -> None:
    long = []
    for path in _code_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(
                        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)"
                    )
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines: {long}"


MAX_COMPLEXITY = 15


def test_no_function_branches_more_than_the_limit() -> None:
    """radon's cyclomatic complexity of every function in wf_launch/ and worldfoundry/ is <= 15.

    A function over it is broken by meaning (a table of cases, a small class, one function
    per branch's job); the message lists every offender.
    """
    from radon.complexity import cc_visit  # radon is a dev dependency, needed by this test only

    over = []
    for pkg in ("wf_launch", "worldfoundry"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            for block in cc_visit(path.read_text()):
                # a class counts through its methods, not as one block
                for fn in getattr(block, "methods", [block]):
                    if fn.complexity > MAX_COMPLEXITY:
                        name = f"{fn.classname}.{fn.name}" if fn.classname else fn.name
                        over.append(
                            f"{path.relative_to(REPO)}:{fn.lineno} {name} ({fn.complexity})"
                        )
    over = sorted(set(over))
    assert over == [], f"functions over complexity {MAX_COMPLEXITY}: {over}"


APP_MODULES = {"__init__.py", "__main__.py", "cli.py", "app.py"}
COMMAND_SHIMS = {
    "status.py",
    "runs.py",
    "plot.py",
    "drill.py",
    "sweep_report.py",
    "checkpoint.py",
    "run.py",
    "tune.py",
}
"""``python -m wf_launch.NAME`` entry points (and ``wf_launch.checkpoint``'s documented import): a
few lines each.
"""


def test_top_level_holds_only_the_cli_and_app() -> None:
    top = REPO / "wf_launch"
    modules = {p.name for p in top.glob("*.py")}
    assert modules - APP_MODULES - COMMAND_SHIMS == set(), (
        "wf_launch/ must hold only the CLI and app modules; "
        "put code in the folder that says where it runs "
        "(config, rank, rundir, observe, launchers, tasks, readers, drivers)"
    )
    for name in COMMAND_SHIMS & modules:
        tree = ast.parse((top / name).read_text())
        code = [
            n
            for n in tree.body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        ]
        assert len(code) <= 6 and not any(
            isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in code
        ), (
            f"wf_launch/{name} is a command's entry point: "
            "it imports from its folder and defines nothing"
        )
    packages = {p.name for p in top.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == {
        "conf",
        "config",
        "launchers",
        "observe",
        "rank",
        "rundir",
        "tasks",
        "readers",
        "drivers",
    }, packages


def test_an_int_is_never_a_bool_is_spelled_once() -> None:
    """The "an int but not a bool" check lives in worldfoundry.core.validation; everything else
    calls it.
    """
    idiom = re.compile(
        r"isinstance\(\s*(\w+(?:\.\w+)*)\s*,\s*bool\s*\)\s*or\s+"
        r"not\s+isinstance\(\s*\1\s*,\s*\(?int|"
        r"isinstance\(\s*(\w+(?:\.\w+)*)\s*,\s*\(?int[^)]*\)+\s*(and|or)\s+"
        r"(not\s+)?isinstance\(\s*\2\s*,\s*bool"
    )
    users = sorted(
        str(p.relative_to(REPO))
        for p in _code_files()
        if p.name != "validation.py" and idiom.search(p.read_text())
    )
    assert users == [], f"spell it as worldfoundry.core.validation.is_int / is_number: {users}"


def _third_party_env() -> dict[str, str]:
    env = cli_env()
    env["PYTHONPATH"] = f"{THIRD_PARTY}:{env['PYTHONPATH']}"
    return env


def test_third_party_launcher_from_an_entry_point_is_listed_and_runs(tmp_path: Path) -> None:
    env = _third_party_env()
    help_out = subprocess.run(
        [sys.executable, "-m", "wf_launch", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert help_out.returncode == 0, help_out.stderr
    assert re.search(r"^launcher: .*\binproc\b", help_out.stdout, re.M), help_out.stdout

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=inproc",
            "task=noop",
            "launcher.greeting=hi",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    from wf_launch.rundir.record import RunRecord, Status

    record = RunRecord.read(run_dir)
    assert record is not None and record.status is Status.OK and record.final
    assert record.launcher == "inproc" and record.task == "noop" and "0" in record.results

    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=inproc",
            "engine.dp_size=2",
            f"hydra.run.dir={tmp_path / 'bad'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert (
        bad.returncode == 2 and "launcher.name='inproc' is not allowed: runs one rank" in bad.stderr
    )


def test_unknown_launcher_names_the_registered_ones() -> None:
    from wf_launch.config import ConfigError
    from wf_launch.launchers import get_launcher

    with pytest.raises(
        ConfigError,
        match=r"launcher\.name='k8s' is not allowed: choose one of \[.*'local'.*'slurm'",
    ):
        get_launcher("k8s")


def test_register_launcher_refuses_an_incomplete_class() -> None:
    from wf_launch.launchers import LauncherConfig, register_launcher

    class NoLaunch:
        name = "nolaunch"
        config_class = LauncherConfig

        def validate(self, cfg: dict, layout: object, engine: dict) -> None: ...

        def describe(self, plan: object) -> str:
            return ""

    with pytest.raises(ValueError, match=r"lacks \['launch'\]"):
        register_launcher(NoLaunch)
