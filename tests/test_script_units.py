"""task=script / task=call / wf_launch.run without launching ranks: torchrun's flags, quoting, the
environment contract, running code as __main__, the helpers outside wf_launch, and the bad inputs
refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_helpers import cli_env, run_python_m
from hypothesis import given, settings
from hypothesis import strategies as st

from wf_launch.config import ConfigError
from wf_launch.drivers.run import RunCommandError, hydra_quote, overrides_for, parse
from wf_launch.rank import user_code
from wf_launch.tasks.call import CallConfig
from wf_launch.tasks.script import ScriptConfig, argv_of, find_module
from wf_launch.tasks.torchrun_env import torchrun_environ

SCRIPTS = Path(__file__).parent / "scripts"
CONFIG = {
    "engine": {
        "tp_size": 1,
        "cp_size": 2,
        "pp_size": 1,
        "dp_size": 2,
        "order": "tp-cp-pp-dp",
        "distributed_backend": "gloo",
        "distributed_timeout_minutes": 0.5,
    },
    "launcher": {"name": "local", "max_restarts": 2},
    "task": {"name": "script"},
}


# ------------------------------------------------------------------ quoting: the script's arguments
# reach it as typed
@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.text(
            alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
            max_size=12,
        ),
        max_size=4,
    )
)
def test_any_argument_survives_hydra_and_omegaconf_exactly(args: list[str]) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    override = "task.args=[" + ",".join(hydra_quote(a) for a in args) + "]"
    value = OverridesParser.create().parse_override(override).value()
    assert OmegaConf.to_container(OmegaConf.create({"a": value}), resolve=True)["a"] == args


@pytest.mark.parametrize(
    "text",
    [
        "${engine.cp_size}",
        "a\\${x}",
        "it's",
        "end\\",
        "a,b",
        "[x]",
        "{a:1}",
        "",
        "007",
        "true",
        "null",
        "1e-3",
    ],
)
def test_tricky_arguments_are_kept_literally(text: str) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    value = OverridesParser.create().parse_override(f"task.path={hydra_quote(text)}").value()
    assert OmegaConf.to_container(OmegaConf.create({"a": value}), resolve=True)["a"] == text


def test_hydra_parsed_args_become_the_text_the_user_typed() -> None:
    assert argv_of(["--lr", 0.1, "--cp", 2, "--flag", True]) == [
        "--lr",
        "0.1",
        "--cp",
        "2",
        "--flag",
        "true",
    ]
    for bad, field in (
        ("--lr", "task.args"),
        ([["a"]], "task.args[0]"),
        ([None], "task.args[0]"),
        ({"a": 1}, "task.args"),
    ):
        with pytest.raises(ConfigError, match=rf"^{field.replace('[', '.').replace(']', '.')}="):
            argv_of(bad)


# ------------------------------------------------------------------ python -m wf_launch.run:
# torchrun's flags
def test_torchrun_flags_map_onto_task_script_on_the_local_launcher() -> None:
    cmd = parse(
        [
            "--nproc_per_node=4",
            "--nnodes",
            "1:1",
            "--standalone",
            "--max-restarts",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:29511",
            "--monitor-interval",
            "0.5",
            "--start-method",
            "spawn",
            "--local-ranks-filter",
            "0",
            "--run-dir",
            "out/r1",
            "--set",
            "engine.cp_size=2",
            "train.py",
            "--lr",
            "0.1",
            "--",
            "a b",
        ]
    )
    assert cmd.nproc == 4 and cmd.script == "train.py" and cmd.args == ["--lr", "0.1", "--", "a b"]
    over = overrides_for(cmd)
    assert over[:6] == [
        "task=script",
        "launcher=local",
        "engine.dp_size=2",
        "launcher.max_restarts=2",
        "task.path='train.py'",
        "task.args=['--lr','0.1','--','a b']",
    ]
    assert {
        "launcher.rdzv_port=29511",
        "launcher.monitor_interval_s=0.5",
        "launcher.start_method=spawn",
        "launcher.console_ranks=[0]",
        "engine.cp_size=2",
    } <= set(over)
    assert over[-1] == f"hydra.run.dir={hydra_quote(str(Path('out/r1').absolute()))}"
    module = parse(["-m", "pkg.train", "--epochs", "3"])
    assert module.module and module.nproc == 1 and "task.module='pkg.train'" in module.overrides
    assert parse(["--", "train.py", "-x"]).args == ["-x"]
    assert "launcher.console_ranks=[]" in parse(["--redirects", "3", "t.py"]).overrides


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "t.py"], "--nnodes 2: wf_launch.run runs on one node"),
        (["--node-rank", "1", "t.py"], "--node-rank 1"),
        (["--rdzv-backend", "etcd", "t.py"], "--rdzv-backend etcd"),
        (["--rdzv-endpoint", "10.0.0.5:29500", "t.py"], "--rdzv-endpoint 10.0.0.5"),
        (["--master-addr", "node7", "t.py"], "--master-addr node7"),
        (["--rdzv-id", "42", "t.py"], "--rdzv-id: cannot be honoured"),
        (["--no-python", "t.py"], "--no-python: cannot be honoured"),
        (["--log-dir", "logs", "t.py"], "--log-dir: cannot be honoured"),
        (["--role", "trainer", "t.py"], "--role trainer"),
        (["--redirects", "0:3,1:0", "t.py"], "per-rank maps are not supported"),
        (["--nproc-per-node", "0", "t.py"], "--nproc-per-node 0"),
        (["--nproc-per-node", "gpu", "t.py"], "no CUDA GPU"),
        (
            ["--nproc-per-node", "6", "--set", "engine.cp_size=4", "t.py"],
            "not a multiple of tp x cp x pp = 4",
        ),
        (["--nproc-per-node", "4", "--set", "engine.dp_size=3", "t.py"], "engine.dp_size=3"),
        (["--set", "task.path=x.py", "t.py"], "sets task.path itself"),
        (["--set", "nokey", "t.py"], "expected KEY=VALUE"),
    ],
)
def test_flags_that_cannot_be_honoured_are_refused(argv: list[str], message: str) -> None:
    if argv[1:2] == ["gpu"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this host has a GPU")
    with pytest.raises(RunCommandError, match=message.replace("(", r"\(").replace("+", r"\+")):
        parse(argv)


def test_wf_launch_run_refuses_before_anything_starts(tmp_path: Path) -> None:
    """Exit 2 with the flag named, nothing written; the console script is installed too."""
    for argv, needle in (
        (["--nnodes", "2", "train.py"], "wf_launch.run: --nnodes 2"),
        (["--nproc-per-node", "2", "missing.py"], "task.path='missing.py' is not allowed"),
    ):
        proc = run_python_m(
            "wf_launch.run",
            [*argv],
            capture_output=True,
            text=True,
            env=cli_env(),
            cwd=tmp_path,
            timeout=120,
        )
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("logs"))
    wf_run = Path(sys.executable).with_name("wf-run")
    assert wf_run.exists()
    usage = subprocess.run(
        [str(wf_run), "--help"], capture_output=True, text=True, env=cli_env(), timeout=60
    )
    assert usage.returncode == 0 and "--nproc-per-node" in usage.stdout


# ------------------------------------------------------------------ the environment contract
def test_torchrun_environment_keeps_the_launchers_values_and_fills_the_rest(tmp_path: Path) -> None:
    agent = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "job-7",
        "WF_ATTEMPT": "2",
    }
    env = torchrun_environ(CONFIG, tmp_path / "run", agent)
    assert env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2" and env["ROLE_RANK"] == "3"
    assert (
        env["ROLE_WORLD_SIZE"] == "4"
        and env["MASTER_ADDR"] == "n1"
        and env["MASTER_PORT"] == "29400"
    )
    assert env["TORCHELASTIC_RUN_ID"] == "job-7" and env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "2"
    assert {
        k: env[k] for k in ("WF_TP_SIZE", "WF_CP_SIZE", "WF_PP_SIZE", "WF_DP_SIZE", "WF_ORDER")
    } == {
        "WF_TP_SIZE": "1",
        "WF_CP_SIZE": "2",
        "WF_PP_SIZE": "1",
        "WF_DP_SIZE": "2",
        "WF_ORDER": "tp-cp-pp-dp",
    }
    assert env["WF_RUN_DIR"] == str((tmp_path / "run").absolute())
    alone = torchrun_environ(
        {**CONFIG, "engine": {**CONFIG["engine"], "cp_size": 1, "dp_size": 1}}, tmp_path, {}
    )
    assert alone["RANK"] == "0" and alone["WORLD_SIZE"] == "1" and alone["MASTER_PORT"].isdigit()
    assert alone["TORCHELASTIC_RUN_ID"] == tmp_path.name


def test_dist_init_without_a_config_builds_the_layout_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a script's ``worldfoundry.core.distributed.dist_init()`` does: one real gloo rank
    here."""
    from worldfoundry.core.distributed import destroy_model_parallel, dist_init, get_layout
    from worldfoundry.core.distributed.env import engine_from_environ

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert engine_from_environ({}) == {"dp_size": None}
    with pytest.raises(ValueError, match="WF_CP_SIZE='two' is not an integer"):
        engine_from_environ({"WF_CP_SIZE": "two"})
    monkeypatch.setenv("WF_ORDER", "tp-dp-cp-pp")
    monkeypatch.setenv("WF_DISTRIBUTED_BACKEND", "gloo")
    dist_init()
    try:
        assert get_layout().dims == ("tp", "dp", "cp", "pp") and get_layout().world_size == 1
    finally:
        destroy_model_parallel()


