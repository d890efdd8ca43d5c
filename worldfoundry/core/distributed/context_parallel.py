"""Context-parallel (CP) helpers: shard a sequence over a group, gather it back, broadcast inputs.

Every helper follows the tensor's device (CPU tensors over gloo, CUDA tensors over
NCCL; nothing is moved with ``.cuda()``), accepts either a torch ``ProcessGroup``
or a :class:`~.groups.GroupCoordinator` as the group, and treats ``None`` as "no
context parallelism" (the input comes back unchanged, as the same object).

Group-rank order is the order of ``torch.distributed`` group ranks, so
``split_inputs_cp`` / ``broadcast_split_tensor`` and ``cat_outputs_cp`` agree on
which shard belongs to which rank. Broadcast sources are the group's minimum
global rank.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..validation import is_int
from . import identity
from . import runtime as _rt
from .backends import group_device

__all__ = [
    "CPSplit",
    "broadcast",
    "broadcast_split_tensor",
    "cat_outputs_cp",
    "cat_outputs_cp_with_grad",
    "find_split",
    "find_split_plan",
    "split_inputs_cp",
]

GroupLike = Any
"""A torch ``ProcessGroup``, a :class:`~.groups.GroupCoordinator`, or ``None``."""

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_MAX_NDIM = 64
_HEADER_LEN = 4 + _MAX_NDIM
_KIND_OBJECT, _KIND_TENSOR = 0, 1
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "npu", "mps", "mtia")
_DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
_DTYPE_INDEX: dict[torch.dtype, int] = {d: i for i, d in enumerate(_DTYPES)}


# ---------------------------------------------------------------- group plumbing


def _device_group(group: GroupLike) -> Any:
    """The process group that carries tensors of ``group``."""
    return getattr(group, "device_group", group)


def _cpu_group(group: GroupLike) -> Any:
    """The process group that carries CPU tensors and pickled objects of ``group``."""
    return getattr(group, "cpu_group", group)


def _size_and_rank(pg: Any, fn: str) -> tuple[int, int]:
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if rank < 0:
        raise ValueError(
            f"{fn}: global rank {identity.rank()} is not a member of the given group "
            f"(ranks {dist.get_process_group_ranks(pg)})"
        )
    return size, rank


def _norm_dim(dim: int, ndim: int, fn: str, name: str = "seq_dim") -> int:
    if not is_int(dim):
        raise TypeError(f"{fn}: {name} must be an int, got {type(dim).__name__} {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{fn}: {name}={dim} is out of range for a {ndim}-D tensor "
            f"(allowed {-ndim}..{ndim - 1})"
        )
    return dim % ndim


def _check_tensor(x: Any, fn: str, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _shard_len(length: int, dim: int, size: int, fn: str) -> int:
    if length % size:
        raise ValueError(
            f"{fn}: sequence length {length} along seq_dim {dim} is not divisible "
            f"by the context-parallel group size {size}"
        )
    return length // size


def _current_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _header_device(pg: Any) -> torch.device:
    """Device for small control tensors on ``pg``: CPU whenever the group has a CPU backend."""
    return group_device(pg, control=True)


# ---------------------------------------------------------------- split / gather


def split_inputs_cp(x: torch.Tensor, seq_dim: int, cp_group: GroupLike = None) -> torch.Tensor:
    """This rank's contiguous block of ``x`` along ``seq_dim`` (group rank r gets block r of n).

    ``None`` (or a one-rank group) returns ``x`` itself. Any memory layout is
    accepted; the result is contiguous in memory and may share storage with ``x``
    (no copy when the block already is contiguous). Raises ValueError when the
    length along ``seq_dim`` is not divisible by the group size.
    """
    if cp_group is None:
        return x
    fn = "split_inputs_cp"
    x = _check_tensor(x, fn)
    dim = _norm_dim(seq_dim, x.dim(), fn)
    size, rank = _size_and_rank(_device_group(cp_group), fn)
    if size == 1:
        return x
    shard = _shard_len(x.shape[dim], dim, size, fn)
    return x.narrow(dim, rank * shard, shard).contiguous()


def _gather(
    x: torch.Tensor, dim: int, pg: Any, size: int, fn: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """All-gather ``x`` into one (size*S, ...rest) buffer, viewed with ``dim`` back in place."""
    moved = x.detach().movedim(dim, 0).contiguous()
    full_shape = (size * moved.shape[0], *moved.shape[1:])
    if out is None:
        buf = torch.empty(full_shape, dtype=x.dtype, device=x.device)
    else:
        buf = out.movedim(dim, 0)
        if buf.shape != full_shape or out.dtype != x.dtype or out.device != x.device:
            want = (*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1 :])
            raise ValueError(
                f"{fn}: out is a {tuple(out.shape)} {out.dtype} tensor on {out.device}; "
                f"expected {want} {x.dtype} on {x.device}"
            )
        if not buf.is_contiguous():
            raise ValueError(
                f"{fn}: out must be laid out with seq_dim {dim} outermost (a previous result "
                f"of {fn}, or contiguous with every dim before seq_dim of size 1); "
                f"got strides {out.stride()}"
            )
    try:
        _all_gather_single(buf, moved, group=pg)
    except (RuntimeError, ValueError, TypeError) as e:
        raise RuntimeError(
            f"{fn}: all-gather of a {tuple(x.shape)} {x.dtype} shard on {x.device} along seq_dim "
            f"{dim} over a group of {size} ranks (global ranks "
            f"{dist.get_process_group_ranks(pg)}) failed: {e}"
        ) from e
    return buf.movedim(0, dim) if out is None else out


def cat_outputs_cp(
    x: torch.Tensor, seq_dim: int, cp_group: GroupLike = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Concatenate every rank's equal-shape shard ``x`` along ``seq_dim``, in group-rank order.

    One all-gather straight into the preallocated result (no per-rank buffers, no
    ``torch.cat``). The result is a view of that buffer with ``seq_dim`` in place:
    contiguous when every dimension before ``seq_dim`` has size 1 (e.g. batch 1),
    otherwise strided (call ``.contiguous()`` if a flat view is needed). ``out``
    (optional) is filled and returned instead of allocating: it must have the
    result's shape, dtype and device, laid out seq-dim-major (a previous result
    qualifies). No autograd: see :func:`cat_outputs_cp_with_grad`. A ``None`` group
    (or one rank) returns ``x`` itself, or ``x`` copied into ``out`` when given.
    Collective failures raise RuntimeError with the backend error as ``__cause__``.
    """
    fn = "cat_outputs_cp"
    if cp_group is None and out is None:
        return x
    x = _check_tensor(x, fn)
    dim = _norm_dim(seq_dim, x.dim(), fn)
    pg = None if cp_group is None else _device_group(cp_group)
    size = 1 if pg is None else _size_and_rank(pg, fn)[0]
    if size == 1:
        if out is None:
            return x
        if out.shape != x.shape:
            raise ValueError(f"{fn}: out has shape {tuple(out.shape)}; expected {tuple(x.shape)}")
        with torch.no_grad():
            return out.copy_(x)
    return _gather(x, dim, pg, size, fn, out)


