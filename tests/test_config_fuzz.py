"""Property: any composed config is accepted or refused with ConfigError, never a traceback; and any
damaged run directory is read by status, runs, plot and the sweep report without a crash, a hang or
a raw escape.

Random overrides (hostile strings, inf / nan / huge / tiny numbers, wrong types, unknown
keys, deletions) over engine.*, launcher.* (local and slurm) and task.* go through
Hydra's compose API, then ``wf_launch.app.resolve`` + ``wf_launch.app.validate_run_config``
(scripts/fuzz_configs.py holds the check; ``--examples N`` runs thousands).
"""

from __future__ import annotations

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from cli_helpers import load_script
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.xdist_group("config_fuzz")  # its module-scoped runs, launched once

fuzz = load_script("fuzz_configs")
fuzz_rundirs = load_script("fuzz_rundirs")


@pytest.fixture(scope="module")
def hydra_ctx():
    with fuzz.hydra_context():
        yield


# --------------------------------------------------------------------------- strategies

_hostile_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",))
    | st.sampled_from(
        [
            "\n",
            "\r",
            "\x00",
            "\x1b",
            "$",
            "`",
            ";",
            "|",
            "&",
            "'",
            '"',
            "\\",
            "{",
            "}",
            "[",
            "]",
            ",",
            "=",
            ":",
        ]
    ),
    max_size=40,
)
_numbers = (
    st.sampled_from(fuzz.NUMBERS) | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
)
_scalars = (
    _numbers
    | st.sampled_from(fuzz.HOSTILE_STRINGS)
    | _hostile_text
    | st.sampled_from([True, False, None])
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["a", "mail-type", "k"]), inner, max_size=2)
    ),
    max_leaves=5,
)


@st.composite
def examples(draw) -> list[str]:
    launcher = draw(st.sampled_from(["local", "slurm"]))
    task = draw(st.sampled_from(["demo", "layout", "noop", "train"]))
    keys = fuzz._keys(launcher, task)
    overrides = [f"launcher={launcher}", f"task={task}"]
    for _ in range(draw(st.integers(1, 4))):
        section, name = draw(st.sampled_from(keys))
        op = draw(st.sampled_from(["set"] * 8 + ["unknown", "delete", "raw"]))
        if op == "unknown":
            overrides.append(
                f"+{section}.{draw(st.sampled_from(fuzz.UNKNOWN_FIELDS))}={fuzz.render(draw(_values))}"
            )
        elif op == "delete":
            overrides.append(f"~{section}.{name}")
        elif op == "raw":  # unquoted text straight into the override grammar
            overrides.append(f"{section}.{name}={draw(_hostile_text)}")
        else:
            overrides.append(f"{section}.{name}={fuzz.render(draw(_values))}")
    return overrides


# --------------------------------------------------------------------------- the property


@pytest.mark.slow
@settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(overrides=examples())
def test_any_config_is_accepted_or_refused_with_config_error(
    hydra_ctx, overrides: list[str]
) -> None:
    result = fuzz.check(overrides)
    assert result.outcome in ("accepted", "config_error", "hydra", "upstream"), (
        f"{result.outcome} for overrides {overrides!r}:\n{result.detail}"
    )
    assert result.seconds <= fuzz.TIME_LIMIT_S


@pytest.mark.slow
def test_fuzz_script_reports_the_figure(hydra_ctx, capsys: pytest.CaptureFixture[str]) -> None:
    counts = fuzz.run(40, seed=3)
    out = capsys.readouterr().out
    assert "40 configs tried" in out, out
    unknown = (
        counts["traceback"]
        + counts["slow"]
        - sum(v for k, v in counts.items() if k.startswith("known: "))
    )
    assert unknown == 0, out


# --------------------------------------------------------------------------- what the fuzzer found


@pytest.mark.parametrize(
    "overrides",
    [
        ["engine.distributed_timeout_minutes=inf"],
        [
            "engine.distributed_timeout_minutes=1e308"
        ],  # timedelta(minutes=1e308) overflows in dist_init
        [
            "engine.tp_size=65536",
            "engine.dp_size=65536",
        ],  # 2**32 ranks: c10d ranks are 32-bit (was accepted)
    ],
)
@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_values_refused_with_config_error(hydra_ctx, launcher: str, overrides: list[str]) -> None:
    result = fuzz.check([f"launcher={launcher}", "task=noop", *overrides])
    assert result.outcome == "config_error", result
    field = overrides[0].lstrip("+").split("=")[0]
    assert field.split(".")[0] in result.detail


def test_a_finite_timeout_and_a_big_world_still_pass(hydra_ctx) -> None:
    ok = fuzz.check(
        [
            "launcher=local",
            "task=noop",
            "engine.distributed_timeout_minutes=0.1",
            "engine.dp_size=2",
        ]
    )
    assert ok.outcome == "accepted", ok
    ok = fuzz.check(["launcher=slurm", "task=noop", "engine.dp_size=65536", "engine.tp_size=32767"])
    assert ok.outcome == "accepted", ok  # just under the 2**31 - 1 cap


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_unknown_launcher_field_is_a_config_error(hydra_ctx, launcher: str) -> None:
    result = fuzz.check([f"launcher={launcher}", "task=noop", "+launcher.max_restart=3"])
    assert result.outcome == "config_error", result


@pytest.mark.parametrize(
    "overrides",
    [
        ["task.mlp_ratio=inf"],
        ["task.mlp_ratio=nan"],
        ["task.mlp_ratio=1e308"],
        ["task.mlp_ratio=-inf"],
        ["task.hidden=" + "1" + "0" * 400],
    ],
)
def test_demo_mlp_ratio_not_finite_is_a_config_error(hydra_ctx, overrides: list[str]) -> None:
    result = fuzz.check(["launcher=local", "task=demo", *overrides])
    assert result.outcome == "config_error", result


@pytest.mark.parametrize("folder", ["'../../etc'", "/tmp/elsewhere", "'a/../../b'"])
def test_slurm_folder_must_stay_inside_the_run_directory(hydra_ctx, folder: str) -> None:
    result = fuzz.check(["launcher=slurm", "task=noop", f"launcher.folder={folder}"])
    assert result.outcome == "config_error", result


def test_render_reaches_validation_with_hostile_values(hydra_ctx) -> None:
    # the rendering keeps hostile strings intact: they arrive at validation, not at the parser
    result = fuzz.check(
        ["launcher=local", "task=noop", "engine.order=" + fuzz.render("tp-cp\n; $(id)\x00")]
    )
    assert result.outcome == "config_error" and "engine.order" in result.detail, result
    assert math.isnan(float("nan"))


# --------------------------------------------------------------------------- run directories


@pytest.mark.slow
def test_damaged_run_directories_never_crash_hang_or_escape() -> None:
    lines: list[str] = []
    counts = fuzz_rundirs.run(12, seed=11, report=lines.append)
    assert counts["files"] >= 12 and "files tried" in lines[-1]
    assert (counts["crash"], counts["hang"], counts["escape"], counts["scancel"]) == (0, 0, 0, 0), (
        "\n".join(lines)
    )