# ------------------------------------------------------------------ running code as __main__
def _write(path: Path, code: str) -> Path:
    path.write_text(textwrap.dedent(code))
    return path


def test_a_script_runs_as_main_with_its_argv_and_its_folder_on_the_path(tmp_path: Path) -> None:
    (tmp_path / "helper_mod_x.py").write_text("VALUE = 41\n")
    script = _write(
        tmp_path / "s.py",
        """
        import atexit, sys
        import helper_mod_x
        assert __name__ == "__main__"
        OUT = sys.argv[2]
        atexit.register(lambda: open(OUT, "w").write(f"{sys.argv[1]} {helper_mod_x.VALUE + 1}"))
        """,
    )
    argv, path = list(sys.argv), list(sys.path)
    user_code.run_path(str(script), ["x y", str(tmp_path / "out.txt")])
    assert (
        tmp_path / "out.txt"
    ).read_text() == "x y 42"  # the script's atexit handler ran when it ended
    assert sys.argv == argv and sys.path == path


@pytest.mark.parametrize(
    ("code", "exit_code"),
    [
        ("sys.exit()", None),
        ("sys.exit(0)", None),
        ("sys.exit(3)", 3),
        ("sys.exit('bad data')", 1),
        ("sys.exit(-1)", 255),
        ("raise KeyError('k')", "KeyError"),
    ],
)
def test_how_a_script_ends(tmp_path: Path, code: str, exit_code: object) -> None:
    script = _write(tmp_path / "e.py", f"import sys\n\n\ndef main():\n    {code}\n\n\nmain()\n")
    if exit_code is None:
        user_code.run_path(str(script), [])
    elif exit_code == "KeyError":
        with pytest.raises(KeyError):
            user_code.run_path(str(script), [])
    else:
        with pytest.raises(user_code.ScriptExit) as info:
            user_code.run_path(str(script), [])
        assert info.value.exit_code == exit_code and "e.py:5 (main)" in str(info.value)


