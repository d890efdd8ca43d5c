"""A checkpoint's ``.metadata`` checked before and after it is unpickled (issue 29, items 4-6).

The restricted unpickler of :mod:`.safe_read` admits only DCP's classes, but allowed
globals are still enough for resource and state attacks, and the metadata says where
every byte is read from. So, before anything is built, :func:`scan_pickle` walks the
opcodes: at most :data:`MAX_OPS` of them, a stack at most :data:`MAX_STACK` deep, marks
nested at most :data:`MAX_MARKS` deep, and no ``BUILD`` on a class (slot state on a class
sets its attributes for the whole process). A path
object is built only from strings, at most :data:`MAX_PATH_CHARS` long. After, the
result must have DCP's shape (:func:`check_shape`): every storage item names a regular
file directly in the step directory (no ``/``, no link), with its offset and length
inside the file; every tensor's size is non-negative and no bigger than the data the
directory holds; every chunk lies inside its tensor.

A shape that is wrong raises :class:`~.format.CheckpointUnreadable` (the load falls
back to the previous checkpoint); a read aimed outside the step directory raises
:class:`CheckpointRefused`.
"""

from __future__ import annotations

import math
import os
import pickletools
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...rundir.checkpoints import CheckpointUnreadable

__all__ = [
    "MAX_MARKS",
    "MAX_METADATA_BYTES",
    "MAX_OPS",
    "MAX_PATH_CHARS",
    "MAX_STACK",
    "CheckpointRefused",
    "check_shape",
    "checked_path_class",
    "scan_pickle",
]

MAX_METADATA_BYTES = 256 << 20
"""The largest ``.metadata`` read (256 MiB; a model of 10k tensors on 1k ranks needs a few)."""
MAX_OPS = 20_000_000
MAX_STACK = 100_000
MAX_MARKS = 64
MAX_PATH_CHARS = 4096
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}


class CheckpointRefused(RuntimeError):
    """A checkpoint holds something a checkpoint must not (code to run, a read outside its
    directory, or a state the layout cannot serve)."""


_CLASS, _VALUE = True, False
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_GLOBALS = {"GLOBAL", "STACK_GLOBAL", "INST"}


