"""Reading a checkpoint as data: nothing in its files can make the reader run code.

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load`` and loads every
non-tensor item of a ``.distcp`` file with ``torch.load(weights_only=False)``: a planted
``__reduce__`` in either runs as the job. Here:

- :func:`read_metadata` unpickles ``.metadata`` with :class:`MetadataUnpickler`, which
  admits DCP's metadata classes, torch dtypes / sizes / layouts, paths and plain
  containers, and refuses any other global with :class:`CheckpointRefused` naming the file
  and the global, before anything of it is built;
- :class:`SafeReader` is DCP's ``FileSystemReader`` handing out that metadata;
- :class:`SafeLoadPlanner` checks every non-tensor item with ``torch.load(weights_only=True)``
  (tensors and plain values only) before DCP decodes it; a refused item names its key.

Tensors are read by DCP with ``weights_only=True`` already; per-rank files likewise.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from worldfoundry.core.torch_private import DCP_METADATA_PRIVATE

from ...rundir.checkpoints import METADATA_FILE, CheckpointUnreadable
from ...rundir.io import UnreadableFile, read_bytes
from .metadata_check import (
    MAX_METADATA_BYTES,
    CheckpointRefused,
    check_shape,
    checked_path_class,
    scan_pickle,
)

__all__ = [
    "ADMITTED",
    "CheckpointRefused",
    "MetadataUnpickler",
    "SafeLoadPlanner",
    "SafeReader",
    "read_metadata",
]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ADMITTED: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            (_DCP_METADATA, n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
            )
        ),
        ("torch", "Size"),
        *(("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
        ("collections", "OrderedDict"),
        *(("builtins", n) for n in ("set", "frozenset", "slice", "complex")),
        *DCP_METADATA_PRIVATE,
    }
)
"""The globals a ``.metadata`` pickle may name (besides torch dtypes, admitted by type)."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only :data:`ADMITTED` globals and torch dtypes; anything else is
    refused."""

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ADMITTED and module == "pathlib":
            return checked_path_class(super().find_class(module, name), self.source)
        if (module, name) in ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointRefused(
            f"{self.source}: refused to unpickle {module}.{name}: a checkpoint's metadata may "
            "name only DCP's "
            "metadata classes, torch dtypes / sizes / layouts and plain containers (a checkpoint "
            "is data, not "
            "code); this file was not written by torch.distributed.checkpoint, or was tampered with"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointRefused(f"{self.source}: refused a persistent id in checkpoint metadata")


def read_metadata(directory: Path) -> Any:
    """The DCP ``Metadata`` of a checkpoint directory, through :class:`MetadataUnpickler`.

    Scanned before it is built and checked after (:mod:`.metadata_check`).
    :class:`CheckpointRefused` for a forbidden global, slot state or a read outside the
    directory; :class:`CheckpointUnreadable` for a missing, torn, oversized or malformed file.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / METADATA_FILE
    try:
        data = read_bytes(path, MAX_METADATA_BYTES)
    except (OSError, UnreadableFile) as exc:
        raise CheckpointUnreadable(f"{path}: {exc}") from None
    scan_pickle(data, path)
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), path).load()
    except (CheckpointRefused, CheckpointUnreadable):
        raise
    except Exception as exc:  # torn or foreign data: any decoding error means "unreadable"
        raise CheckpointUnreadable(f"{path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointUnreadable(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    check_shape(metadata, Path(directory), path)
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` through :func:`read_metadata` (once)."""

    def __init__(self, directory: Path, metadata: Any = None) -> None:
        super().__init__(str(directory))
        self._directory = Path(directory)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self._metadata is None:
            self._metadata = read_metadata(self._directory)
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; a non-tensor item must load with ``weights_only=True`` before DCP
    decodes it."""

    def __init__(self, source: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source = source
        self.refused: str | None = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        except pickle.UnpicklingError as exc:
            lines = str(exc).splitlines()
            why = next(
                (
                    line.strip()
                    for line in lines
                    if "Unsupported" in line or "WeightsUnpickler" in line
                ),
                lines[0] if lines else "",
            )
            self.refused = (
                f"{self.source}: item {read_item.dest_index.fqn!r} is not plain data (refused to "
                f"unpickle it: {why}); a checkpoint is data, not code"
            )
            raise CheckpointRefused(self.refused) from None
        value.seek(0)
        super().load_bytes(read_item, value)