def test_module_form_and_finding_modules_without_importing_them(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg_q"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (pkg / "train.py").write_text("")
    (tmp_path / "runme_q.py").write_text("import sys\nRESULT = sys.argv[:]\n")
    assert find_module("mypkg_q.train", tmp_path) and not find_module("mypkg_q.nope", tmp_path)
    assert not find_module("mypkg_q", tmp_path)  # a package without __main__.py cannot run with -m
    assert "mypkg_q" not in sys.modules
    user_code.run_module("runme_q", ["--a"], str(tmp_path))


# ------------------------------------------------------------------ the helpers outside wf_launch
def test_helpers_are_harmless_no_ops_outside_wf_launch() -> None:
    from wf_launch import checkpoint, progress, report_result, should_stop

    progress(3, 10, loss=0.5)
    assert should_stop() is False
    assert checkpoint.load({"x": 1}) is None and checkpoint.latest_step() is None
    checkpoint.save(1, {"x": 1})
    checkpoint.wait()
    report_result({"ok": True})
    for bad, error in (
        ([1], TypeError),
        ({1: 2}, TypeError),
        ({"exit_code": 0}, ValueError),
        ({"x": object()}, TypeError),
    ):
        with pytest.raises(error):
            report_result(bad)


# ------------------------------------------------------------------ bad inputs, each naming its
# field
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, r"task.path=None is not allowed: set exactly one of task.path .* neither is set"),
        ({"path": "s.py", "module": "m"}, "both are set"),
        ({"path": "missing.py"}, r"task.path='missing.py' is not allowed: an existing script"),
        ({"module": "no_such_module_q"}, r"task.module='no_such_module_q' is not allowed"),
        ({"module": "a..b"}, r"task.module='a..b' is not allowed: a dotted module name"),
        ({"path": "s.py", "args": "--lr"}, r"task.args='--lr' is not allowed: a list of strings"),
        (
            {"path": "s.py", "workdir": "/no/such/dir"},
            r"task.workdir='/no/such/dir' is not allowed",
        ),
        ({"path": "s.py", "keep": 0}, r"task.keep=0 is not allowed"),
    ],
)
def test_bad_script_configs_name_the_field(tmp_path: Path, fields: dict, message: str) -> None:
    (tmp_path / "s.py").write_text("")
    with pytest.raises(ConfigError, match=message):
        ScriptConfig.build({"name": "script", "workdir": str(tmp_path), **fields}).validate()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"target": "callmod_q.main"},
            r"task.target='callmod_q.main' is not allowed: module:function",
        ),
        ({"target": "no_such_q:main"}, r"an importable module \(import no_such_q failed"),
        ({"target": "callmod_q:nope"}, r"'nope' does not exist there"),
        ({"target": "callmod_q:VALUE"}, r"a callable \(VALUE is a int\)"),
        (
            {"target": "callmod_q:main", "kwargs": [1]},
            r"task.kwargs=\[1\] is not allowed: a mapping",
        ),
        (
            {"target": "callmod_q:main", "kwargs": {"epochs": 1}},
            r"got an unexpected keyword argument 'epochs'",
        ),
        ({"target": "callmod_q:main", "kwargs": {"ctx": 1}}, r"other than ctx"),
    ],
)
def test_bad_call_configs_name_the_field(tmp_path: Path, fields: dict, message: str) -> None:
    (tmp_path / "callmod_q.py").write_text(
        "VALUE = 3\n\n\ndef main(lr=0.1, ctx=None):\n    return {'lr': lr}\n"
    )
    with pytest.raises(ConfigError, match=message):
        CallConfig.build({"name": "call", "workdir": str(tmp_path), **fields}).validate()
    CallConfig.build(
        {
            "name": "call",
            "workdir": str(tmp_path),
            "target": "callmod_q:main",
            "kwargs": {"lr": 0.5},
        }
    ).validate()


