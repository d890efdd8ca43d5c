"""What we rely on from submitit and Hydra is still there (an upgrade fails here first, loudly), and
private names stay where they belong: submitit's in one adapter module, Hydra's ``_internal``
nowhere."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from wf_launch.launchers.slurm import submitit_adapter

ROOT = Path(__file__).resolve().parents[1]

# (module, dotted attribute) of Hydra's public API that hydra_plugins/, wf_launch/cli.py,
# wf_launch/sweep_report.py and tests/test_hydra_launcher.py use.
HYDRA_NAMES = [
    ("hydra.plugins.launcher", "Launcher"),
    ("hydra.plugins.launcher", "Launcher.setup"),
    ("hydra.plugins.launcher", "Launcher.launch"),
    ("hydra.core.utils", "run_job"),
    ("hydra.core.utils", "configure_log"),
    ("hydra.core.utils", "setup_globals"),
    ("hydra.core.utils", "filter_overrides"),
    ("hydra.core.utils", "JobReturn.return_value"),
    ("hydra.core.utils", "JobStatus.COMPLETED"),
    ("hydra.types", "HydraContext"),
    ("hydra.types", "TaskFunction"),
    ("hydra.core.config_store", "ConfigStore.store"),
    ("hydra.core.config_loader", "ConfigLoader.load_sweep_config"),
    ("hydra.core.config_loader", "ConfigLoader.list_groups"),
    ("hydra.core.config_loader", "ConfigLoader.get_group_options"),
    ("hydra.core.global_hydra", "GlobalHydra.config_loader"),
    ("hydra.core.object_type", "ObjectType.CONFIG"),
    ("hydra.core.object_type", "ObjectType.GROUP"),
    ("hydra.core.hydra_config", "HydraConfig.get"),
    ("hydra.core.plugins", "Plugins.discover"),
    ("hydra.core.override_parser.overrides_parser", "OverridesParser.parse_overrides"),
    ("hydra.core.override_parser.types", "Override.get_key_element"),
    ("hydra.core.override_parser.types", "Override.is_sweep_override"),
    ("hydra.core.override_parser.types", "Override.is_discrete_sweep"),
    ("hydra.core.override_parser.types", "Override.sweep_string_iterator"),
    ("hydra.core.override_parser.types", "Override.get_value_element_as_str"),
    ("hydra.test_utils.launcher_common_tests", "LauncherTestSuite"),
    ("hydra.test_utils.launcher_common_tests", "IntegrationTestSuite"),
]


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def test_submitit_names_we_rely_on_exist() -> None:
    problems = submitit_adapter.check_names()
    if problems:
        pytest.fail(
            f"submitit {submitit_adapter.submitit_version()} lacks or changed what "
            "wf_launch/launchers/slurm/submitit_adapter.py relies on:\n  " + "\n  ".join(problems),
            pytrace=False,
        )


def test_hydra_names_we_rely_on_exist() -> None:
    problems = []
    for module, dotted in HYDRA_NAMES:
        try:
            obj = importlib.import_module(module)
            for part in dotted.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{dotted}: {type(exc).__name__}: {exc}")
    if problems:
        pytest.fail(
            f"hydra-core {_version('hydra-core')} lacks public names wf_slurm and wf_launch "
            "use:\n  " + "\n  ".join(problems),
            pytrace=False,
        )


def _sources() -> list[Path]:
    dirs = [ROOT / d for d in ("wf_launch", "worldfoundry", "hydra_plugins", "scripts", "tests")]
    return [p for d in dirs if d.is_dir() for p in d.rglob("*.py")]


@pytest.mark.skipif(not (ROOT / "pyproject.toml").is_file(), reason="needs the source tree")
def test_no_module_imports_hydra_internal() -> None:
    pattern = re.compile(r"^\s*(from|import)\s+hydra\._internal", re.MULTILINE)
    offenders = [str(p.relative_to(ROOT)) for p in _sources() if pattern.search(p.read_text())]
    assert offenders == []


@pytest.mark.skipif(not (ROOT / "pyproject.toml").is_file(), reason="needs the source tree")
def test_submitit_private_names_only_in_the_adapter() -> None:
    private = re.compile(
        r"\b(_make_sbatch_string|_convert_mem|_submitit_command_str|submitit\.core\._submit|"
        r"from submitit\S* import _\w+)"
    )
    adapter = Path(submitit_adapter.__file__).resolve()
    offenders = [
        str(p.relative_to(ROOT))
        for p in _sources()
        if p.resolve() != adapter
        and "tests" not in p.relative_to(ROOT).parts
        and private.search(p.read_text())
    ]
    assert offenders == []


def test_a_removed_submitit_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import submitit.slurm.slurm as slurm_module

    monkeypatch.delattr(slurm_module, "_convert_mem")
    problems = submitit_adapter.check_names()
    assert len(problems) == 1 and problems[0].startswith("submitit.slurm.slurm._convert_mem (")


def test_torch_private_names_we_rely_on_exist() -> None:
    import torch

    from worldfoundry.core import torch_private

    problems = torch_private.check_names()
    if problems:
        pytest.fail(
            f"torch {torch.__version__} lacks or changed private names that "
            "worldfoundry/core/torch_private.py relies on (adapt the adapter, nothing else):\n  "
            + "\n  ".join(problems),
            pytrace=False,
        )


def test_a_renamed_torch_private_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from worldfoundry.core import torch_private

    monkeypatch.setattr(
        torch_private,
        "PRIVATE_NAMES",
        (
            *torch_private.PRIVATE_NAMES,
            ("torch", "_foreach_renamed_", "attr", "probe"),
            (
                "torch.distributed.elastic.multiprocessing.api",
                "MultiprocessContext._renamed_pc",
                "self",
                "probe",
            ),
        ),
    )
    problems = torch_private.check_names()
    assert len(problems) == 2, problems
    assert any("torch._foreach_renamed_ (probe): AttributeError" in p for p in problems), problems
    assert any("MultiprocessContext no longer assigns self._renamed_pc" in p for p in problems), (
        problems
    )


def test_the_local_launcher_builds_launch_configs_of_older_torch_too() -> None:
    """torch 2.11 (the GPU image's) has no ``LaunchConfig.shutdown_timeout``: the launcher leaves
    it out there rather than failing every local launch with a TypeError."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    from wf_launch.launchers.local.launcher import shutdown_timeout

    @dataclasses.dataclass
    class LaunchConfigOf211:
        min_nodes: int
        max_nodes: int

    assert shutdown_timeout(LaunchConfigOf211, 7) == {}
    has_field = "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}
    assert shutdown_timeout(LaunchConfig, 7) == ({"shutdown_timeout": 7} if has_field else {})


def test_submitit_names_are_checked_on_a_machine_without_srun(monkeypatch) -> None:
    """The GPU check runs the upstream-name check where SLURM is absent: no srun is no finding."""
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not any("srun" in problem for problem in submitit_adapter.check_names())
