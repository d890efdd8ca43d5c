"""Task ``train``: train the demo's video DiT on seeded synthetic latents, deterministic and
resumable at any layout.

Every rank builds the same seeded :class:`~wf_launch.tasks._vdit.VDiT` and keeps its
pipeline stage's share (:class:`Stage`: blocks ``stage_blocks(depth, pp_size, s)``,
plus the patch and time embeddings on the first stage and the final layer on the
last; its parameters keep the full model's names, :meth:`Stage.global_name`, so a
checkpoint loads on another split of stages). Per step:

1. The step's global batch is ``task.global_batch`` samples (default: ``dp_size *
   batch * micro_batches`` of the layout that started the run; a checkpoint keeps it).
   Sample ``i`` of step ``s`` is drawn from a generator seeded with ``(seed, s, i)``
   (:func:`make_batch`); data-parallel replica ``d`` takes samples ``d * G/dp`` onwards in
   micro-batches of ``batch``, so every layout sees the same samples in the same order
   and a resumed run needs no saved data position. A CP rank keeps its block of the
   patch sequence (:class:`~wf_launch.tasks._vdit.PatchGridSplit`). Attention gathers keys and
   values over CP differentiably (``cat_outputs_cp_with_grad``).
2. GPipe over the replica's micro-batches: every stage runs all forwards (activations and the
   timestep vector go to the next stage with the PP scheduler), then all backwards in
   reverse order (their gradients go back to the previous stage on a reversed ring).
   The loss (flow matching: predict ``noise - x0``; or denoising: predict ``noise``)
   is the mean over every element of the global batch.
3. FSDP2 (``fsdp2_wrap`` over the stage's data- and context-parallel ranks) averages
   the gradients; AdamW steps; the EMA copy follows with ``update_average``.
4. Checkpoint every ``checkpoint_every`` steps, when ``ctx.should_stop()`` agrees to
   stop (then return early: on SLURM the entrypoint requeues the job) and after the last
   step (``save_final``). A start loads the newest checkpoint and continues from its step,
   at whatever layout it now has (the model, EMA and optimizer reshard; the progress is
   replicated).

Rank 0 returns ``steps_done``, ``final_loss``, ``loss_curve`` (every step, across
attempts), ``weights_sha256`` / ``ema_sha256`` (sha256 of the full gathered state),
``attempts`` and ``tokens_per_s``; with ``check_reference`` also the comparison with a
single-process run of the same model on the same global batches.
"""

from __future__ import annotations

import copy
import hashlib
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from wf_launch.config import (
    ConfigError,
    EngineConfig,
    check_fields,
    choice,
    config_error,
    flag,
    integer,
    number,
    redefault,
)
from wf_launch.rundir.checkpoints import describe_layout
from worldfoundry.core.distributed import gather_state_dicts, get_layout
from worldfoundry.core.distributed.backends import group_device
from worldfoundry.core.distributed.ema import DTensorFastEmaModelUpdater
from worldfoundry.core.distributed.env import launch_attempt
from worldfoundry.core.distributed.fsdp import fsdp2_wrap
from worldfoundry.core.distributed.groups import GroupCoordinator
from worldfoundry.core.distributed.pipeline import PPScheduler
from worldfoundry.core.torch_private import DYNAMO_MODULE

from ..rank.task_context import TaskContext
from ..rank.task_registry import register_task
from ._vdit import (
    PatchGridSplit,
    VDiT,
    VDiTConfig,
    patchify,
    sincos_3d,
    stage_blocks,
    timestep_embedding,
)
from .train_ft import average_gradients, init_optim_state, load_replica_state, replica_state
from .train_memory import estimate_memory_gb

__all__ = [
    "LOSSES",
    "SCOPES",
    "Placement",
    "Stage",
    "TrainConfig",
    "Trainer",
    "build",
    "load",
    "make_batch",
    "reference_run",
    "report",
    "sample_seed",
    "state_sha256",
    "train",
    "train_step",
    "train_step_ft",
]

LOSSES = ("flow", "denoise")
PROTOTYPES = 4
"""The synthetic data: noisy copies of this many seeded prototype latents (so the loss can fall)."""
_BACKWARD_TAG = 1 << 20
"""Tag of the gradient messages (the reversed PP ring), apart from the forward scheduler's."""