def test_bad_inputs_exit_2_before_anything_starts_and_the_dry_run_shows_each_command(
    tmp_path: Path,
) -> None:
    env = cli_env()
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "task=script",
            f"task.path={tmp_path}/nope.py",
            f"hydra.run.dir={tmp_path / 'bad'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert bad.returncode == 2 and "task.path=" in bad.stderr and "an existing script" in bad.stderr
    assert not (tmp_path / "bad" / "logs").exists()
    dry = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "task=script",
            f"task.path={SCRIPTS / 'no_group.py'}",
            "task.args=[--out-dir,'a b',--cp,${engine.cp_size}]",
            "engine.cp_size=2",
            "engine.dp_size=2",
            "launcher.dry_run=true",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    out = dry.stdout
    assert f"working dir   {tmp_path}" in out and "WF_CP_SIZE=2" in out and "WORLD_SIZE=4" in out
    for r in range(4):
        assert (
            f"RANK={r} LOCAL_RANK={r} ROLE_RANK={r} {sys.executable} {SCRIPTS / 'no_group.py'} "
            "--out-dir 'a b' --cp 2" in out
        ), out
    assert not any(tmp_path.rglob("logs"))


_hostile = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.sampled_from(
        [
            "",
            "a..b",
            ":",
            "os:getcwd",
            "os:sep",
            "x.py",
            "\n",
            "../..",
            "s.py",
            "callmod_q:main",
            "json:dumps",
        ]
    )
)
_field_values = st.recursive(
    _hostile,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=2)
    ),
    max_leaves=4,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["path", "module", "args", "fresh_interpreter", "keep", "target", "kwargs", "workdir"]
        ),
        _field_values,
        max_size=4,
    )
)
def test_any_script_or_call_config_is_accepted_or_refused_with_a_config_error(
    tmp_path_factory: pytest.TempPathFactory, fields: dict
) -> None:
    """Hostile values for every field: validation accepts them or raises ConfigError, never anything
    else."""
    workdir = tmp_path_factory.getbasetemp() / "fuzz_workdir"
    workdir.mkdir(exist_ok=True)
    (workdir / "s.py").write_text("")
    (workdir / "callmod_q.py").write_text("def main(lr=0.1):\n    return {}\n")
    for cls, own in (
        (ScriptConfig, ("path", "module", "args")),
        (CallConfig, ("target", "kwargs")),
    ):
        chosen = {
            k: v for k, v in fields.items() if k in (*own, "fresh_interpreter", "keep", "workdir")
        }
        chosen.setdefault("workdir", str(workdir))
        try:
            cls.build({"name": cls.__name__, **chosen}).validate()
        except ConfigError:
            pass