class _GatherWithGrad(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: this rank's slice of the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, pg: Any, size: int, rank: int) -> torch.Tensor:
        ctx.dim, ctx.start, ctx.length = dim, rank * x.shape[dim], x.shape[dim]
        return _gather(x, dim, pg, size, "cat_outputs_cp_with_grad")

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None, None, None


def cat_outputs_cp_with_grad(
    x: torch.Tensor, seq_dim: int, cp_group: GroupLike = None
) -> torch.Tensor:
    """:func:`cat_outputs_cp` whose gradient flows back into this rank's shard ``x``.

    The other ranks' slots are constants here (each rank backpropagates its own
    slot), so ``x.grad`` is exactly this rank's slice of the result's gradient.
    ``None`` (or a one-rank group) returns ``x``.
    """
    if cp_group is None:
        return x
    fn = "cat_outputs_cp_with_grad"
    x = _check_tensor(x, fn)
    dim = _norm_dim(seq_dim, x.dim(), fn)
    pg = _device_group(cp_group)
    size, rank = _size_and_rank(pg, fn)
    if size == 1:
        return x
    return _GatherWithGrad.apply(x, dim, pg, size, rank)


# ---------------------------------------------------------------- broadcast


def _header_fields(kind: int, t: torch.Tensor | None) -> list[int]:
    fields = [kind, 0, 0, 0]
    if t is not None:
        fields = [
            kind,
            _DTYPE_INDEX[t.dtype],
            _DEVICE_TYPES.index(t.device.type),
            t.dim(),
            *t.shape,
        ]
    return fields + [0] * (_HEADER_LEN - len(fields))


def _source_fields(item: Any) -> list[int]:
    """The header the source sends for ``item``: a tensor's description, or "an object"."""
    if isinstance(item, torch.Tensor) and _tensor_sendable(item):
        return _header_fields(_KIND_TENSOR, item)
    return _header_fields(_KIND_OBJECT, None)


def _tensor_sendable(t: torch.Tensor) -> bool:
    return (
        t.layout == torch.strided
        and t.dim() <= _MAX_NDIM
        and t.device.type in _DEVICE_TYPES
        and t.dtype in _DTYPES
    )


def _decode_header(
    h: Sequence[int], fallback: torch.device
) -> tuple[int, torch.Size, torch.dtype, torch.device]:
    ndim = h[3]
    return (
        h[0],
        torch.Size(h[4 : 4 + ndim]),
        _DTYPES[h[1]],
        _current_device(_DEVICE_TYPES[h[2]]) if h[0] == _KIND_TENSOR else fallback,
    )


def _header_buffer(fields: list[int] | None, device: torch.device) -> torch.Tensor:
    if fields is None:
        return torch.empty(_HEADER_LEN, dtype=torch.int64, device=device)
    return torch.tensor(fields, dtype=torch.int64, device=device)


def _exchange_header(
    item: Any, is_src: bool, src: int, ctrl_pg: Any, fn: str
) -> tuple[int, torch.Size, torch.dtype, torch.device]:
    """Broadcast (kind, shape, dtype, device type) from ``src``; receivers learn what is coming."""
    device = _header_device(ctrl_pg)
    return _decode_header(
        _broadcast_header(_source_fields(item) if is_src else None, src, ctrl_pg, device, fn),
        device,
    )


def _broadcast_header(
    fields: list[int] | None, src: int, ctrl_pg: Any, device: torch.device, fn: str
) -> list[int]:
    header = _header_buffer(fields, device)
    try:
        dist.broadcast(header, src=src, group=ctrl_pg)
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(f"{fn}: header broadcast from global rank {src} failed: {e}") from e
    return header.tolist()


def _src_of(pg: Any) -> int:
    return min(dist.get_process_group_ranks(pg))


def broadcast(item: Any, process_group: GroupLike = None) -> Any:
    """Broadcast a tensor or any picklable object from the group's minimum global rank.

    Every member must call it; receivers may pass ``None`` (or a tensor to fill in
    place when its shape and dtype match). The source sends a small header first
    (kind, shape, dtype, device type), so receivers know what to receive:
    tensors arrive in a fresh buffer on the source's device type (the current
    device of that type on receivers); other objects go through
    ``broadcast_object_list`` on the group's CPU side. ``None`` group returns
    ``item``. Returns the broadcast value (the source gets ``item`` back).
    Raises ValueError on a receiver whose tensor does not match, after the
    collective completed on every rank.
    """
    if process_group is None:
        return item
    fn = "broadcast"
    data_pg, ctrl_pg = _device_group(process_group), _cpu_group(process_group)
    _size_and_rank(data_pg, fn)
    src = _src_of(data_pg)
    is_src = identity.rank() == src
    kind, shape, dtype, device = _exchange_header(item, is_src, src, ctrl_pg, fn)
    if kind == _KIND_OBJECT:
        return _broadcast_object(item, is_src, src, ctrl_pg, fn)
    if is_src:
        _send_tensor(item, f"{tuple(shape)} {dtype}", src, data_pg, fn)
        return item
    return _receive_tensor(item, shape, dtype, device, src, data_pg, fn)


def _broadcast_object(item: Any, is_src: bool, src: int, ctrl_pg: Any, fn: str) -> Any:
    """A picklable object from ``src`` over the group's CPU side."""
    holder = [item if is_src else None]
    try:
        dist.broadcast_object_list(holder, src=src, group=ctrl_pg)
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(f"{fn}: object broadcast from global rank {src} failed: {e}") from e
    return item if is_src else holder[0]


def _send_tensor(item: torch.Tensor, what: str, src: int, data_pg: Any, fn: str) -> None:
    """The source's side of a tensor broadcast (``what``: its shape and dtype, for errors)."""
    data = item.detach().contiguous()
    try:
        dist.broadcast(data, src=src, group=data_pg)
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            f"{fn}: broadcast of a {what} tensor from global rank {src} failed: {e}"
        ) from e


