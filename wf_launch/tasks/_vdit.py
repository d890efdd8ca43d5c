"""A tiny video diffusion transformer (DiT over T x H x W patches) that runs under CP and PP.

The pieces a parallel forward needs are separate so that a rank can run only its
share:

- :func:`patchify` / :func:`unpatchify`: latent (B, C, T, H, W) <-> patch grid
  (B, nT, nH, nW, C*pt*ph*pw), tokens ordered T, H, W.
- :class:`PatchGridSplit`: which (T', H', W) block of the patch grid each CP rank holds
  (planned with ``find_split``), the block-major token order that makes each block
  a contiguous slice of the sequence, and every token's global (t, h, w) position.
- :class:`VDiTConfig`: the model's and the latent's sizes, the config fields tasks
  ``demo`` and ``train`` share.
- :class:`VDiT`: ``embed`` (patch embedding + 3D sin-cos positions), ``condition``
  (timestep -> adaLN vector), ``run_blocks(start, stop)`` (one pipeline stage) and
  ``head``; ``forward`` chains them on one process (the reference).

Attention is context-parallel: each rank computes queries for its own tokens and
gathers keys/values of the whole sequence over the CP group (``cat_outputs_cp``).
Attention without a mask is invariant to key order, and positions are added from
global coordinates, so the CP result equals the single-process one up to float
rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from wf_launch.config import TaskConfig, config_error, integer, is_int, number
from worldfoundry.core.distributed import cat_outputs_cp, cat_outputs_cp_with_grad, find_split

__all__ = [
    "CPAttention",
    "DiTBlock",
    "FinalLayer",
    "PatchGridSplit",
    "VDiT",
    "VDiTConfig",
    "gather_kv_with_grad",
    "patchify",
    "sincos_3d",
    "stage_blocks",
    "timestep_embedding",
    "unpatchify",
]

Patch = tuple[int, int, int]
MAX_WIDTH = 1 << 16
"""The widest model (``hidden``); the tasks run on CPUs."""
MAX_MLP_RATIO = 64.0
_RATIO_TEXT = f"expected a number > 0 and <= {MAX_MLP_RATIO:g} with int(hidden * mlp_ratio) >= 1"


@dataclass
class VDiTConfig(TaskConfig):
    """The model and its latent, the fields tasks ``demo`` and ``train`` share (latent units).

    ``patch`` is (t, h, w) and must divide (frames, height, width). A task redeclares a
    field only to give it another default (:func:`~wf_launch.config.fields.redefault`).
    """

    seed: int = integer(0, low=0)
    batch: int = integer(1, low=1)
    channels: int = integer(4, low=1)
    frames: int = integer(6, low=1)
    height: int = integer(32, low=1)
    width: int = integer(32, low=1)
    patch: list[int] = field(default_factory=lambda: [1, 2, 2])
    hidden: int = integer(64, low=1)
    heads: int = integer(4, low=1)
    depth: int = integer(4, low=1)
    mlp_ratio: float = number(4.0, 0, MAX_MLP_RATIO, low_open=True, allowed=_RATIO_TEXT)

    @property
    def latent_shape(self) -> tuple[int, int, int, int, int]:
        return self.batch, self.channels, self.frames, self.height, self.width

    def check_model(self) -> None:
        """The sizes that must fit together (after each field's own rule); ConfigError if not."""
        if (
            not isinstance(self.patch, (list, tuple))
            or len(self.patch) != 3
            or not all(is_int(p) and p >= 1 for p in self.patch)
        ):
            raise config_error("task.patch", self.patch, "expected three integers >= 1: [t, h, w]")
        for name, p in zip(("frames", "height", "width"), self.patch):
            if getattr(self, name) % p:
                raise config_error(
                    f"task.{name}",
                    getattr(self, name),
                    f"must be a multiple of its patch size {p} (patch={list(self.patch)})",
                )
        if self.hidden % 2 or not 6 <= self.hidden <= MAX_WIDTH:
            raise config_error(
                "task.hidden",
                self.hidden,
                f"expected an even integer >= 6 and <= {MAX_WIDTH} (3D sin-cos positions)",
            )
        if self.hidden % self.heads:
            raise config_error("task.heads", self.heads, f"must divide task.hidden={self.hidden}")
        if int(self.hidden * self.mlp_ratio) < 1:
            raise config_error("task.mlp_ratio", self.mlp_ratio, _RATIO_TEXT)

    def split_plan(self, cp_size: int) -> PatchGridSplit:
        """The CP plan of the latent (``find_split``); ValueError or RuntimeError if it cannot."""
        return PatchGridSplit.plan(self.latent_shape, tuple(self.patch), cp_size)


def patchify(latent: torch.Tensor, patch: Patch) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, nT, nH, nW, C*pt*ph*pw); each patch flattened as (C, pt, ph, pw)."""
    b, c, t, h, w = latent.shape
    pt, ph, pw = patch
    x = latent.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, t // pt, h // ph, w // pw, c * pt * ph * pw)


def unpatchify(grid: torch.Tensor, patch: Patch, channels: int) -> torch.Tensor:
    """Inverse of :func:`patchify`: (B, nT, nH, nW, C*pt*ph*pw) -> (B, C, T, H, W)."""
    b, nt, nh, nw, _ = grid.shape
    pt, ph, pw = patch
    x = grid.reshape(b, nt, nh, nw, channels, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, channels, nt * pt, nh * ph, nw * pw)


@dataclass(frozen=True)
class PatchGridSplit:
    """How a (nT, nH, nW) patch grid is divided over ``cp_t * cp_h`` CP ranks.

    CP rank ``r`` holds the block ``(r // cp_h, r % cp_h)``: ``nT / cp_t`` patch
    frames by ``nH / cp_h`` patch rows by all ``nW`` columns. The CP sequence is
    block-major (all of rank 0's tokens, then rank 1's, ...; T, H, W order inside a
    block), so a contiguous equal split of it -- what ``broadcast_split_tensor`` and
    ``cat_outputs_cp`` do -- hands every rank exactly its block. With ``cp_h == 1``
    the block-major order is the natural T, H, W order.
    """

    grid: tuple[int, int, int]
    cp_t: int = 1
    cp_h: int = 1

    def __post_init__(self) -> None:
        nt, nh, _ = self.grid
        if self.cp_t < 1 or self.cp_h < 1 or nt % self.cp_t or nh % self.cp_h:
            raise ValueError(
                f"PatchGridSplit: cp_t={self.cp_t} and cp_h={self.cp_h} must divide the patch "
                f"grid's T={nt} and H={nh}"
            )

    @classmethod
    def plan(cls, latent_shape: Sequence[int], patch: Patch, cp_size: int) -> PatchGridSplit:
        """Plan the split with ``find_split`` (CP over T first, then H, on patch boundaries)."""
        b, c, t, h, w = latent_shape
        grid = (t // patch[0], h // patch[1], w // patch[2])
        if cp_size == 1:
            return cls(grid)

        block = find_split(torch.Size(latent_shape), cp_size, tuple(patch))
        bt, bh, bw = (int(v) for v in block)
        if bw != w or t % bt or h % bh:
            raise RuntimeError(
                f"find_split({tuple(latent_shape)}, cp_size={cp_size}, patch={tuple(patch)}) "
                f"returned block {tuple(block)}, which does not tile the latent "
                f"(T={t}, H={h}, W={w})"
            )
        split = cls(grid, t // bt, h // bh)
        if split.cp_size != cp_size:
            raise RuntimeError(
                f"find_split block {tuple(block)} gives {split.cp_size} blocks, "
                f"expected cp_size={cp_size}"
            )
        return split

    @property
    def cp_size(self) -> int:
        return self.cp_t * self.cp_h

    @property
    def block(self) -> tuple[int, int, int]:
        """Patch-grid block (nT', nH', nW) of one rank."""
        nt, nh, nw = self.grid
        return nt // self.cp_t, nh // self.cp_h, nw

    @property
    def tokens(self) -> int:
        """Tokens in the whole sequence (per sample)."""
        return math.prod(self.grid)

    @property
    def tokens_per_rank(self) -> int:
        return math.prod(self.block)

    def to_sequence(self, grid: torch.Tensor) -> torch.Tensor:
        """(B, nT, nH, nW, D) -> (B, N, D) in block-major order."""
        b, d = grid.shape[0], grid.shape[-1]
        bt, bh, nw = self.block
        x = grid.reshape(b, self.cp_t, bt, self.cp_h, bh, nw, d).permute(0, 1, 3, 2, 4, 5, 6)
        return x.reshape(b, self.tokens, d)

    def from_sequence(self, seq: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_sequence`: (B, N, D) -> (B, nT, nH, nW, D)."""
        b, d = seq.shape[0], seq.shape[-1]
        bt, bh, nw = self.block
        x = seq.reshape(b, self.cp_t, self.cp_h, bt, bh, nw, d).permute(0, 1, 3, 2, 4, 5, 6)
        return x.reshape(b, *self.grid, d)

    def positions(self, cp_rank: int | None = None) -> torch.Tensor:
        """Global (t, h, w) patch coordinates, (L, 3) long: ``cp_rank``'s block, or all (None)."""
        if cp_rank is None:
            return torch.cat([self.positions(r) for r in range(self.cp_size)])
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank={cp_rank} out of range for {self.cp_size} CP ranks")
        bt, bh, nw = self.block
        rt, rh = divmod(cp_rank, self.cp_h)
        t, h, w = torch.meshgrid(
            torch.arange(bt) + rt * bt, torch.arange(bh) + rh * bh, torch.arange(nw), indexing="ij"
        )
        return torch.stack([t, h, w], dim=-1).reshape(-1, 3)


def _sincos(pos: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(
        -math.log(base) * torch.arange(half, dtype=torch.float64, device=pos.device) / half
    )
    angles = pos.to(torch.float64)[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def sincos_3d(positions: torch.Tensor, hidden: int) -> torch.Tensor:
    """Fixed 3D sin-cos embedding (L, hidden) of (L, 3) patch coordinates (float64)."""
    dh = 2 * (hidden // 6)
    dt = hidden - 2 * dh
    return torch.cat(
        [_sincos(positions[:, 0], dt), _sincos(positions[:, 1], dh), _sincos(positions[:, 2], dh)],
        dim=-1,
    )


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding (B, dim) of diffusion times ``t`` in [0, 1] (scaled by 1000)."""
    return _sincos(t * 1000.0, dim, max_period)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (all-reduce)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=getattr(ctx.group, "device_group", ctx.group))
        return grad, None


def gather_kv_with_grad(kv: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """All-gather this rank's keys/values (B, L, 2D) over CP along the sequence, differentiably.

    ``cat_outputs_cp_with_grad`` hands back only this rank's slot of the gathered
    tensor's gradient; but every CP rank's queries attend to these keys, so the slot's
    full gradient is the sum over the CP group of each rank's slot gradient. Summing
    the gathered gradient over CP before the slot is taken makes the backward a
    reduce-scatter, the exact gradient of the all-gather.
    """

    return _SumGradOverGroup.apply(cat_outputs_cp_with_grad(kv, 1, cp_group), cp_group)


class CPAttention(nn.Module):
    """Multi-head self-attention whose keys/values span the whole CP sequence."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cp_group: Any = None) -> torch.Tensor:
        """``x``: this rank's tokens (B, L, D); ``cp_group`` None: the whole sequence is local."""
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).unbind(2)
        if cp_group is not None:
            kv = torch.cat([k, v], dim=-1)
            if torch.is_grad_enabled() and kv.requires_grad:
                k, v = gather_kv_with_grad(kv, cp_group).chunk(2, dim=-1)
            else:
                k, v = cat_outputs_cp(kv, 1, cp_group).chunk(2, dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class DiTBlock(nn.Module):
    """Pre-norm transformer block with adaLN modulation (shift, scale, gate) from the timestep."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = CPAttention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        inner = int(hidden * mlp_ratio)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, inner), nn.GELU(approximate="tanh"), nn.Linear(inner, hidden)
        )
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor, cp_group: Any = None) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).chunk(6, dim=-1)
        x = x + gate1[:, None] * self.attn(_modulate(self.norm1(x), shift1, scale1), cp_group)
        return x + gate2[:, None] * self.mlp(_modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nn.Module):
    """adaLN-modulated norm and projection back to patch values."""

    def __init__(self, hidden: int, patch_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.linear = nn.Linear(hidden, patch_dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.ada(c).chunk(2, dim=-1)
        return self.linear(_modulate(self.norm(x), shift, scale))


def stage_blocks(depth: int, pp_size: int, stage: int) -> range:
    """Blocks of pipeline ``stage``: contiguous, the first ``depth % pp_size`` stages get one extra.

    E.g. depth 5 over 2 stages: stage 0 runs blocks 0-2, stage 1 runs 3-4. A stage
    may get no blocks when depth < pp_size (it passes activations through).
    """
    if not 0 <= stage < pp_size:
        raise ValueError(f"stage={stage} out of range for pp_size={pp_size}")
    per, extra = divmod(depth, pp_size)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (stage < extra))


class VDiT(nn.Module):
    """Tiny video DiT: patch embed, ``depth`` CP-aware blocks, adaLN final layer.

    Build it with the same seed on every rank to get identical weights without any
    weight traffic (:meth:`seeded`).
    """

    def __init__(
        self,
        channels: int,
        patch: Patch,
        hidden: int,
        heads: int,
        depth: int,
        mlp_ratio: float = 4.0,
    ) -> None:
        super().__init__()
        self.channels, self.patch, self.hidden = channels, tuple(patch), hidden
        patch_dim = channels * math.prod(patch)
        self.patch_embed = nn.Linear(patch_dim, hidden)
        self.t_embed = nn.Sequential(
            nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden)
        )
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads, mlp_ratio) for _ in range(depth))
        self.final = FinalLayer(hidden, patch_dim)

    @classmethod
    def seeded(
        cls, seed: int, *, dtype: torch.dtype = torch.float32, device: Any = "cpu", **kwargs: Any
    ) -> VDiT:
        """Build with torch's default init under ``seed`` (global RNG left untouched), then cast."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(**kwargs)
        return model.to(device=device, dtype=dtype).eval()

    def condition(self, t: torch.Tensor) -> torch.Tensor:
        """Timestep vector (B, hidden) that modulates every block."""
        dtype = self.patch_embed.weight.dtype
        return self.t_embed(timestep_embedding(t, self.hidden).to(device=t.device, dtype=dtype))

    def embed(self, patches: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Patch values (B, L, patch_dim) at global ``positions`` (L, 3) -> tokens (B, L, D)."""
        pos = sincos_3d(positions, self.hidden).to(device=patches.device, dtype=patches.dtype)
        return self.patch_embed(patches) + pos

    def run_blocks(
        self, x: torch.Tensor, c: torch.Tensor, blocks: range | None = None, cp_group: Any = None
    ) -> torch.Tensor:
        """Run ``blocks`` (default all) on this rank's tokens."""
        for i in blocks if blocks is not None else range(len(self.blocks)):
            x = self.blocks[i](x, c, cp_group)
        return x

    def head(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Tokens (B, L, hidden) -> patch values (B, L, patch_dim)."""
        return self.final(x, c)

    def forward(self, latent: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Single-process forward: latent (B, C, T, H, W) and times (B,) -> output of the latent's
        shape.
        """
        grid = patchify(latent, self.patch)
        split = PatchGridSplit(tuple(grid.shape[1:4]))
        c = self.condition(t)
        x = self.embed(split.to_sequence(grid), split.positions())
        out = self.head(self.run_blocks(x, c), c)
        return unpatchify(split.from_sequence(out), self.patch, self.channels)
