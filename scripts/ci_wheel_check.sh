#!/usr/bin/env bash
# The "works editable, broken installed" check (issue 14), run by .ci/run after the main pytest.
#
# Builds the wheel, installs it with torch into a fresh venv outside the source tree, and runs
# there: the packaging tests (a generic Hydra app included), Hydra's own launcher suites against
# wf_slurm, the upstream-names checks, and `python -m wf_launch` with a 2-point sweep. Nothing of
# the source tree is importable in that venv: the tests are copied, and run from a scratch folder.
#
#   bash scripts/ci_wheel_check.sh            # uses .venv/bin/python to build (PYTHON=... to change)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/wf_wheel_check.XXXXXX")"
unset PYTHONPATH
start=$SECONDS
step() { echo "== wheel check [$((SECONDS - start)) s]: $*"; }

step "build the wheel"
"$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$WORK/dist" "$ROOT"
WHEEL="$(ls "$WORK"/dist/*.whl)"

step "install $(basename "$WHEEL") into a fresh venv (as a user does: no extras; plus the test tools)"
python3 -m venv "$WORK/venv"
# --no-compile: byte-compiling all of torch at install is most of the install time; imports compile
# what they use. The grep drops pip's notes about absent local index folders.
"$WORK/venv/bin/pip" install -q --no-compile torch==2.13.0 "$WHEEL" pytest pytest-timeout psutil 2>&1 \
    | { grep -v "^WARNING: Location .* is ignored" || true; }

cd "$WORK"
VPY="$WORK/venv/bin/python"
"$VPY" - <<'PY'
import pathlib, sys, sysconfig
import hydra_plugins.wf_launch_slurm as plugin, wf_launch
site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
for mod in (wf_launch, plugin):
    where = pathlib.Path(mod.__file__).resolve()
    assert site in where.parents, f"{mod.__name__} comes from {where}, not the installed wheel in {site}"
print(f"installed from the wheel: {site}")
PY

step "packaging tests, Hydra's launcher suites, upstream names (installed wheel)"
cp -r "$ROOT/tests" "$WORK/tests"
printf '[pytest]\ntimeout = 300\nmarkers =\n    slow: slow\n    slurm: slurm\n' > "$WORK/pytest.ini"
WF_WHEEL="$WHEEL" "$VPY" -m pytest -q -p no:cacheprovider tests/test_packaging.py tests/test_hydra_launcher.py \
    tests/test_upstream_names.py

step "python -m wf_launch: a 2-point sweep"
"$VPY" -m wf_launch -m engine.cp_size=1,2 task=noop "hydra.sweep.dir=$WORK/sweep" > "$WORK/sweep.log" 2>&1 \
    || { cat "$WORK/sweep.log"; exit 1; }
"$VPY" - "$WORK/sweep" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(f"{sys.argv[1]}/sweep_summary.csv")))
assert [(r["cp"], r["status"]) for r in rows] == [("1", "ok"), ("2", "ok")], rows
print("sweep: 2 point(s), 2 ok")
PY

step "passed"
rm -rf "$WORK"