def _receive_tensor(
    item: Any,
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    src: int,
    data_pg: Any,
    fn: str,
) -> torch.Tensor:
    """A receiver's side: into ``item`` when it matches exactly, else a fresh buffer (copied
    into ``item`` after the collective, or ValueError when ``item`` does not match)."""
    given = item if isinstance(item, torch.Tensor) else None
    direct = (
        given is not None
        and given.shape == shape
        and given.dtype == dtype
        and given.device == device
        and given.is_contiguous()
    )
    buf = given if direct else torch.empty(shape, dtype=dtype, device=device)
    try:
        dist.broadcast(buf, src=src, group=data_pg)
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            f"{fn}: receiving a {tuple(shape)} {dtype} tensor from global rank {src} failed: {e}"
        ) from e
    if given is None or direct:
        return buf
    if given.shape != shape or given.dtype != dtype:
        raise ValueError(
            f"{fn}: item on global rank {identity.rank()} is a {tuple(given.shape)} "
            f"{given.dtype} tensor but the source sent {tuple(shape)} {dtype}; pass None "
            "(or a matching tensor) on receiving ranks"
        )
    with torch.no_grad():
        given.copy_(buf)
    return given


_BST_KEY = "context_parallel.broadcast_split_tensor"


def _last_headers() -> weakref.WeakKeyDictionary[Any, tuple[list[int], bool]]:
    """Per data group: the previous ``broadcast_split_tensor``'s header, and whether it repeated.

    It repeated when it equals the header of the call before it.

    Kept in the runtime's cache, so closing the runtime (``destroy_model_parallel``,
    on every rank) forgets it. Every member updates it identically (from headers
    all of them received), so all agree on whether the next call speculates.
    """
    cache = _rt.current().cache
    last = cache.get(_BST_KEY)
    if last is None:
        last = cache[_BST_KEY] = weakref.WeakKeyDictionary()
    return last