@dataclass
class TrainConfig(VDiTConfig):
    """Config of task ``train`` (``task=train task.steps=20 ...``).

    ``batch`` samples per micro-batch; ``global_batch`` samples per step (0: ``dp_size *
    batch * micro_batches`` of the layout that starts the run); each layout runs
    ``global_batch / (dp_size * batch)`` micro-batches per replica (GPipe), so
    ``micro_batches`` only sets the default global batch. ``checkpoint_every`` 0 saves only
    on a stop (and after the last step with ``save_final``). ``step_sleep_s`` stretches
    every step (drills and tests). The model's fields are the demo's
    (:class:`~wf_launch.tasks._vdit.VDiTConfig`), with a smaller model by default.
    """

    name: str = "train"
    batch: int = redefault(VDiTConfig, "batch", 2)
    frames: int = redefault(VDiTConfig, "frames", 4)
    height: int = redefault(VDiTConfig, "height", 8)
    width: int = redefault(VDiTConfig, "width", 8)
    hidden: int = redefault(VDiTConfig, "hidden", 32)
    depth: int = redefault(VDiTConfig, "depth", 2)
    mlp_ratio: float = redefault(VDiTConfig, "mlp_ratio", 2.0)
    steps: int = integer(10, low=1)
    micro_batches: int = integer(2, low=1)
    global_batch: int = integer(
        0, low=0, note="(0: engine.dp_size * task.batch * task.micro_batches)"
    )
    lr: float = number(1e-3, 0, low_open=True)
    weight_decay: float = number(0.0, 0)
    ema_beta: float = number(0.99, 0, 1, allowed="expected a number in [0, 1]")
    loss: str = choice("flow", LOSSES)
    checkpoint_every: int = integer(0, low=0, note="(0: save only when the run is asked to stop)")
    keep: int = integer(3, low=1)
    async_save: bool = flag(False)
    save_final: bool = flag(True)
    step_sleep_s: float = number(0.0, 0, unit="seconds")
    check_reference: bool = flag(False)
    reference_atol: float = number(1e-4, 0, low_open=True)

    def validate(self, engine: EngineConfig | None = None) -> None:
        """Raise :class:`ConfigError` naming the field, its value and what is allowed."""
        check_fields(self, "task")
        self.check_model()
        if engine is not None:
            self._check_layout(engine)

    def _check_layout(self, engine: EngineConfig) -> None:
        """The batch, the blocks and the latent split over the run's layout."""
        if self.global_batch:
            self.micro_batches_at(self.global_batch, engine.dp_size, engine.pp_size)
        elif engine.pp_size > 1 and self.micro_batches < engine.pp_size:
            raise config_error(
                "task.micro_batches",
                self.micro_batches,
                f"GPipe needs at least one micro-batch per pipeline stage: an integer "
                f">= engine.pp_size={engine.pp_size}",
            )
        if self.depth < engine.pp_size:
            raise config_error(
                "task.depth",
                self.depth,
                f"every pipeline stage needs a block: an integer >= engine.pp_size="
                f"{engine.pp_size}",
            )
        self.plan_split(engine.cp_size)

    def default_global_batch(self, dp_size: int) -> int:
        """The global batch of a run started at ``dp_size`` replicas: ``task.global_batch``, else dp
        * batch * micro.
        """
        return self.global_batch or dp_size * self.batch * self.micro_batches

    def micro_batches_at(self, global_batch: int, dp_size: int, pp_size: int) -> int:
        """Micro-batches per replica at a layout: ``global_batch / (dp_size * batch)``; ConfigError
        if it cannot.
        """
        per = dp_size * self.batch
        if global_batch % per:
            raise config_error(
                "task.global_batch",
                global_batch,
                f"a multiple of engine.dp_size * task.batch = {dp_size} * {self.batch} = {per} "
                "(every replica runs whole micro-batches of task.batch samples)",
            )
        micro = global_batch // per
        if pp_size > 1 and micro < pp_size:
            raise config_error(
                "task.global_batch",
                global_batch,
                f">= engine.dp_size * task.batch * engine.pp_size = {per * pp_size} "
                "(GPipe needs at least one micro-batch per pipeline stage)",
            )
        return micro

    def estimate_memory_gb(self, layout: dict[str, Any]) -> float:
        """Peak memory per rank (GB) on ``layout`` (tp/cp/pp/dp, device):
        :mod:`wf_launch.tasks.train_memory`.
        """

        return estimate_memory_gb(self, layout)

    def plan_split(self, cp_size: int) -> PatchGridSplit:
        """The CP plan of the latent, with an error naming the config when CP cannot split it."""
        try:
            return self.split_plan(cp_size)
        except (ValueError, RuntimeError) as exc:
            pt, ph, _ = self.patch
            raise ConfigError(
                f"engine.cp_size={cp_size} is not allowed: the sequence of "
                f"{self.frames // pt} patch frames x {self.height // ph} patch rows "
                f"(task.frames={self.frames}, task.height={self.height}, "
                f"task.patch={list(self.patch)}) splits over cp_size = "
                "(a divisor of the patch frames) x "
                f"(a divisor of the patch rows) ranks ({exc})"
            ) from exc

    def build_model(self) -> VDiT:
        """The seeded full model (float32, CPU), identical on every rank and in the reference."""
        return VDiT.seeded(
            self.seed,
            channels=self.channels,
            patch=tuple(self.patch),
            hidden=self.hidden,
            heads=self.heads,
            depth=self.depth,
            mlp_ratio=float(self.mlp_ratio),
        ).train()


