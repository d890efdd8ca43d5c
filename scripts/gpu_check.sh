#!/usr/bin/env bash
# The project's CUDA/NCCL paths on a GPU machine (one GPU or several), in one command and 8 minutes:
# sets the project up (a venv over the machine's CUDA torch, unless one is ready), then runs
# scripts/gpu_check.py: one line per check (PASS / FAIL / SKIP), then a summary, and with one GPU
# what it could not cover. docs/benchmarks.md#gpu-check says what each check runs.
#
#   scripts/gpu_check.sh                   # set up, run every check (budget 480 s, set-up included)
#   scripts/gpu_check.sh --dry-run         # list the checks, run nothing (works without a GPU)
#   scripts/gpu_check.sh --rehearse-on-cpu # the same checks on CPU ranks over gloo: tests this script only
#   PYTHON=/path/to/python scripts/gpu_check.sh   # use that interpreter as it is (no set-up)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
START=$SECONDS
BUDGET=480

for arg in "$@"; do
  if [[ $arg == --dry-run ]]; then
    exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
  fi
done

ready() { "$1" -c "import torch, hydra, omegaconf, loguru, submitit, tqdm, yaml, numpy, wf_launch" 2>/dev/null; }

PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]] && ready .venv/bin/python; then
    PY=.venv/bin/python
  else
    [[ -x .venv-gpu/bin/python ]] || python3 -m venv --system-site-packages .venv-gpu
    PY=.venv-gpu/bin/python
    "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch
    ready "$PY" || "$PY" -m pip install -q -e . || "$PY" -m pip install -q --no-deps --no-build-isolation -e .
  fi
fi
if ! ready "$PY"; then
  echo "gpu_check: $PY cannot import the project and its dependencies; set PYTHON=... to an interpreter that can" >&2
  exit 2
fi
echo "setup: $("$PY" -c 'import sys, torch; print(sys.executable, "torch", torch.__version__, "CUDA", torch.version.cuda)') in $((SECONDS - START)) s"
exec "$PY" scripts/gpu_check.py --budget-s "$((BUDGET - (SECONDS - START)))" "$@"
