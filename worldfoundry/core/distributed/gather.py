"""Gather bytes and state dicts to one rank, in bounded chunks and without unpickling.

``torch.distributed.gather_object`` unpickles whatever peers send and moves each rank's
whole object at once; these helpers move raw bytes ``chunk_bytes`` per rank at a time,
and state dicts come back through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .backends import group_device

__all__ = ["gather_bytes", "gather_state_dicts"]

DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024


def _as_uint8(data: bytes | bytearray | memoryview) -> torch.Tensor:
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only ever read it
        return torch.frombuffer(data, dtype=torch.uint8)


def _check_args(data: Any, dst: Any, chunk_bytes: Any) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"gather_bytes: data must be bytes, bytearray or memoryview, got {type(data).__name__}"
        )
    if isinstance(dst, bool) or not isinstance(dst, int):
        raise TypeError(f"gather_bytes: dst must be an int (a global rank), got {dst!r}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"gather_bytes: chunk_bytes={chunk_bytes!r} must be a positive int")


def _gather(data: bytes | bytearray | memoryview | None, dst: int, group: Any, chunk_bytes: int,
            failure: str | None, where: str) -> list[bytearray] | None:
    """Gather ``data`` to ``dst``; a rank passing ``failure`` makes every rank raise."""
    if not (dist.is_available() and dist.is_initialized()):
        if dst != 0:
            raise ValueError(f"{where}: dst={dst} is outside a single process's run; allowed: 0")
        if failure is not None:
            raise RuntimeError(f"{where}: rank 0 failed: {failure}")
        return [bytearray(data or b"")]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if dst not in ranks:
        raise ValueError(f"{where}: dst={dst} is not a rank of the group; allowed: {ranks}")
    device = group_device(group)
    me = dist.get_rank()
    nbytes = -1 if failure is not None else len(data or b"")
    sizes_t = [torch.zeros(1, dtype=torch.int64, device=device) for _ in ranks]
    dist.all_gather(sizes_t, torch.tensor([nbytes], dtype=torch.int64, device=device), group=group)
    sizes = [int(t.item()) for t in sizes_t]
    failed = [r for r, n in zip(ranks, sizes) if n < 0]
    if failed:
        if failure is not None:
            raise RuntimeError(f"{where}: rank {me} failed: {failure}")
        raise RuntimeError(f"{where}: rank {failed[0]} failed before the gather, so no rank gathers")
    src = _as_uint8(data or b"")
    out = [bytearray(n) for n in sizes] if me == dst else None
    longest = max(sizes)
    for offset in range(0, longest, chunk_bytes):
        width = min(chunk_bytes, longest - offset)
        send = torch.zeros(width, dtype=torch.uint8, device=device)
        mine = src[offset:offset + width]
        send[: mine.numel()].copy_(mine)
        recv = [torch.empty(width, dtype=torch.uint8, device=device) for _ in ranks] if me == dst else None
        dist.gather(send, recv, dst=dst, group=group)
        if out is not None and recv is not None:
            for buf, n, chunk in zip(out, sizes, recv):
                take = min(width, n - offset)
                if take > 0:
                    _as_uint8(memoryview(buf)[offset:offset + take]).copy_(chunk[:take])
    return out


def gather_bytes(data: bytes, dst: int, group: Any = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[bytearray] | None:
    """Gathers byte strings to global rank ``dst`` only, without unpickling anything on the way.

    Moves ``chunk_bytes`` per rank at a time, bounding device memory. Returns the
    per-rank bytes (group rank order) on ``dst`` and None elsewhere. Collective over
    ``group`` (None: the world); a single process gets ``[data]`` back for ``dst=0``.
    """
    _check_args(data, dst, chunk_bytes)
    return _gather(data, dst, group, chunk_bytes, None, "gather_bytes")


def gather_state_dicts(state: dict, dst: int, group: Any = None) -> Iterator[dict]:
    """Gathers ``state`` from every rank of ``group`` to global rank ``dst``, loaded with weights_only.

    Yields one rank's dict at a time on ``dst`` (tensors on CPU), to bound host memory,
    and nothing elsewhere. The collective runs eagerly, so every rank must call this
    before iterating. A rank whose ``state`` does not serialize makes every rank raise;
    a dict holding anything ``weights_only`` refuses raises on ``dst`` while iterating.
    """
    if not isinstance(state, dict):
        raise TypeError(f"gather_state_dicts: state must be a dict, got {type(state).__name__}")
    _check_args(b"", dst, DEFAULT_CHUNK_BYTES)
    buf = io.BytesIO()
    failure = None
    try:
        torch.save(state, buf)
    except Exception as e:
        failure = f"state does not serialize: {type(e).__name__}: {e}"
    blobs = _gather(buf.getbuffer() if failure is None else None, dst, group, DEFAULT_CHUNK_BYTES,
                    failure, "gather_state_dicts")
    del buf
    ranks = (dist.get_process_group_ranks(group) if group is not None and dist.is_initialized()
             else list(range(len(blobs or []))))
    return _load_each(blobs, ranks) if blobs is not None else iter(())


def _load_each(blobs: list[bytearray], ranks: list[int]) -> Iterator[dict]:
    for rank in ranks:
        blob = blobs.pop(0)
        try:
            loaded = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(
                f"gather_state_dicts: rank {rank}'s state does not load with weights_only=True "
                f"(only tensors and plain containers are allowed): {e}"
            ) from e
        del blob
        yield loaded