def sample_seed(seed: int, step: int, index: int) -> int:
    """The generator seed of one sample: a pure function of (seed, step, its index in the step's
    global batch).
    """
    digest = hashlib.sha256(f"wf_launch.train/{seed}/{step}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_batch(
    cfg: TrainConfig,
    step: int,
    first: int,
    count: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples ``first .. first + count - 1`` of step ``step``'s global batch: times (B,), noisy
    latents x_t and regression targets (B, C, T, H, W), float32 on the CPU. The same samples
    whatever the split.

    ``x0`` is a seeded prototype latent plus a little noise; ``x_t = (1 - t) x0 + t noise``;
    the target is ``noise - x0`` (flow matching) or ``noise`` (denoising).
    """
    one = (1, *cfg.latent_shape[1:])
    protos = torch.randn((PROTOTYPES, *one[1:]), generator=torch.Generator().manual_seed(cfg.seed))
    times, x0s, noises = [], [], []
    for index in range(first, first + count):
        gen = torch.Generator().manual_seed(sample_seed(cfg.seed, step, index))
        times.append(torch.rand(1, generator=gen, dtype=torch.float64))
        pick = torch.randint(PROTOTYPES, (1,), generator=gen)
        x0s.append(protos[pick] + 0.1 * torch.randn(one, generator=gen))
        noises.append(torch.randn(one, generator=gen))
    t, x0, noise = torch.cat(times), torch.cat(x0s), torch.cat(noises)
    tt = t.to(torch.float32).view(-1, 1, 1, 1, 1)
    xt = (1 - tt) * x0 + tt * noise
    return t, xt, (noise - x0) if cfg.loss == "flow" else noise


class Stage(nn.Module):
    """One pipeline stage's share of a :class:`VDiT` (its modules, not copies).

    ``forward(x, cond, positions, cp_group)``: on the first stage ``x`` is patch values
    and ``cond`` the diffusion times; elsewhere ``x`` is the previous stage's tokens and
    ``cond`` its timestep vector. Returns (tokens, or patch values on the last stage;
    the timestep vector).
    """

    def __init__(self, full: VDiT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.hidden = full.hidden
        self.block_ids = list(blocks)
        self.blocks = nn.ModuleList(full.blocks[i] for i in blocks)
        self.patch_embed = full.patch_embed if first else None
        self.t_embed = full.t_embed if first else None
        self.final = full.final if last else None

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor, positions: torch.Tensor, cp_group: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.patch_embed is not None:
            c = self.t_embed(timestep_embedding(cond, self.hidden).to(x.dtype))
            x = self.patch_embed(x) + sincos_3d(positions, self.hidden).to(x)
        else:
            c = cond
        for block in self.blocks:
            x = block(x, c, cp_group)
        if self.final is not None:
            x = self.final(x, c)
        return x, c

    def global_name(self, name: str) -> str:
        """A parameter's name in the full model (``blocks.<local>`` -> ``blocks.<global>``)."""
        if name.startswith("blocks."):
            _, local, rest = name.split(".", 2)
            return f"blocks.{self.block_ids[int(local)]}.{rest}"
        return name


def full_state(stage: Stage) -> dict[str, torch.Tensor]:
    """The stage's unsharded parameters under full-model names, on the CPU (collective over its
    mesh).
    """
    out = {}
    for name, p in stage.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[stage.global_name(name)] = full.detach().to("cpu").clone()
    return out


def state_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over names (sorted), dtypes, shapes and the bytes of contiguous CPU tensors."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _wait(handles: list[Any]) -> None:
    for h in handles:
        h.wait()
    handles.clear()


def _reversed_pp(pp: Any) -> Any:
    """A PP scheduler on the reversed ring: "next" is the previous stage (gradients go back)."""

    g = pp.group
    back = GroupCoordinator(
        f"{g.name}-reversed", list(reversed(g.ranks)), g.rank, g.device_group, g.cpu_group
    )
    return PPScheduler(back, device=pp.device, timeout=pp.timeout, tag=pp.tag + _BACKWARD_TAG)


PRELOAD = (
    DYNAMO_MODULE,
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "wf_launch.rank.checkpoint",
    "worldfoundry.core.distributed.ema",
    "worldfoundry.core.distributed.fsdp",
)
"""What every rank of ``train`` imports: the local launcher imports it once, before forking."""


@dataclass
class Placement:
    """Where this rank sits in the layout, as training needs it: its pipeline stage, replica and CP
    block.
    """

    stage_id: int
    n_stages: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    cp_group: Any
    split: PatchGridSplit

    @property
    def first(self) -> bool:
        return self.stage_id == 0

    @property
    def last(self) -> bool:
        return self.stage_id == self.n_stages - 1

    @classmethod
    def of(cls, ctx: TaskContext, cfg: TrainConfig) -> Placement:
        cp = ctx.groups["cp"]
        return cls(
            ctx.coords["pp"],
            ctx.groups["pp"].world_size,
            ctx.coords["dp"],
            ctx.groups["dp"].world_size,
            cp.rank_in_group,
            cp.world_size,
            cp if cp.world_size > 1 else None,
            cfg.plan_split(cp.world_size),
        )


SCOPES = {"progress": "replicated"}
"""The scope of ``train``'s per-rank entries: the progress (step, loss curve, attempts, global
batch) is one copy.
"""


@dataclass
class Trainer:
    """One rank's training state: the stage (FSDP2 over dp x cp), its EMA copy, the optimizer, the
    progress.

    ``state`` is what a checkpoint holds (the model, EMA and optimizer under the full model's
    names, so they reshard on another layout; ``progress`` replicated). ``global_batch`` and
    ``micro`` (micro-batches per replica at this layout) are set by :func:`load`.
    """

    cfg: TrainConfig
    ctx: TaskContext
    place: Placement
    stage: Stage
    ema: Stage
    opt: torch.optim.Optimizer
    progress: dict[str, Any]
    updater: Any = None
    back: Any = None
    global_batch: int = 0
    micro: int = 0
    replica: int = 0
    replicas: int = 1

    @property
    def state(self) -> dict[str, Any]:
        return {"model": self.stage, "ema": self.ema, "optim": self.opt, "progress": self.progress}


def build(ctx: TaskContext, cfg: TrainConfig) -> Trainer:
    """Build this rank's stage of the seeded model and its EMA copy, shard both with FSDP2, make the
    optimizer.
    """
    from torch.distributed.device_mesh import DeviceMesh

    place = Placement.of(ctx, cfg)
    # FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip a hook);
    # Stage's outputs are views of FSDP2's own hooks and linear layers; nothing edits them in place.
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(FSDPStage\) returned a view tensor"
    )
    blocks = stage_blocks(cfg.depth, place.n_stages, place.stage_id)
    stage = Stage(cfg.build_model(), blocks, place.first, place.last).to(ctx.device)
    ema = copy.deepcopy(stage).requires_grad_(False)
    shard_group = ctx.groups["dp-cp"]
    mesh = DeviceMesh.from_group(
        shard_group.device_group, group_device(shard_group).type, mesh_dim_names=("dp_cp",)
    )
    fsdp2_wrap(stage, mesh=mesh)
    fsdp2_wrap(ema, mesh=mesh)
    opt = torch.optim.AdamW(stage.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    progress: dict[str, Any] = {
        "step": 0,
        "loss_curve": [],
        "attempts": [],
        "data": {"seed": cfg.seed, "global_batch": None, "next_step": 1},
    }
    back = _reversed_pp(ctx.pp) if place.n_stages > 1 else None
    return Trainer(cfg, ctx, place, stage, ema, opt, progress, DTensorFastEmaModelUpdater(), back)


def _global_batch(t: Trainer) -> int:
    """The run's global batch: the checkpoint's (a resumed run keeps it at any layout), else the
    config's.
    """
    saved = t.progress["data"].get("global_batch")
    if saved is None:
        return t.cfg.default_global_batch(t.place.dp_size)
    if t.cfg.global_batch and t.cfg.global_batch != saved:
        raise config_error(
            "task.global_batch",
            t.cfg.global_batch,
            f"the run being resumed trains with a global batch of {saved} samples per step: leave "
            f"task.global_batch unset (0) or set it to {saved}",
        )
    return int(saved)


def load(t: Trainer) -> int | None:
    """Resume from the newest checkpoint (if any, at any layout), fix the global batch, record this
    attempt.
    """

    resumed = t.ctx.checkpoint.load(t.state)
    t.global_batch = _global_batch(t)
    try:
        t.micro = t.cfg.micro_batches_at(t.global_batch, t.place.dp_size, t.place.n_stages)
    except ConfigError as exc:
        if t.progress["data"].get("global_batch") is None:
            raise
        raise ConfigError(
            f"{exc}; it is the global batch of the run being resumed (kept by its checkpoint): "
            "resume at a layout that splits it"
        ) from None
    t.progress["data"]["global_batch"] = t.global_batch
    attempts = t.progress["attempts"]
    attempt = max(launch_attempt(), attempts[-1]["attempt"] + 1 if attempts else 0)
    entry: dict[str, Any] = {"attempt": attempt, "resumed_from": resumed}
    report = t.ctx.checkpoint.last_load if resumed is not None else None
    if report is not None and report.changed:
        entry["layout"] = {
            "from": describe_layout(report.layout_from),
            "to": describe_layout(report.layout_to),
        }
    attempts.append(entry)
    if resumed is not None:
        moved = (
            f" at a new layout ({entry['layout']['from']} -> {entry['layout']['to']})"
            if "layout" in entry
            else ""
        )
        t.ctx.log.info(
            f"train: attempt {attempt} resumes from step {resumed}{moved}; "
            f"global batch {t.global_batch} = {t.place.dp_size} replica(s) x {t.micro} "
            f"micro-batch(es) x {t.cfg.batch}"
        )
    return resumed


def _local_seq(t: Trainer, latent: torch.Tensor) -> torch.Tensor:
    """This CP rank's block of a latent's patch sequence, on the rank's device."""
    split, n = t.place.split, t.place.split.tokens_per_rank
    seq = split.to_sequence(patchify(latent, tuple(t.cfg.patch)))
    return seq[:, t.place.cp_rank * n : (t.place.cp_rank + 1) * n].contiguous().to(t.ctx.device)


def _forward_all(
    t: Trainer, step: int, positions: torch.Tensor
) -> tuple[list[tuple[Any, ...]], float]:
    """GPipe's forward half: every micro-batch through this stage, activations to the next."""
    cfg, pl, pp = t.cfg, t.place, t.ctx.pp
    x_shape, c_shape = (cfg.batch, pl.split.tokens_per_rank, cfg.hidden), (cfg.batch, cfg.hidden)
    sends: list[Any] = []
    saved: list[tuple[Any, ...]] = []
    local_loss = 0.0
    # this data-parallel replica's share of the step's global batch (under ft, of its replica
    # group's: replica group k trains on samples k * global_batch onwards)
    first = (t.replica * pl.dp_size + pl.dp_rank) * t.micro * cfg.batch
    for m in range(t.micro):
        tt, xt, target = make_batch(cfg, step, first + m * cfg.batch, cfg.batch)
        if pl.first:
            x_in, cond = _local_seq(t, xt), tt.to(t.ctx.device)
        else:
            x_in = pp.recv_prev_data(x_shape, torch.float32).requires_grad_()
            cond = pp.recv_prev_data(c_shape, torch.float32).requires_grad_()
        out, c = t.stage(x_in, cond, positions, pl.cp_group)
        if pl.last:
            loss = F.mse_loss(out, _local_seq(t, target))
            local_loss += loss.item()
            saved.append((x_in, cond, loss / t.micro, None))
        else:
            sends += [pp.isend_next(out), pp.isend_next(c)]
            saved.append((x_in, cond, out, c))
    _wait(sends)
    return saved, local_loss


def _backward_all(t: Trainer, saved: list[tuple[Any, ...]]) -> None:
    """GPipe's backward half, in reverse micro-batch order; input gradients go back to the previous
    stage.
    """
    cfg, pl, back = t.cfg, t.place, t.back
    x_shape, c_shape = (cfg.batch, pl.split.tokens_per_rank, cfg.hidden), (cfg.batch, cfg.hidden)
    sends: list[Any] = []
    for m in reversed(range(t.micro)):
        x_in, cond, out, c = saved[m]
        if pl.last:
            out.backward()
        else:
            gx = back.recv_prev_data(x_shape, torch.float32)
            gc = back.recv_prev_data(c_shape, torch.float32)
            if pl.first:
                torch.autograd.backward([out, c], [gx, gc])
            else:
                out.backward(gx)
        if not pl.first:
            gc_back = cond.grad if pl.last else cond.grad + gc
            sends += [back.isend_next(x_in.grad), back.isend_next(gc_back)]
    _wait(sends)


def train_step(t: Trainer, step: int, positions: torch.Tensor) -> float:
    """One optimizer step over the global batch (GPipe, FSDP2 averaging, AdamW, EMA); the global
    mean loss.
    """
    t.opt.zero_grad(set_to_none=True)
    saved, local_loss = _forward_all(t, step, positions)
    _backward_all(t, saved)
    t.opt.step()
    t.updater.update_average(t.stage, t.ema, beta=float(t.cfg.ema_beta))
    share = local_loss if (t.place.last and t.ctx.coords["tp"] == 0) else 0.0
    total = torch.tensor([share], dtype=torch.float64)
    dist.all_reduce(total, group=t.ctx.groups["world"].cpu_group)
    return total.item() / (t.micro * t.place.dp_size * t.place.cp_size)


def train_step_ft(t: Trainer, positions: torch.Tensor) -> tuple[int, float] | None:
    """One step under ``ft=torchft``: (step, loss), or None when the quorum did not commit it.

    The quorum first (a replica group that comes back heals here, between steps); then the
    forward and backward as :func:`train_step`, the gradients averaged over the quorum's replica
    groups, and the optimizer steps only if every replica group of the quorum commits.
    """
    manager = t.ctx.ft
    manager.start_quorum()
    if t.progress["step"] >= t.cfg.steps:  # healed from a group holding at the last step
        curve = t.progress["loss_curve"]
        t.ctx.progress(t.progress["step"], t.cfg.steps, loss=curve[-1], **_ft_metrics(t))
        return None
    step = t.progress["step"] + 1
    t.opt.zero_grad(set_to_none=True)
    saved, local_loss = _forward_all(t, step, positions)
    _backward_all(t, saved)
    average_gradients(manager, t.stage)
    share = local_loss if (t.place.last and t.ctx.coords["tp"] == 0) else 0.0
    total = torch.tensor([share], dtype=torch.float64)
    dist.all_reduce(total, group=t.ctx.groups["world"].cpu_group)
    if not manager.should_commit():
        t.ctx.log.warning(f"train: step {step} not committed by the quorum; it runs again")
        return None
    t.opt.step()
    t.updater.update_average(t.stage, t.ema, beta=float(t.cfg.ema_beta))
    return step, total.item() / (t.micro * t.place.dp_size * t.place.cp_size)


def _join_ft(t: Trainer) -> None:
    """Under ``ft=torchft``: this rank's replica group, the state a healing peer gets, the step."""
    manager = t.ctx.ft
    t.replica, t.replicas = t.ctx.ft_replica, int(t.ctx.config["ft"]["replicas"])
    init_optim_state(t.opt)
    manager.register_state_dict_fn(
        "train",
        lambda state: load_replica_state(t.stage, t.ema, t.opt, t.progress, state),
        lambda: replica_state(t.stage, t.ema, t.opt, t.progress),
    )
    manager.load_state_dict({"step": int(t.progress["step"]), "batches_committed": 0})


def _one_step(t: Trainer, positions: torch.Tensor) -> tuple[int, float] | None:
    """The next step, with or without ft: (step, loss), or None when ft did not commit it."""
    if t.ctx.ft is not None:
        return train_step_ft(t, positions)
    step = t.progress["step"] + 1
    return step, train_step(t, step, positions)


def report(
    t: Trainer, resumed: int | None, stopped: bool, steps_run: int, elapsed: float
) -> dict[str, Any]:
    """Gather the full weights to rank 0; rank 0 returns the run's results, every other rank its
    place.
    """

    ctx, cfg, progress = t.ctx, t.cfg, t.progress
    rep = ctx.coords["dp"] == 0 and ctx.coords["cp"] == 0 and ctx.coords["tp"] == 0
    weights, ema_weights = full_state(t.stage), full_state(t.ema)
    parts = gather_state_dicts(
        {"model": weights, "ema": ema_weights} if rep else {},
        dst=0,
        group=ctx.groups["world"].cpu_group,
    )
    row = {
        "rank": ctx.rank,
        "coords": dict(ctx.coords),
        "stage": t.place.stage_id,
        "blocks": t.stage.block_ids,
    }
    if not ctx.is_main:
        return row
    full_w: dict[str, torch.Tensor] = {}
    full_e: dict[str, torch.Tensor] = {}
    for part in parts:  # one rank's dict at a time (an iterator: rank 0 must read it to the end)
        full_w.update(part.get("model", {}))
        full_e.update(part.get("ema", {}))
    curve = list(progress["loss_curve"])
    tokens_per_step = t.global_batch * t.place.split.tokens
    res: dict[str, Any] = {
        **row,
        "steps_done": progress["step"],
        "steps": cfg.steps,
        "stopped": stopped,
        "final_loss": curve[-1] if curve else None,
        "loss_curve": curve,
        "weights_sha256": state_sha256(full_w),
        "ema_sha256": state_sha256(full_e),
        "attempts": list(progress["attempts"]),
        "resumed_from": resumed,
        "tokens_per_s": tokens_per_step * steps_run / elapsed
        if steps_run and elapsed > 0
        else None,
        "tokens_per_step": tokens_per_step,
        "global_batch": t.global_batch,
        "micro_batches": t.micro,
        "layout": get_layout().sizes,
        "config": asdict(cfg),
    }
    if t.ctx.ft is not None:
        res["ft"] = {"replica": t.replica, "participants": t.ctx.ft.num_participants()}
    if cfg.check_reference and not stopped:
        res.update(_compare(cfg, t.global_batch, curve, full_w, full_e))
    ctx.log.info(
        f"train: {progress['step']}/{cfg.steps} steps, loss {res['final_loss']}, "
        f"weights {res['weights_sha256'][:12]}"
    )
    return res


@register_task("train", config=TrainConfig, preload=PRELOAD, ft=True)
def train(ctx: TaskContext) -> dict[str, Any]:
    """Train under the run's CP x PP x DP layout, checkpoint, resume (at any layout); rank 0 reports
    the run.

    The steps a training task takes, each a function above: :func:`build` the model, :func:`load`
    the newest checkpoint, then :func:`train_step` until ``steps``, reporting progress, saving every
    ``checkpoint_every`` steps, when every rank agrees to stop and after the last step; then
    :func:`report`.
    """
    cfg: TrainConfig = ctx.cfg
    if ctx.stop is not None and ctx.stop.calls == 0:
        ctx.stop.every = (
            1  # a step dwarfs one tiny async all-reduce; a stop then lands within two steps
        )
    t = build(ctx, cfg)
    resumed = load(t)
    if ctx.ft is not None:
        _join_ft(t)
    positions = t.place.split.positions(t.place.cp_rank).to(ctx.device)
    progress, start_step, sleep_total, stopped, saved_at = (
        t.progress,
        t.progress["step"],
        0.0,
        False,
        resumed,
    )
    ctx.groups["world"].barrier()
    t0 = time.perf_counter()
    while progress["step"] < cfg.steps:
        done = _one_step(t, positions)
        if cfg.step_sleep_s:
            time.sleep(cfg.step_sleep_s)
            sleep_total += cfg.step_sleep_s
        if done is None:
            continue
        step, loss = done
        progress["step"] = step
        progress["loss_curve"].append(loss)
        progress["data"]["next_step"] = step + 1
        ctx.progress(step, cfg.steps, loss=loss, **_ft_metrics(t))
        stopped = ctx.should_stop()
        if stopped or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
            ctx.checkpoint.save(step, t.state, scopes=SCOPES)
            saved_at = step
        if stopped:
            ctx.log.warning(f"train: stop agreed after step {step}: checkpoint saved, returning")
            break
    elapsed = time.perf_counter() - t0 - sleep_total
    if not stopped:
        ctx.ft_finish()
    if cfg.save_final and not stopped and saved_at != progress["step"]:
        ctx.checkpoint.save(progress["step"], t.state, scopes=SCOPES)
    return report(t, resumed, stopped, progress["step"] - start_step, elapsed)


def _ft_metrics(t: Trainer) -> dict[str, Any]:
    """Under ft: the step's quorum (replica groups in it) for metrics.jsonl and the live view."""
    if t.ctx.ft is None:
        return {}
    return {"replicas": t.ctx.ft.num_participants(), "replica": t.replica}


def reference_run(
    cfg: TrainConfig,
    global_batch: int,
    steps: int,
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, no parallelism: the same model, global batches (in micro-batches of ``batch``)
    and optimizer.
    """

    model = cfg.build_model()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    updater = DTensorFastEmaModelUpdater()
    n = global_batch // cfg.batch
    curve = []
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(n):
            t, xt, target = make_batch(cfg, step, m * cfg.batch, cfg.batch)
            loss = F.mse_loss(model(xt, t), target)
            (loss / n).backward()
            total += loss.item()
        opt.step()
        updater.update_average(model, ema, beta=float(cfg.ema_beta))
        curve.append(total / n)

    def sd(mod: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in mod.named_parameters()}

    return curve, sd(model), sd(ema)


def _max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if sorted(a) != sorted(b):
        raise RuntimeError(f"train reference: parameter names differ: {sorted(set(a) ^ set(b))}")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _compare(
    cfg: TrainConfig,
    global_batch: int,
    curve: list[float],
    weights: dict[str, torch.Tensor],
    ema: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """The run against :func:`reference_run`: loss curve and final (EMA) weights, max abs errors."""
    with torch.random.fork_rng(devices=[]):
        ref_curve, ref_w, ref_e = reference_run(cfg, global_batch, len(curve))
    loss_err = max(abs(a - b) for a, b in zip(curve, ref_curve))
    w_err, e_err = _max_err(weights, ref_w), _max_err(ema, ref_e)
    worst = max(loss_err, w_err, e_err)
    return {
        "reference_loss_curve": ref_curve,
        "reference_loss_err": loss_err,
        "reference_weights_err": w_err,
        "reference_ema_err": e_err,
        "reference_max_abs_err": worst,
        "reference_atol": cfg.reference_atol,
        "reference_ok": bool(worst <= cfg.reference_atol),
    }
