"""Gather bytes and state dicts to one rank, in bounded chunks and without unpickling.

``torch.distributed.gather_object`` unpickles whatever peers send and moves each rank's
whole object at once; these helpers move raw bytes ``chunk_bytes`` per rank at a time,
and state dicts come back through ``torch.load(weights_only=True)``.

Every call starts with a small header exchange (int64 tensors only, nothing unpickled):
each rank's status, size, ``dst`` and chunk size. A rank whose own arguments are wrong
(or whose state does not serialize) still joins it, so every rank raises the same
exception type, naming that rank and the argument, instead of leaving peers waiting in a
collective it never reaches.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..validation import is_int
from . import identity
from .backends import group_device

__all__ = ["gather_bytes", "gather_state_dicts"]

DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
_MAX_I64 = 2**62  # larger sizes / chunk widths are clamped before they go into an int64 header
_MSG_BYTES = 512  # a failing rank's message travels as this many UTF-8 bytes (truncated)

# header status codes: which exception every rank raises for a failing rank
_OK = 0
_ERRORS: dict[int, type[Exception]] = {1: TypeError, 2: ValueError, 3: RuntimeError}
_CODES = {cls: code for code, cls in _ERRORS.items()}


def _as_uint8(data: bytes | bytearray | memoryview) -> torch.Tensor:
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only ever read it
        return torch.frombuffer(data, dtype=torch.uint8)


def _byte_view(data: Any, where: str, me: int) -> memoryview:
    """``data`` as a flat byte view; TypeError / ValueError naming the rank otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"{where}: rank {me} passed data of type {type(data).__name__}; "
            "data must be bytes, bytearray or memoryview"
        )
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError(f"{where}: rank {me} passed a non-contiguous memoryview as data")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _check_dst(dst: Any, ranks: list[int], where: str, me: int) -> None:
    if not is_int(dst):
        raise TypeError(
            f"{where}: rank {me} passed dst={dst!r}; dst must be an int (a global rank)"
        )
    if dst not in ranks:
        if len(ranks) == 1 and ranks == [0]:
            raise ValueError(f"{where}: dst={dst} is outside a single process's run; allowed: 0")
        raise ValueError(
            f"{where}: rank {me} passed dst={dst}, which is not a rank of the group; "
            f"allowed: {ranks}"
        )


def _check_chunk(chunk_bytes: Any, where: str, me: int) -> None:
    if not is_int(chunk_bytes) or chunk_bytes <= 0:
        raise ValueError(
            f"{where}: rank {me} passed chunk_bytes={chunk_bytes!r}; "
            "chunk_bytes must be a positive int"
        )


def _group_ranks(group: Any) -> list[int]:
    if group is not None:
        return list(dist.get_process_group_ranks(group))
    return list(range(identity.size()))


def _encode(message: str) -> torch.Tensor:
    raw = message.encode("utf-8", "replace")[:_MSG_BYTES]
    buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
    if raw:
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _decode(t: torch.Tensor) -> str:
    raw = bytes(t.cpu().tolist())
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def _raise_failure(
    ctrl: Any, group: Any, ranks: list[int], failure: Exception | None, first: tuple[int, int]
) -> None:
    """Exchange the failing ranks' messages; raise this rank's failure, or the first rank's."""
    msg = _encode("" if failure is None else str(failure)).to(ctrl)
    msgs = [torch.zeros(_MSG_BYTES, dtype=torch.uint8, device=ctrl) for _ in ranks]
    dist.all_gather(msgs, msg, group=group)
    if failure is not None:
        raise failure
    r, c = first
    text = _decode(msgs[ranks.index(r)])
    raise _ERRORS.get(c, RuntimeError)(
        f"{text} [rank {r} failed before the gather, so no rank gathers; "
        f"this is rank {identity.rank()}]"
    )


def _same_everywhere(where: str, ranks: list[int], rows: list[list[int]]) -> None:
    """ValueError on every rank when the ranks passed different ``dst`` or ``chunk_bytes``."""
    for name, column in (("dst", 2), ("chunk_bytes", 3)):
        seen = {r: row[column] for r, row in zip(ranks, rows)}
        if len(set(seen.values())) > 1:
            shown = ", ".join(f"rank {r}: {name}={v}" for r, v in seen.items())
            raise ValueError(
                f"{where}: the ranks passed different {name} ({shown}); every rank "
                f"of the group must pass the same {name}"
            )