def test_a_fresh_interpreter_imports_nothing_of_torch_before_the_script(tmp_path: Path) -> None:
    """What ``task.fresh_interpreter=true`` promises: the script finds torch not imported (one rank,
    in a new interpreter, through the same entrypoint the fresh child runs)."""
    import pickle

    from wf_launch.rank.entrypoint import RankSpec

    script = _write(
        tmp_path / "probe.py",
        """
        import json, os, sys
        seen = {"torch": "torch" in sys.modules, "argv": sys.argv, "rank": os.environ["RANK"],
                "run_dir": os.environ["WF_RUN_DIR"]}
        json.dump(seen, open(sys.argv[1], "w"))
        """,
    )
    run_dir = tmp_path / "run"
    config = {
        **CONFIG,
        "engine": {**CONFIG["engine"], "cp_size": 1, "dp_size": 1},
        "task": {
            "name": "script",
            "modules": [],
            "path": str(script),
            "module": None,
            "args": [str(tmp_path / "seen.json")],
            "workdir": str(tmp_path),
            "fresh_interpreter": True,
            "keep": 3,
        },
    }
    (tmp_path / "spec.pkl").write_bytes(pickle.dumps(RankSpec(config=config, run_dir=str(run_dir))))
    code = (
        "import pickle, sys; from wf_launch.rank import fresh; fresh.mark_fresh(); "
        "from wf_launch.rank.entrypoint import rank_main; rank_main(pickle.load(open(sys.argv[1], "
        "'rb')))"
    )
    env = {k: v for k, v in cli_env().items() if not k.startswith(("TORCHELASTIC", "WF_"))}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "spec.pkl")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {
        "torch": False,
        "argv": [str(script), str(tmp_path / "seen.json")],
        "rank": "0",
        "run_dir": str(run_dir),
    }
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "ok" and record["results"] == {"0": {"exit_code": 0}}
