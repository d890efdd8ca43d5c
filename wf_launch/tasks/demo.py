"""Task ``demo``: a tiny video-DiT forward pass under the run's CP x PP layout, checked against one
process.

What every model-parallel replica does:

1. The first rank of each stage-0 CP group makes a seeded latent (B, C, T, H, W);
   ``find_split`` plans the per-rank (T', H', W) block (CP over T first, then H),
   and ``broadcast_split_tensor`` hands each CP rank its block of patches
   (:class:`~wf_launch.tasks._vdit.PatchGridSplit` orders the sequence block-major).
2. Every rank builds the same weights from ``seed`` (no weight traffic).
3. Stage ``s`` runs blocks ``stage_blocks(depth, pp_size, s)`` (contiguous, the
   first ``depth % pp_size`` stages get one extra); activations go stage to stage
   with the PP scheduler. The output stays on the last stage (nothing is sent
   back round the ring to stage 0).
4. Attention gathers K/V over CP (``cat_outputs_cp``); the last stage gathers the
   output sequence, unpatchifies it and its first CP rank compares it with a
   single-process forward of the same model on the same latent.

Data parallel replicas use different samples (sample seed ``seed + 1 + dp``); tp>1
ranks run the same work replicated (this model has no tensor parallelism). Rank 0
gathers every rank's row and reports the run: ``max_abs_err`` (max over replicas),
``ok``, ``tokens``, ``tokens_per_s`` and ``layout``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from wf_launch.config import (
    ConfigError,
    EngineConfig,
    check_fields,
    choice,
    flag,
    integer,
    number,
)
from worldfoundry.core.distributed import broadcast_split_tensor, cat_outputs_cp, get_layout

from ..rank.task_context import TaskContext
from ..rank.task_registry import register_task
from ._vdit import PatchGridSplit, VDiT, VDiTConfig, patchify, stage_blocks, unpatchify

__all__ = ["DEFAULT_ATOL", "DTYPES", "DemoTaskConfig", "demo", "plan_split"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}
DEFAULT_ATOL: dict[str, float] = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 0.05}
"""Tolerance when ``atol`` is null: reduction-order noise of each dtype on outputs of order 1."""


@dataclass
class DemoTaskConfig(VDiTConfig):
    """Config of task ``demo`` (``task=demo task.frames=8 ...``).

    The model's fields are :class:`~wf_launch.tasks._vdit.VDiTConfig`'s. ``atol`` null
    picks a per-dtype tolerance (:data:`DEFAULT_ATOL`).
    """

    name: str = "demo"
    dtype: str = choice("float32", DTYPES)
    warmup: int = integer(1, low=0)
    repeats: int = integer(3, low=1)
    check: bool = flag(True)
    atol: float | None = number(
        None, 0, low_open=True, note="or null for the dtype's default", optional=True
    )

    def validate(self, engine: EngineConfig | None = None) -> None:
        """Raise :class:`ConfigError` naming the field, its value and what is allowed.

        With the run's ``engine``, also check that its ``cp_size`` can split the latent.
        """
        check_fields(self, "task")
        self.check_model()
        if engine is not None:
            plan_split(self, engine.cp_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def tolerance(self) -> float:
        return float(self.atol) if self.atol is not None else DEFAULT_ATOL[self.dtype]

    def build_model(self, device: Any = "cpu") -> VDiT:
        """The seeded model, identical on every rank."""
        return VDiT.seeded(
            self.seed,
            dtype=self.torch_dtype,
            device=device,
            channels=self.channels,
            patch=tuple(self.patch),
            hidden=self.hidden,
            heads=self.heads,
            depth=self.depth,
            mlp_ratio=float(self.mlp_ratio),
        )

    def make_sample(
        self,
        sample_seed: int,
        device: Any = "cpu",
        latent: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Seeded diffusion times (B,) and, if ``latent``, a latent (B, C, T, H, W); generated on
        CPU.
        """
        gen = torch.Generator().manual_seed(sample_seed)
        t = torch.rand(self.batch, generator=gen, dtype=torch.float64)
        x = torch.randn(self.latent_shape, generator=gen) if latent else None
        return t.to(device), None if x is None else x.to(device=device, dtype=self.torch_dtype)


def plan_split(cfg: DemoTaskConfig, cp_size: int) -> PatchGridSplit:
    """CP plan of the latent (``find_split``), with an error naming the config when CP cannot be
    placed.
    """
    try:
        return cfg.split_plan(cp_size)
    except (ValueError, RuntimeError) as exc:
        pt, ph, pw = cfg.patch
        raise ConfigError(
            f"engine.cp_size={cp_size} cannot split the demo latent on patch boundaries: "
            f"{cfg.frames // pt} patch frames x {cfg.height // ph} patch rows "
            f"(task.frames={cfg.frames}, task.height={cfg.height}, task.patch={list(cfg.patch)}); "
            f"cp_size must be (a divisor of the patch frames) x (a divisor of the patch rows), "
            f"W is never split ({exc})"
        ) from exc