class _Scan:
    """A walk of a pickle's opcodes that tracks which stack slots hold a class (from a
    global or the memo), so that a BUILD on a class is refused before anything is built."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.stack: list[bool] = []
        self.marks: list[int] = []
        self.memo: dict[int, bool] = {}

    def step(self, op: Any, arg: Any, pos: int) -> None:
        before, after, stack = op.stack_before, op.stack_after, self.stack
        if op.name == "BUILD" and len(stack) >= 2 and stack[-2] is _CLASS:
            raise CheckpointRefused(
                f"{self.source}: refused a BUILD on a class at byte {pos} (it would change "
                "the class for the whole process; a checkpoint's metadata never does)"
            )
        if op.name in _MEMO_PUTS:
            self.memo[len(self.memo) if op.name == "MEMOIZE" else arg] = stack[-1]
            return
        if op.name == "MARK":
            self.marks.append(len(stack))
            return
        if pickletools.markobject in before:
            keep = self.marks.pop() - _mark_index(before)
            del stack[max(keep, 0) :]
        else:
            del stack[len(stack) - len(before) :]
        if op.name in _GETS:
            stack.append(self.memo[arg])
        else:
            stack.extend([op.name in _GLOBALS and op.name != "INST"] * len(after))


def _mark_index(before: list[Any]) -> int:
    return next(i for i, s in enumerate(before) if s is pickletools.markobject)


def scan_pickle(data: bytes, source: Path) -> None:
    """:class:`CheckpointUnreadable` when the pickle ``data`` is too big to build, too deep or
    malformed; :class:`CheckpointRefused` when it would set state on a class."""
    scan = _Scan(source)
    try:
        for ops, (op, arg, pos) in enumerate(pickletools.genops(data)):
            scan.step(op, arg, pos)
            if ops > MAX_OPS or len(scan.stack) > MAX_STACK or len(scan.marks) > MAX_MARKS:
                raise CheckpointUnreadable(
                    f"{source}: more than {MAX_OPS} objects, or nested deeper than "
                    f"{MAX_STACK} (marks {MAX_MARKS}), at byte {pos}: not DCP metadata"
                )
    except (ValueError, IndexError, KeyError) as exc:
        raise CheckpointUnreadable(f"{source}: not a pickle ({exc!r})") from None


def checked_path_class(cls: type, source: Path) -> Callable[..., Any]:
    """``cls`` (a pathlib class) built from strings only, at most :data:`MAX_PATH_CHARS` in all:
    nested path objects are how a small pickle grows to gigabytes."""

    def build(*parts: Any) -> Any:
        if not all(type(p) is str for p in parts) or sum(map(len, parts)) > MAX_PATH_CHARS:
            raise CheckpointUnreadable(
                f"{source}: a {cls.__name__} of other than strings, or longer than "
                f"{MAX_PATH_CHARS} characters"
            )
        return cls(*parts)

    return build


def _bad(source: Path, what: str, value: Any) -> CheckpointUnreadable:
    shown = repr(value)
    return CheckpointUnreadable(
        f"{source}: {what} = {shown[:80]}{'...' if len(shown) > 80 else ''} is not allowed"
    )


def _sizes(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(type(n) is int and n >= 0 for n in value)


def _check_item(directory: Path, source: Path, info: Any, sizes: dict[str, int]) -> int:
    """The byte length of one storage item, after checking where it is read from."""
    name = getattr(info, "relative_path", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise CheckpointRefused(
            f"{source}: a storage item reads {name!r}: only files directly in {directory} "
            "may be read (a checkpoint's items never point elsewhere)"
        )
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise _bad(source, f"item of {name} offset/length", (offset, length))
    if name not in sizes:
        try:
            info_st = os.lstat(directory / name)
        except OSError as exc:
            raise CheckpointUnreadable(f"{source}: item file {name}: {exc.strerror}") from None
        if not stat.S_ISREG(info_st.st_mode):
            raise CheckpointRefused(
                f"{source}: item file {name} is not a regular file (a link, a FIFO or a "
                "device: refusing to read it)"
            )
        sizes[name] = info_st.st_size
    if offset + length > sizes[name]:
        raise _bad(source, f"item of {name} (file of {sizes[name]} bytes) offset+length", offset)
    return length


def _check_tensor(source: Path, key: str, md: Any, data_bytes: int) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype) or not _sizes(md.size):
        raise _bad(source, f"{key}: dtype/size", (dtype, getattr(md, "size", None)))
    nbytes = math.prod(md.size) * dtype.itemsize
    if nbytes > data_bytes:
        raise _bad(source, f"{key}: size ({nbytes} bytes, more than the files hold)", md.size)
    chunks = getattr(md, "chunks", None)
    if not isinstance(chunks, list):
        raise _bad(source, f"{key}: chunks", chunks)
    for chunk in chunks:
        ok = (
            isinstance(chunk, ChunkStorageMetadata)
            and _sizes(chunk.offsets)
            and _sizes(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(md.size)
            and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, md.size))
        )
        if not ok:
            raise _bad(source, f"{key}: a chunk", chunk)


def check_shape(metadata: Any, directory: Path, source: Path) -> None:
    """:class:`CheckpointUnreadable` (or :class:`CheckpointRefused` for a read outside
    ``directory``) unless ``metadata`` has DCP's shape and reads only inside ``directory``."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    storage, items = metadata.storage_data, metadata.state_dict_metadata
    if not isinstance(storage, dict) or not isinstance(items, dict):
        raise _bad(source, "storage_data/state_dict_metadata", (type(storage), type(items)))
    sizes: dict[str, int] = {}
    data_bytes = 0
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise _bad(source, "a storage index", index)
        data_bytes += _check_item(directory, source, info, sizes)
    for key, md in items.items():
        if not isinstance(key, str):
            raise _bad(source, "a state dict key", key)
        if isinstance(md, TensorStorageMetadata):
            _check_tensor(source, key, md, data_bytes)
        elif not isinstance(md, BytesStorageMetadata):
            raise _bad(source, f"{key}: item metadata", type(md).__name__)