def _agree(
    where: str,
    group: Any,
    ranks: list[int],
    failure: Exception | None,
    nbytes: int,
    dst: Any,
    chunk_bytes: Any,
) -> list[int]:
    """The header exchange; returns every rank's size, or raises alike on every rank.

    A failing rank raises its own exception; the others raise the same type, naming the
    failing rank and its message. Ranks that pass different ``dst`` or ``chunk_bytes``
    all raise ValueError naming them.
    """
    ctrl = group_device(group, control=True)
    code = _OK if failure is None else _CODES.get(type(failure), 3)
    good_dst = dst if (failure is None and isinstance(dst, int)) else -1
    good_chunk = min(chunk_bytes, _MAX_I64) if failure is None else 0
    mine = torch.tensor(
        [code, min(nbytes, _MAX_I64), good_dst, good_chunk], dtype=torch.int64, device=ctrl
    )
    headers = [torch.zeros(4, dtype=torch.int64, device=ctrl) for _ in ranks]
    dist.all_gather(headers, mine, group=group)
    rows = [[int(v) for v in h.tolist()] for h in headers]
    failed = [(r, row[0]) for r, row in zip(ranks, rows) if row[0] != _OK]
    if failed:
        _raise_failure(ctrl, group, ranks, failure, failed[0])
    _same_everywhere(where, ranks, rows)
    return [row[1] for row in rows]


