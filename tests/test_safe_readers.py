"""One reader for every file of a run, sweep, tune or drill directory (issue 29, item 8).

``wf_launch/rundir/io.py`` reads regular files only, with a size cap, and YAML without
aliases. These tests hold that it is the only reader: no other module of ``wf_launch``
calls ``read_text``/``read_bytes``, ``yaml.load``/``safe_load``, ``json.load`` or
``pickle.load``, or opens a file for reading other than through ``open_regular`` (or a
``/proc`` file of the kernel's); and that the reader refuses what hung the tools before.
"""

from __future__ import annotations

import ast
import os
import threading
from pathlib import Path

import pytest

import wf_launch
from wf_launch.rundir.io import UnreadableFile, read_json, read_lines, read_text, read_yaml

PACKAGE = Path(wf_launch.__file__).parent
READER = PACKAGE / "rundir" / "io.py"
ALLOWED = {
    ("rank/fresh_entry.py", "pickle.load"): "the launcher's own spec, in a private temp file",
    ("rank/fresh_entry.py", "open"): "the same spec",
}
FORBIDDEN_CALLS = {"read_text", "read_bytes", "safe_load", "load", "full_load", "unsafe_load"}
FORBIDDEN_MODULES = {"yaml", "json", "pickle"}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return "?"


def _from_open_regular(func: ast.AST, name: str) -> bool:
    """Whether ``name`` is assigned from ``open_regular(...)`` in the function ``func``."""
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and _name(node.value.func).endswith("open_regular")
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        ):
            return True
    return False


def _reads(call: ast.Call) -> bool:
    """Whether a builtin ``open(...)`` call opens for reading."""
    mode = call.args[1] if len(call.args) > 1 else None
    mode = next((k.value for k in call.keywords if k.arg == "mode"), mode)
    text = mode.value if isinstance(mode, ast.Constant) else "r"
    return not any(c in str(text) for c in "wax")


def _safe_open(call: ast.Call, func: ast.AST | None) -> bool:
    first = call.args[0] if call.args else None
    if isinstance(first, ast.Call) and _name(first.func).endswith("open_regular"):
        return True
    if isinstance(first, ast.Name) and func is not None and _from_open_regular(func, first.id):
        return True
    head = first.values[0] if isinstance(first, ast.JoinedStr) and first.values else first
    return isinstance(head, ast.Constant) and str(head.value).startswith("/proc/")


def _offenders(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PACKAGE).as_posix()
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        func = node
        while func in parents and not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            func = parents[func]
        bad = (
            isinstance(node.func, ast.Attribute)
            and node.func.attr in FORBIDDEN_CALLS
            and (node.func.attr.startswith("read_") or _name(node.func.value) in FORBIDDEN_MODULES)
        ) or (name == "open" and _reads(node) and not _safe_open(node, func))
        if bad and (rel, name) not in ALLOWED:
            found.append((node.lineno, node.col_offset, f"{rel}:{node.lineno}: {name}(...)"))
    return [line for *_, line in sorted(found)]


def test_no_module_but_the_safe_reader_reads_a_file() -> None:
    offenders = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != READER
        for line in _offenders(path)
    ]
    assert offenders == [], "read through wf_launch.rundir.io instead:\n" + "\n".join(offenders)


def test_the_scan_finds_a_reader(tmp_path: Path) -> None:
    """The scan is not blind: each way of reading it forbids is found."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import json, yaml\n"
        "def f(p):\n"
        "    p.read_text()\n"
        "    yaml.safe_load(open(p))\n"
        "    json.load(open(p, 'rb'))\n"
        "    open(p, 'w')\n"
        "    fd = open_regular(p)\n"
        "    open(fd, 'rb')\n"
        "    open(f'/proc/{p}/stat')\n"
    )
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        found = _offenders(sample)
    finally:
        PACKAGE = saved
    assert [line.split(": ")[1] for line in found] == [
        "p.read_text(...)",
        "yaml.safe_load(...)",
        "open(...)",
        "json.load(...)",
        "open(...)",
    ]


def _with_writer(fifo: Path) -> threading.Thread:
    """A writer that never writes: a blocking read of the FIFO would wait for ever."""
    stop = threading.Event()

    def hold() -> None:
        fd = os.open(fifo, os.O_RDWR)
        stop.wait(5)
        os.close(fd)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    thread.stop = stop  # type: ignore[attr-defined]
    return thread


@pytest.mark.parametrize("reader", [read_yaml, read_json, read_text, lambda p: list(read_lines(p))])
def test_the_reader_refuses_fifos_devices_and_bombs(tmp_path: Path, reader) -> None:
    fifo = tmp_path / "multirun.yaml"
    os.mkfifo(fifo)
    holder = _with_writer(fifo)
    with pytest.raises(UnreadableFile, match="not a regular file"):
        reader(fifo)
    holder.stop.set()  # type: ignore[attr-defined]
    zero = tmp_path / "run_id"
    zero.symlink_to("/dev/zero")
    with pytest.raises(UnreadableFile, match="not a regular file"):
        reader(zero)


def test_yaml_aliases_are_refused(tmp_path: Path) -> None:
    bomb = tmp_path / "overrides.yaml"
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        lines.append(
            f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [" + ",".join([f"*{prev}"] * 9) + "]"
        )
    bomb.write_text("\n".join(lines) + "\n")
    assert bomb.stat().st_size < 1024
    with pytest.raises(UnreadableFile, match="alias"):
        read_yaml(bomb)
    (tmp_path / "plain.yaml").write_text("- task=train\n- engine.dp_size=2\n")
    assert read_yaml(tmp_path / "plain.yaml") == ["task=train", "engine.dp_size=2"]