def broadcast_split_tensor(
    tensor: torch.Tensor | None, seq_dim: int, process_group: GroupLike = None
) -> torch.Tensor:
    """Send the minimum rank's ``tensor`` out as shards: group rank r gets block r of ``seq_dim``.

    Non-source ranks may pass ``None`` (their argument is ignored). A header
    carries the full shape, dtype and device type, and one ``scatter`` moves
    each rank only its own block, 1/n of the bytes a broadcast would. Returns a
    fresh contiguous shard on every rank (the same as
    ``split_inputs_cp(broadcast(tensor))``). ``None`` group returns ``tensor``.

    In steady state the header no longer delays the shards: once two calls in a
    row on a group carried the same header (shape, dtype, device type), the next
    call posts the header broadcast and a scatter of that shape together. If the
    source's tensor then differs, that scatter carries placeholder bytes (wasted
    once) and the call scatters again with the new header; speculation resumes
    once the new shape repeats. Every member must call with the same ``seq_dim``.

    Raises ValueError on every rank (after the header) when the length along
    ``seq_dim`` is not divisible by the group size or ``seq_dim`` is out of range,
    and TypeError when the source's ``tensor`` is not a sendable tensor.
    """
    if process_group is None:
        return tensor
    fn = "broadcast_split_tensor"
    pg, ctrl_pg = _device_group(process_group), _cpu_group(process_group)
    size, _ = _size_and_rank(pg, fn)
    src = _src_of(pg)
    is_src = identity.rank() == src
    if size == 1:
        _norm_dim(seq_dim, _check_tensor(tensor, fn, "tensor").dim(), fn)
        return tensor
    fields = _source_fields(tensor) if is_src else None
    header_device = _header_device(ctrl_pg)
    remembered = _last_headers()
    last = remembered.get(pg)
    try:
        if last is not None and last[1]:
            header, out = _speculative_scatter(
                tensor, fields, seq_dim, last[0], pg, ctrl_pg, header_device, size, src, fn
            )
            if out is not None:
                return out
        else:
            header = _broadcast_header(fields, src, ctrl_pg, header_device, fn)
        out = _scatter_split(tensor, header, seq_dim, pg, header_device, size, src, fn)
    except BaseException:
        remembered.pop(pg, None)
        raise
    remembered[pg] = (header, last is not None and last[0] == header)
    return out


def _pieces(tensor: torch.Tensor, dim: int, shard: int, size: int) -> list[torch.Tensor]:
    return [tensor.detach().narrow(dim, r * shard, shard).contiguous() for r in range(size)]