def _wait(handle: Any) -> None:
    if handle is None:
        return
    if isinstance(handle, (list, tuple)):
        for h in handle:
            _wait(h)
    elif hasattr(handle, "wait"):
        handle.wait()


def _sync(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Forward:
    """One rank's share of the demo's forward pass: its stage's blocks, its CP block, its sample."""

    cfg: DemoTaskConfig
    ctx: TaskContext
    model: VDiT
    split: PatchGridSplit
    blocks: range
    t: torch.Tensor
    latent: torch.Tensor | None
    positions: torch.Tensor
    pending: list[Any] = field(default_factory=list)

    @classmethod
    def build(cls, ctx: TaskContext, cfg: DemoTaskConfig) -> _Forward:
        stage, n_stages = ctx.coords["pp"], ctx.groups["pp"].world_size
        cp = ctx.groups["cp"]
        split = plan_split(cfg, cp.world_size)
        model = cfg.build_model(ctx.device)
        first, last = stage == 0, stage == n_stages - 1
        needs_latent = cp.rank == min(cp.ranks) and (first or (last and cfg.check))
        t, latent = cfg.make_sample(
            cfg.seed + 1 + ctx.coords["dp"], ctx.device, latent=needs_latent
        )
        return cls(
            cfg,
            ctx,
            model,
            split,
            stage_blocks(cfg.depth, n_stages, stage),
            t,
            latent,
            split.positions(cp.rank_in_group).to(ctx.device),
        )

    @property
    def first(self) -> bool:
        return self.ctx.coords["pp"] == 0

    @property
    def last(self) -> bool:
        return self.ctx.coords["pp"] == self.ctx.groups["pp"].world_size - 1

    @property
    def cp_source(self) -> bool:
        """The CP group's first rank: it holds the whole latent and checks the output."""
        cp = self.ctx.groups["cp"]
        return cp.rank == min(cp.ranks)

    @property
    def shard(self) -> tuple[int, int, int]:
        return self.cfg.batch, self.split.tokens_per_rank, self.cfg.hidden

    def __call__(self) -> torch.Tensor | None:
        """One forward of this stage; the last stage returns the whole output latent, the others
        None.
        """
        cfg, ctx = self.cfg, self.ctx
        cp_pg = ctx.groups["cp"] if ctx.groups["cp"].world_size > 1 else None
        c = self.model.condition(self.t)
        if self.first:
            seq = (
                self.split.to_sequence(patchify(self.latent, tuple(cfg.patch)))
                if self.cp_source
                else None
            )
            x = self.model.embed(broadcast_split_tensor(seq, 1, cp_pg), self.positions)
        else:
            x = ctx.pp.recv_prev_data(self.shard, cfg.torch_dtype)
        x = self.model.run_blocks(x, c, self.blocks, cp_pg)
        if not self.last:
            self.pending.append(ctx.pp.isend_next(x.contiguous()))
            return None
        out = cat_outputs_cp(self.model.head(x, c), 1, cp_pg)
        return unpatchify(self.split.from_sequence(out), tuple(cfg.patch), cfg.channels)

    def settle(self) -> None:
        """Wait for the sends in flight, the device and every rank."""
        _wait(self.pending)
        self.pending.clear()
        _sync(self.ctx.device)
        self.ctx.groups["world"].barrier()


def _timed(fwd: _Forward) -> tuple[torch.Tensor | None, float]:
    """Warm up, then the mean time of ``repeats`` forwards (as progress); the last output."""
    for _ in range(fwd.cfg.warmup):
        fwd()
    fwd.settle()
    start = time.perf_counter()
    out = None
    for i in range(fwd.cfg.repeats):
        out = fwd()
        fwd.ctx.progress(i + 1, fwd.cfg.repeats)
    fwd.settle()
    return out, (time.perf_counter() - start) / fwd.cfg.repeats


@register_task("demo", config=DemoTaskConfig)
def demo(ctx: TaskContext) -> dict[str, Any]:
    """Run the CP x PP forward, time it, check it against one process; rank 0 reports the run."""
    cfg: DemoTaskConfig = ctx.cfg
    fwd = _Forward.build(ctx, cfg)
    with torch.inference_mode():
        out, forward_s = _timed(fwd)
        row: dict[str, Any] = {
            "rank": ctx.rank,
            "coords": dict(ctx.coords),
            "stage": ctx.coords["pp"],
            "blocks": [fwd.blocks.start, fwd.blocks.stop],
            "cp_block": list(fwd.split.block),
            "shard_shape": list(fwd.shard),
            "forward_s": forward_s,
        }
        if fwd.last and fwd.cp_source:
            row.update(_check(cfg, fwd.model, fwd.split, out, fwd.latent, fwd.t, forward_s, ctx))
    rows: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(rows, row, group=ctx.groups["world"].cpu_group)
    if not ctx.is_main:
        return row
    summary = _summarize(cfg, fwd.split, rows, ctx)
    ctx.log.info(
        f"demo: {summary['layout_text']}: {summary['tokens']} tokens, "
        f"{summary['tokens_per_s']:.0f} tokens/s, max_abs_err={summary['max_abs_err']}, "
        f"ok={summary['ok']}"
    )
    return {**row, **summary}


def _check(
    cfg: DemoTaskConfig,
    model: VDiT,
    split: PatchGridSplit,
    out: torch.Tensor,
    latent: torch.Tensor | None,
    t: torch.Tensor,
    forward_s: float,
    ctx: TaskContext,
) -> dict[str, Any]:
    """On the rank holding the output: error against the single-process forward, and throughput."""
    tokens = cfg.batch * split.tokens
    res: dict[str, Any] = {
        "holds_output": True,
        "output_shape": list(out.shape),
        "tokens": tokens,
        "tokens_per_s": tokens / forward_s,
        "atol": cfg.tolerance,
    }
    if not cfg.check:
        return {**res, "max_abs_err": None, "ok": True}
    ref = model(latent, t)
    _sync(ctx.device)
    start = time.perf_counter()
    for _ in range(cfg.repeats):
        ref = model(latent, t)
    _sync(ctx.device)
    ref_s = (time.perf_counter() - start) / cfg.repeats
    err = (out.double() - ref.double()).abs().max().item()
    return {
        **res,
        "max_abs_err": err,
        "ok": bool(err <= cfg.tolerance),
        "ref_forward_s": ref_s,
        "ref_tokens_per_s": tokens / ref_s,
    }


def _outputs(holders: list[dict[str, Any]], replicas: int) -> dict[str, Any]:
    """What the ranks holding the output measured: speed, error, and whether every replica held."""
    errs = [r["max_abs_err"] for r in holders if r.get("max_abs_err") is not None]
    return {
        "tokens_per_s": min(r["tokens_per_s"] for r in holders),
        "ref_tokens_per_s": min(
            (r["ref_tokens_per_s"] for r in holders if "ref_tokens_per_s" in r), default=None
        ),
        "max_abs_err": max(errs) if errs else None,
        "ok": all(r["ok"] for r in holders) and len(holders) == replicas,
        "output_ranks": [r["rank"] for r in holders],
    }


def _first_replica_blocks(rows: list[dict[str, Any]]) -> list[list[int]]:
    """Each pipeline stage's blocks, as the first tp, cp and dp rank of the stage ran them."""
    return [
        list(r["blocks"])
        for r in rows
        if r["coords"]["tp"] == 0 and r["coords"]["cp"] == 0 and r["coords"]["dp"] == 0
    ]


def _summarize(
    cfg: DemoTaskConfig, split: PatchGridSplit, rows: list[dict[str, Any]], ctx: TaskContext
) -> dict[str, Any]:
    """Rank 0's view of the run, from every rank's row."""
    layout = get_layout()
    holders = [r for r in rows if r.get("holds_output")]
    outputs = _outputs(holders, layout.world_size // (layout.cp_size * layout.pp_size))
    pt, ph, _ = cfg.patch
    bt, bh, _ = split.block
    return {
        "layout": layout.sizes,
        "layout_text": layout.describe(),
        "order": "-".join(layout.dims),
        "tokens": cfg.batch * split.tokens,
        "tokens_per_s": outputs["tokens_per_s"],
        "ref_tokens_per_s": outputs["ref_tokens_per_s"],
        "max_abs_err": outputs["max_abs_err"],
        "atol": cfg.tolerance,
        "ok": outputs["ok"],
        "output_ranks": outputs["output_ranks"],
        "cp_split": {
            "cp_t": split.cp_t,
            "cp_h": split.cp_h,
            "block_latent": [bt * pt, bh * ph, cfg.width],
        },
        "stage_blocks": _first_replica_blocks(rows),
        "tp_replicated": layout.tp_size > 1,
        "dp_samples": f"dp replica d uses sample seed {cfg.seed} + 1 + d",
        "config": asdict(cfg),
    }