def gather_bytes(
    data: bytes, dst: int, group: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[bytearray] | None:
    """Gathers byte strings to global rank ``dst`` only, without unpickling anything on the way.

    Moves ``chunk_bytes`` per rank at a time, bounding device memory. Returns the
    per-rank bytes (group rank order) on ``dst`` and None elsewhere. Collective over
    ``group`` (None: the world); a single process gets ``[data]`` back for ``dst=0``.
    A bad argument on any rank (data that is not bytes, a ``dst`` outside the group,
    ``chunk_bytes`` that is not a positive int), or ranks passing different ``dst`` /
    ``chunk_bytes``, makes every rank raise the same TypeError / ValueError, naming the
    rank and the argument.
    """
    where = "gather_bytes"
    if not (dist.is_available() and dist.is_initialized()):
        view = _byte_view(data, where, 0)
        _check_dst(dst, [0], where, 0)
        _check_chunk(chunk_bytes, where, 0)
        return [bytearray(view)]
    me = identity.rank()
    ranks = _group_ranks(group)
    failure: Exception | None = None
    view = memoryview(b"")
    try:
        view = _byte_view(data, where, me)
        _check_dst(dst, ranks, where, me)
        _check_chunk(chunk_bytes, where, me)
    except (TypeError, ValueError) as e:
        failure = e
    sizes = _agree(where, group, ranks, failure, view.nbytes, dst, chunk_bytes)
    chunk = min(chunk_bytes, _MAX_I64)
    device = group_device(group)
    src = _as_uint8(view)
    out = [bytearray(n) for n in sizes] if me == dst else None
    longest = max(sizes)
    for offset in range(0, longest, chunk):
        width = min(chunk, longest - offset)
        send = torch.zeros(width, dtype=torch.uint8, device=device)
        mine = src[offset : offset + width]
        send[: mine.numel()].copy_(mine)
        recv = (
            [torch.empty(width, dtype=torch.uint8, device=device) for _ in ranks]
            if me == dst
            else None
        )
        dist.gather(send, recv, dst=dst, group=group)
        if out is not None and recv is not None:
            for buf, n, piece in zip(out, sizes, recv):
                take = min(width, n - offset)
                if take > 0:
                    _as_uint8(memoryview(buf)[offset : offset + take]).copy_(piece[:take])
    return out


class _CountingSink:
    """A write-only file that keeps nothing: checks that a state serializes, and its size."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.size += n
        return n

    def flush(self) -> None:
        pass


def _serialize(state: dict) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf


def gather_state_dicts(
    state: dict, dst: int, group: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[dict]:
    """Gathers ``state`` from every rank of ``group`` to global rank ``dst`` (weights_only load).

    Yields one rank's dict at a time on ``dst`` (tensors on CPU), and nothing elsewhere:
    ``dst`` receives rank by rank as it iterates, loads that rank's bytes, yields the
    dict and drops the bytes, so it never holds more than one rank's bytes and dict
    (plus whatever the caller keeps). Device memory per round is one ``chunk_bytes``
    buffer on ``dst`` and on the sending rank.

    The header exchange (sizes, ``dst``, failures) runs eagerly on every rank, so every
    rank must call this; each other rank then sends its bytes to ``dst`` and returns once
    ``dst`` has received them, so ``dst`` must iterate to the end before it joins another
    collective of the group. A bad argument or a state that does not serialize on any
    rank makes every rank raise alike (TypeError / ValueError / RuntimeError naming the
    rank); a dict holding anything ``weights_only`` refuses raises on ``dst`` while
    iterating, naming the rank.
    """
    where = "gather_state_dicts"
    distributed = dist.is_available() and dist.is_initialized()
    me = identity.rank() if distributed else 0
    ranks = _group_ranks(group) if distributed else [0]
    failure: Exception | None = None
    buf: io.BytesIO | None = None
    nbytes = 0
    try:
        if not isinstance(state, dict):
            raise TypeError(
                f"{where}: rank {me} passed a state of type {type(state).__name__}; "
                "state must be a dict"
            )
        _check_dst(dst, ranks, where, me)
        _check_chunk(chunk_bytes, where, me)
        try:
            if me == dst:  # dst serializes its own state again on its turn: nothing held meanwhile
                sink = _CountingSink()
                torch.save(state, sink)
                nbytes = sink.size
            else:
                buf = _serialize(state)
                nbytes = buf.getbuffer().nbytes
        except Exception as e:
            raise RuntimeError(
                f"{where}: rank {me}'s state does not serialize: {type(e).__name__}: {e}"
            ) from e
    except (TypeError, ValueError, RuntimeError) as e:
        failure = e
    if not distributed:
        if failure is not None:
            raise failure
        return _receive_each(where, state, dst, None, [0], [nbytes], 0, chunk_bytes)
    sizes = _agree(where, group, ranks, failure, nbytes, dst, chunk_bytes)
    chunk = min(chunk_bytes, _MAX_I64)
    if me != dst:
        assert buf is not None
        _send(buf.getbuffer(), dst, group, chunk)
        del buf
        return iter(())
    return _receive_each(where, state, dst, group, ranks, sizes, me, chunk)


def _send(data: memoryview, dst: int, group: Any, chunk: int) -> None:
    device = group_device(group)
    src = _as_uint8(data)
    total = src.numel()
    for offset in range(0, total, chunk):
        piece = src[offset : offset + chunk]
        if device.type != "cpu":
            piece = piece.to(device)
        dist.send(piece, dst=dst, group=group)


def _receive_each(
    where: str,
    state: dict,
    dst: int,
    group: Any,
    ranks: list[int],
    sizes: list[int],
    me: int,
    chunk: int,
) -> Iterator[dict]:
    pending = list(zip(ranks, sizes))
    try:
        while pending:
            rank, n = pending.pop(0)
            if rank == me:
                blob: Any = _serialize(state)
                blob.seek(0)
            else:
                blob = io.BytesIO(_receive(rank, n, group, chunk))
            try:
                loaded = torch.load(blob, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                raise pickle.UnpicklingError(
                    f"{where}: rank {rank}'s state does not load with weights_only=True "
                    f"(only tensors and plain containers are allowed): {e}"
                ) from e
            del blob
            yield loaded
            del loaded
    finally:
        # an error, a ``break`` or a dropped iterator: the senders still wait on dst, so
        # take (and discard) what they send before leaving
        for rank, n in pending:
            if rank != me:
                _drain(rank, n, group, chunk)


def _drain(src: int, n: int, group: Any, chunk: int) -> None:
    device = group_device(group)
    scratch = torch.empty(min(chunk, n), dtype=torch.uint8, device=device)
    for offset in range(0, n, chunk):
        dist.recv(scratch[: min(chunk, n - offset)], src=src, group=group)


def _receive(src: int, n: int, group: Any, chunk: int) -> bytearray:
    device = group_device(group)
    out = bytearray(n)
    view = memoryview(out)
    for offset in range(0, n, chunk):
        width = min(chunk, n - offset)
        dest = _as_uint8(view[offset : offset + width])
        if device.type == "cpu":
            dist.recv(dest, src=src, group=group)
        else:
            tmp = torch.empty(width, dtype=torch.uint8, device=device)
            dist.recv(tmp, src=src, group=group)
            dest.copy_(tmp)
            del tmp
    return out