def _split_shape(
    shape: torch.Size, seq_dim: int, size: int, fn: str
) -> tuple[int, int, tuple[int, ...]]:
    """(dim, shard length, shard shape) of ``shape`` split along ``seq_dim`` over ``size`` ranks.

    Raises on bad input.
    """
    dim = _norm_dim(seq_dim, len(shape), fn)
    shard = _shard_len(shape[dim], dim, size, fn)
    return dim, shard, (*shape[:dim], shard, *shape[dim + 1 :])


def _scatter_split(
    tensor: torch.Tensor | None,
    header: list[int],
    seq_dim: int,
    pg: Any,
    header_device: torch.device,
    size: int,
    src: int,
    fn: str,
) -> torch.Tensor:
    """Scatter the source's blocks once every member knows ``header``; raise alike on bad input."""
    is_src = identity.rank() == src
    kind, shape, dtype, device = _decode_header(header, header_device)
    if kind != _KIND_TENSOR:
        got = f"{type(tensor).__name__}" if is_src else "a non-tensor"
        raise TypeError(
            f"{fn}: the source (global rank {src}) must pass a strided torch.Tensor with at most "
            f"{_MAX_NDIM} dims on one of {list(_DEVICE_TYPES)}; it passed {got}"
            + (f" (layout {tensor.layout})" if is_src and isinstance(tensor, torch.Tensor) else "")
        )
    dim, shard, out_shape = _split_shape(shape, seq_dim, size, fn)
    out = torch.empty(out_shape, dtype=dtype, device=tensor.device if is_src else device)
    try:
        dist.scatter(out, _pieces(tensor, dim, shard, size) if is_src else None, src=src, group=pg)
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            f"{fn}: scatter of a {tuple(shape)} {dtype} tensor along seq_dim {dim} from "
            f"global rank {src} failed: {e}"
        ) from e
    return out


def _speculative_scatter(
    tensor: torch.Tensor | None,
    fields: list[int] | None,
    seq_dim: int,
    expected: list[int],
    pg: Any,
    ctrl_pg: Any,
    header_device: torch.device,
    size: int,
    src: int,
    fn: str,
) -> tuple[list[int], torch.Tensor | None]:
    """Post the header broadcast and a scatter shaped by ``expected`` together.

    Returns the header received and, when it equals ``expected``, the shard (else
    ``None``: the scatter moved placeholder bytes of the expected size, and the
    caller scatters again with the real header). The scatter is flat (numel / n
    elements, the same for every ``seq_dim``), so every member posts the same
    sizes whatever ``seq_dim`` it passed; ``seq_dim`` is checked afterwards, on
    every rank alike, so a bad one raises everywhere instead of stranding peers.
    """
    is_src = fields is not None
    _, shape, dtype, device = _decode_header(expected, header_device)
    numel = math.prod(shape) // size
    pieces = None
    if is_src and fields == expected:
        try:
            dim, shard, _ = _split_shape(shape, seq_dim, size, fn)
        except (TypeError, ValueError):
            pass  # placeholders go out; every rank raises the same error once the header is in
        else:
            device = tensor.device
            pieces = [p.view(-1) for p in _pieces(tensor, dim, shard, size)]
    if is_src and pieces is None:
        pieces = [torch.empty(numel, dtype=dtype, device=device)] * size
    header_buf = _header_buffer(fields, header_device)
    out = torch.empty(numel, dtype=dtype, device=device)
    try:
        header_work = dist.broadcast(header_buf, src=src, group=ctrl_pg, async_op=True)
        data_work = dist.scatter(out, pieces, src=src, group=pg, async_op=True)
        header_work.wait()
        data_work.wait()
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            f"{fn}: header broadcast and scatter of a {tuple(shape)} {dtype} tensor from "
            f"global rank {src} failed: {e}"
        ) from e
    header = header_buf.tolist()
    if header != expected:
        return header, None
    return header, out.view(_split_shape(shape, seq_dim, size, fn)[2])


# ---------------------------------------------------------------- find_split


def _as_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not is_int(value) or value < minimum:
        raise ValueError(f"find_split: {name} must be an integer >= {minimum}, got {value!r}")
    return value


class CPSplit(NamedTuple):
    """What :func:`find_split_plan` chose: the per-rank block and how the CP ranks were spread.

    ``cp_size_t * cp_size_h`` is the CP size; W is never split.
    """

    block: torch.Size
    """Per-rank latent block ``(T', H', W)``, per view."""
    cp_size_t: int
    """CP ranks along time (T)."""
    cp_size_h: int
    """CP ranks along height (H)."""


