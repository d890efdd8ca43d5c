"""Task ``train``'s peak memory per rank, estimated from its config and a layout
(``TrainConfig.estimate_memory_gb``).

What a rank of ``train`` holds (float32, 4 bytes a number):

- **Model state** of its pipeline stage, sharded by FSDP2 over the stage's ``dp x cp``
  ranks: the parameters, their gradients, AdamW's two moments and the EMA copy (5 numbers
  per parameter, divided by ``dp * cp``).
- **Unsharded copies.** On a GPU, FSDP2 holds the computing block (and the prefetched
  one, and its gradients before the reduce-scatter) unsharded, and the stage's root
  (embeddings, final layer) throughout. On CPU with gloo far more is resident at the
  peak, measured: about :data:`CPU_UNSHARDED` unsharded copies of the stage (FSDP2's
  gathers and gradients, and the full model and EMA the report gathers), and on rank 0
  :data:`CPU_GATHERED` copies of the whole model (every stage's model and EMA, gathered
  and hashed for ``weights_sha256``). The build (the whole seeded model, then the stage
  and its EMA copy before sharding) stays below that.
- **Activations**: GPipe keeps every micro-batch's activations until its backward
(``micro_batches``,
  or ``global_batch / (dp x batch)`` when the config fixes the global batch). Per
  block and sample, a rank saves about ``(ACT_HIDDEN + 2 x mlp_ratio) x hidden`` numbers
  per local token (its share ``tokens / cp``) plus the gathered keys and values of the
  whole sequence when ``cp > 1`` (``ACT_GATHERED x hidden`` per token of the sequence).
- **The runtime**, on CPU only: Python, torch and the preloaded modules of a rank process
  (:data:`CPU_RUNTIME_GB`, measured). On a GPU the estimate is device memory, which holds
  none of it.

The stage with the largest sum is the estimate (the ranks of the first stage hold the
embeddings, those of the last the final layer). ``tests/test_tune_train.py`` checks it
against the measured peak resident memory of real runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ._vdit import stage_blocks

__all__ = [
    "ACT_GATHERED",
    "ACT_HIDDEN",
    "CPU_GATHERED",
    "CPU_RUNTIME_GB",
    "CPU_UNSHARDED",
    "estimate_memory_gb",
    "micro_batches",
    "stage_parameters",
]

BYTES = 4
GB = 2**30
CPU_RUNTIME_GB = 0.29
"""Resident memory of a rank process of ``train`` on CPU before it builds anything (torch 2.x CPU,
measured)."""
ACT_HIDDEN = 16
ACT_GATHERED = 4
STATE_COPIES = 5
"""Parameters, gradients, AdamW's exp_avg and exp_avg_sq, the EMA copy: sharded over dp x cp."""
UNSHARDED_BLOCKS = 3
"""On a GPU: blocks FSDP2 holds unsharded at once (the one computing, the one prefetched, the
gradients)."""
CPU_UNSHARDED = 4
"""On CPU (gloo): unsharded copies of the stage's parameters at the peak (FSDP2's all-gathers and
gradients before
the reduce-scatter, the full model and EMA the report gathers on every rank), measured."""
CPU_GATHERED = 3
"""On CPU, rank 0 (first stage): copies of the whole model it gathers from every stage for the
report (model, EMA,
their serialized bytes), measured."""


class TrainShape(Protocol):
    """The fields of ``train``'s config (:class:`~.train.TrainConfig`) the estimate reads.

    A structural type, so that the config (which calls the estimate) and the estimate do not
    import each other.
    """

    hidden: int
    mlp_ratio: float
    depth: int
    channels: int
    patch: Sequence[int]
    frames: int
    height: int
    width: int
    batch: int

    def default_global_batch(self, dp_size: int) -> int: ...


def _block(hidden: int, mlp: int) -> int:
    """Parameters of one DiTBlock: qkv, proj, the MLP and the adaLN projection (weights and
    biases)."""
    return 10 * hidden * hidden + 2 * hidden * mlp + 11 * hidden + mlp


def _root(cfg: TrainShape, first: bool, last: bool) -> int:
    """Parameters of a stage outside its blocks: patch and time embeddings (first), the final layer
    (last)."""
    h, patch_dim = cfg.hidden, cfg.channels * math.prod(cfg.patch)
    out = 0
    if first:
        out += patch_dim * h + h + 2 * (h * h + h)
    if last:
        out += 2 * h * h + 2 * h + h * patch_dim + patch_dim
    return out


def stage_parameters(cfg: TrainShape, pp: int, stage: int) -> tuple[int, int]:
    """(parameters of pipeline stage ``stage`` of ``pp``, of which in its largest block)."""
    block = _block(cfg.hidden, int(cfg.hidden * cfg.mlp_ratio))
    blocks = len(stage_blocks(cfg.depth, pp, stage))
    return blocks * block + _root(cfg, stage == 0, stage == pp - 1), block if blocks else 0


def _tokens(cfg: TrainShape) -> int:
    pt, ph, pw = cfg.patch
    return (cfg.frames // pt) * (cfg.height // ph) * (cfg.width // pw)


def micro_batches(cfg: TrainShape, dp: int) -> int:
    """Micro-batches per replica at ``dp`` replicas, as ``train`` derives them: ``global_batch / (dp
    * batch)``
    (``task.global_batch``, else ``dp * batch * micro_batches``: then ``micro_batches``)."""
    return max(1, cfg.default_global_batch(dp) // (dp * cfg.batch))


def _activations(cfg: TrainShape, blocks: int, cp: int, dp: int) -> float:
    """Numbers a stage keeps for the backward over all of a step's micro-batches."""
    tokens = _tokens(cfg)
    local = tokens / cp
    per_block = local * cfg.hidden * (ACT_HIDDEN + 2 * cfg.mlp_ratio)
    if cp > 1:
        per_block += tokens * cfg.hidden * ACT_GATHERED
    stage_input = local * cfg.hidden
    return micro_batches(cfg, dp) * cfg.batch * (blocks * per_block + stage_input)


def estimate_memory_gb(cfg: TrainShape, layout: Mapping[str, Any]) -> float:
    """Peak memory per rank (GB) of ``train`` with ``cfg`` on ``layout`` (``tp``, ``cp``, ``pp``,
    ``dp``, and ``device``: ``cpu`` for host memory, anything else for device memory); the largest
    over the pipeline stages."""
    cp, pp, dp = int(layout["cp"]), int(layout["pp"]), int(layout["dp"])
    cpu = str(layout.get("device", "cpu")) == "cpu"
    shards = dp * cp
    full = stage_parameters(cfg, 1, 0)[0]
    worst = 0.0
    for stage in range(pp):
        params, block = stage_parameters(cfg, pp, stage)
        blocks = len(stage_blocks(cfg.depth, pp, stage))
        numbers = STATE_COPIES * params / shards + _activations(cfg, blocks, cp, dp)
        if cpu:
            numbers += CPU_UNSHARDED * params + (CPU_GATHERED * full if stage == 0 else 0)
        else:
            numbers += UNSHARDED_BLOCKS * block + 2 * (params - blocks * block)
        worst = max(worst, numbers)
    return (CPU_RUNTIME_GB if cpu else 0.0) + worst * BYTES / GB
