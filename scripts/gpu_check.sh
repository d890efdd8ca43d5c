#!/usr/bin/env bash
# The project's CUDA/NCCL paths on a GPU machine (one GPU or several), in one command and 8 minutes:
# finds an interpreter whose torch sees CUDA, adds what the project needs that it lacks (into
# .gpu-site/, from wheels when the machine reaches no package index), then runs scripts/gpu_check.py:
# one line per check (PASS / FAIL / SKIP), a summary, and with one GPU what it could not cover.
# docs/benchmarks.md#gpu-check says what each check runs.
#
#   scripts/gpu_check.sh                        # set up, run every check (budget 480 s, set-up included)
#   scripts/gpu_check.sh --dry-run              # list the checks, run nothing (works without a GPU)
#   scripts/gpu_check.sh --fetch-wheels DIR     # here, with a package index: the pure-Python dependencies as
#                                               #   wheels, for a GPU machine that reaches none
#   scripts/gpu_check.sh --wheels DIR           # there: install what is missing from DIR only (no index)
#   scripts/gpu_check.sh --rehearse-on-cpu [--pretend-gpus 1]
#                                               # the same checks on CPU ranks over gloo: tests this script only
#   PYTHON=/path/to/python scripts/gpu_check.sh # use that interpreter (what it lacks still goes to .gpu-site/)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
START=$SECONDS
BUDGET=480
SITE="$ROOT/.gpu-site"

WHEELS="" FETCH="" REHEARSE=0 PASS=()
while (($#)); do
  case $1 in
    --dry-run) exec "${PYTHON:-python3}" scripts/gpu_check.py "${PASS[@]}" "$@" ;;
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
    --wheels=*) WHEELS=${1#*=}; shift ;;
    --fetch-wheels) FETCH=${2:?--fetch-wheels needs a folder}; shift 2 ;;
    --fetch-wheels=*) FETCH=${1#*=}; shift ;;
    --rehearse-on-cpu) REHEARSE=1; PASS+=("$1"); shift ;;
    *) PASS+=("$1"); shift ;;
  esac
done

if [[ -n $FETCH ]]; then
  PYF=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
  mkdir -p "$FETCH"
  mapfile -t REQS < <("$PYF" scripts/gpu_check.py --requirements)
  "$PYF" -m pip wheel -q --no-deps -w "$FETCH" "${REQS[@]}"
  echo "gpu_check: ${#REQS[@]} wheels in $FETCH (${REQS[*]}); on the GPU machine: scripts/gpu_check.sh --wheels $FETCH"
  exit 0
fi

# An interpreter whose torch sees CUDA (any torch for a rehearsal): $PYTHON, else .venv's, else python3's.
has_torch() {
  if ((REHEARSE)); then "$1" -c "import torch" 2>/dev/null
  else "$1" -c "import sys, torch; sys.exit(torch.cuda.device_count() == 0)" 2>/dev/null; fi
}
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  for candidate in .venv/bin/python .venv-gpu/bin/python python3; do
    if [[ -x $candidate || $candidate == python3 ]] && has_torch "$candidate"; then PY=$candidate; break; fi
  done
fi
if [[ -z $PY ]]; then  # no torch with CUDA here: a venv over python3's packages, and torch from the index
  [[ -x .venv-gpu/bin/python ]] || python3 -m venv --system-site-packages .venv-gpu
  PY=.venv-gpu/bin/python
  "$PY" -m pip install -q torch || { echo "gpu_check: no torch that sees CUDA here, and none could be installed;" \
    "set PYTHON=... to an interpreter whose torch does" >&2; exit 2; }
fi

# What the project needs and this interpreter lacks goes to .gpu-site/ (the interpreter's own packages stay).
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[[ -z $WHEELS && -d "$ROOT/.gpu-wheels" ]] && WHEELS="$ROOT/.gpu-wheels"
mapfile -t MISSING < <("$PY" scripts/gpu_check.py --missing)
if ((${#MISSING[@]})); then
  if [[ -n $WHEELS ]]; then FROM=(--no-index --find-links "$WHEELS"); else FROM=(); fi
  echo "setup: installing ${MISSING[*]} into $SITE${WHEELS:+ from $WHEELS}"
  if ! "$PY" -m pip install -q --no-deps --target "$SITE" "${FROM[@]}" "${MISSING[@]}"; then
    echo "gpu_check: could not install ${MISSING[*]}; on a machine without a package index, fetch them elsewhere" \
      "(scripts/gpu_check.sh --fetch-wheels DIR) and pass --wheels DIR" >&2
    exit 2
  fi
fi
if ! "$PY" -c "import torch, hydra, omegaconf, loguru, submitit, tqdm, yaml, numpy, matplotlib, wf_launch" 2>/dev/null; then
  "$PY" -c "import wf_launch" || true
  echo "gpu_check: $PY cannot import the project and its dependencies; set PYTHON=... to an interpreter that can" >&2
  exit 2
fi
echo "setup: $("$PY" -c 'import sys, torch; print(sys.executable, "torch", torch.__version__, "CUDA", torch.version.cuda)') in $((SECONDS - START)) s"
exec "$PY" scripts/gpu_check.py --budget-s "$((BUDGET - (SECONDS - START)))" "${PASS[@]}"