def find_split_plan(
    shape_tensor: Sequence[int] | torch.Size | torch.Tensor,
    cp_size: int,
    patch_values: Sequence[int] = (1, 2, 2),
    view_factor: int = 1,
) -> CPSplit:
    """:func:`find_split`'s decision as a value, ``CPSplit(block, cp_size_t, cp_size_h)``.

    It records nothing.

    Same rules and the same ValueErrors as :func:`find_split`.
    """
    if isinstance(shape_tensor, torch.Tensor):
        shape_list = shape_tensor.reshape(-1).tolist() if shape_tensor.dim() <= 1 else None
    else:
        shape_list = list(shape_tensor) if isinstance(shape_tensor, Sequence) else None
    if shape_list is None or len(shape_list) != 5:
        raise ValueError(
            f"find_split: shape_tensor must be the 5 sizes (B, C, T, H, W) of a latent, "
            f"got {shape_tensor!r}"
        )
    b, c, t, h, w = (
        _as_int(v, f"shape_tensor[{i}] ({n})") for i, (v, n) in enumerate(zip(shape_list, "BCTHW"))
    )
    cp = _as_int(cp_size, "cp_size")
    view = _as_int(view_factor, "view_factor")
    patches = list(patch_values) if isinstance(patch_values, Sequence) else None
    if patches is None or len(patches) != 3:
        raise ValueError(
            f"find_split: patch_values must be 3 patch sizes (T, H, W), got {patch_values!r}"
        )
    pt, ph, pw = (_as_int(p, f"patch_values[{i}]") for i, p in enumerate(patches))
    if t % view:
        raise ValueError(f"find_split: T={t} is not divisible by view_factor={view}")
    t //= view
    for axis, size, patch in (("T (per view)", t, pt), ("H", h, ph), ("W", w, pw)):
        if size % patch:
            raise ValueError(
                f"find_split: {axis}={size} is not a multiple of its patch size {patch} "
                f"(shape {tuple(shape_list)}, patch_values {tuple(patches)}); "
                "the remainder tokens would be dropped"
            )
    g_t = math.gcd(t // pt, cp)
    remaining = cp // g_t
    g_h = math.gcd(h // ph, remaining)
    remaining //= g_h
    if remaining != 1:
        raise ValueError(
            f"find_split: cp_size={cp} cannot be absorbed by T={t} (per view) and H={h} "
            "on patch boundaries "
            f"(patches {pt}x{ph}: {t // pt} x {h // ph} patches; {g_t} rank(s) to T, {g_h} to H, "
            f"{remaining} left over, and W is never split)"
        )
    return CPSplit(torch.Size([t // g_t, h // g_h, w]), g_t, g_h)


def find_split(
    shape_tensor: Sequence[int] | torch.Size | torch.Tensor,
    cp_size: int,
    patch_values: Sequence[int] = (1, 2, 2),
    view_factor: int = 1,
) -> torch.Size:
    """Each rank's block ``torch.Size([T', H', W])`` of a (B, C, T, H, W) latent over ``cp_size``.

    The flattened T*H*W token sequence is cut on patch boundaries: T is first
    divided by ``view_factor`` (views are processed separately), then for T and
    then H, ``g = gcd(size // patch, remaining_cp)`` ranks go to that axis,
    ``size //= g`` and ``remaining_cp //= g``. W is never split. Sizes are in
    latent units (not patches), per view, so ``T' * H' * W * cp_size ==
    T * H * W / view_factor``.

    The contract returns a plain ``torch.Size`` (which cannot carry attributes:
    torch does not allow subclassing it), and position embeddings that never see
    the return value need to know how many CP ranks went to time to rebuild the
    global grid. So the ranks given to time (``g`` of T) are also recorded in the
    runtime, read by ``groups.get_cp_size_t()``; the record is reset to ``None``
    at the start of every call (and by ``destroy_model_parallel``, which closes
    the runtime), so a failed call leaves no stale value. Callers that want the
    whole decision as a value use :func:`find_split_plan`
    (``CPSplit(block, cp_size_t, cp_size_h)``).

    Raises ValueError for: a shape that is not 5-D or has a size < 1; ``cp_size``,
    a patch value or ``view_factor`` < 1; T not divisible by ``view_factor``; T/view,
    H or W not a multiple of its patch (tokens would be dropped); ranks left over
    after H.
    """
    rt = _rt.current()
    rt.cp_size_t = None
    plan = find_split_plan(shape_tensor, cp_size, patch_values, view_factor)
    rt.cp_size_t = plan.cp_size_t
    return plan.block
