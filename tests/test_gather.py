"""gather_bytes and gather_state_dicts on real gloo groups."""

from __future__ import annotations

import pickle

import pytest
import torch
from multirank import run_ranks

from worldfoundry.core.distributed.gather import gather_bytes, gather_state_dicts


def _payload(rank: int) -> bytes:
    """Different lengths per rank (rank 2 sends nothing), not multiples of the chunk."""
    return bytes((rank * 31 + i) % 256 for i in range(0 if rank == 2 else 1000 * rank + 37))


class _Exploding:
    """Unpickling this would run code: gathering must never unpickle what peers send."""

    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled!')",))


def _gather_bytes(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out: dict = {}
    out["chunked"] = gather_bytes(_payload(rank), dst=1, chunk_bytes=64)
    out["whole"] = gather_bytes(_payload(rank), dst=0)
    out["pickled"] = gather_bytes(pickle.dumps(_Exploding()), dst=0)
    pair = dist.new_group([1, 3])
    out["pair"] = gather_bytes(b"x" * rank, dst=3, group=pair) if rank in (1, 3) else "not a member"
    try:
        gather_bytes(b"", dst=2, group=pair) if rank in (1, 3) else None
    except ValueError as e:
        out["dst_outside"] = str(e)
    return out


@pytest.mark.slow
def test_gather_bytes_to_dst_only_in_chunks() -> None:
    results = run_ranks(_gather_bytes, 4)
    expected = [bytearray(_payload(r)) for r in range(4)]
    for r, res in enumerate(results):
        assert res["chunked"] == (expected if r == 1 else None)
        assert res["whole"] == (expected if r == 0 else None)
        if r == 0:
            assert all(isinstance(b, bytearray) for b in res["whole"])
            # raw bytes come back; nothing was unpickled on the way
            assert res["pickled"] == [bytearray(pickle.dumps(_Exploding()))] * 4
    assert results[3]["pair"] == [bytearray(b"x"), bytearray(b"xxx")]
    assert results[1]["pair"] is None
    assert (
        "rank 1 passed dst=2, which is not a rank of the group; allowed: [1, 3]"
        in results[1]["dst_outside"]
    )


def test_gather_bytes_single_process_and_bad_input() -> None:
    assert gather_bytes(b"abc", dst=0) == [bytearray(b"abc")]
    with pytest.raises(TypeError, match="data must be bytes"):
        gather_bytes("abc", dst=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"chunk_bytes=0; chunk_bytes must be a positive int"):
        gather_bytes(b"abc", dst=0, chunk_bytes=0)
    with pytest.raises(ValueError, match=r"dst=1 is outside a single process's run"):
        gather_bytes(b"abc", dst=1)


class _NotATensor:
    def __init__(self, value: int) -> None:
        self.value = value


def _state_dicts(rank: int, world: int) -> dict:
    out: dict = {}
    state = {
        "w": torch.full((2, 3), float(rank)),
        "step": torch.tensor(rank),
        "meta": {"name": f"r{rank}"},
    }
    got = gather_state_dicts(state, dst=2)
    # tensors do not cross the harness's queue once a rank has exited: send lists back
    out["dicts"] = [
        {"w": d["w"].tolist(), "step": int(d["step"]), "meta": d["meta"], "cpu": d["w"].device.type}
        for d in got
    ]
    bad = {"w": torch.zeros(1), "obj": _NotATensor(rank)}
    it = gather_state_dicts(bad, dst=0)  # every rank joins; only dst loads
    try:
        out["bad"] = list(it)
    except pickle.UnpicklingError as e:
        out["bad"] = f"UnpicklingError: {e}"
    unserializable = {"f": (lambda: 0)} if rank == 1 else {"w": torch.zeros(1)}
    try:
        gather_state_dicts(unserializable, dst=0)
    except RuntimeError as e:
        out["unserializable"] = str(e)
    return out


@pytest.mark.slow
def test_gather_state_dicts_weights_only() -> None:
    results = run_ranks(_state_dicts, 3)
    dicts = results[2]["dicts"]
    assert [d["meta"]["name"] for d in dicts] == ["r0", "r1", "r2"]
    for r, d in enumerate(dicts):
        assert d == {"w": [[float(r)] * 3] * 2, "step": r, "meta": {"name": f"r{r}"}, "cpu": "cpu"}
    assert results[0]["dicts"] == [] and results[1]["dicts"] == []
    # a non-tensor object is refused by weights_only on dst, naming the rank
    assert results[0]["bad"].startswith(
        "UnpicklingError: gather_state_dicts: rank 0's state does not load"
    )
    assert "weights_only" in results[0]["bad"]
    assert results[1]["bad"] == [] and results[2]["bad"] == []
    # a state that does not serialize on one rank fails every rank instead of hanging
    for r in range(3):
        assert (
            "gather_state_dicts: rank 1's state does not serialize" in results[r]["unserializable"]
        )
        assert ("rank 1 failed before the gather" in results[r]["unserializable"]) == (r != 1)


def test_gather_state_dicts_single_process() -> None:
    [d] = list(gather_state_dicts({"w": torch.ones(2)}, dst=0))
    assert torch.equal(d["w"], torch.ones(2))
    with pytest.raises(TypeError, match="state must be a dict"):
        gather_state_dicts([torch.ones(1)], dst=0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- a bad argument on one
# rank


def _caught(fn, *args, **kwargs) -> tuple[str, object]:
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as e:
        return (type(e).__name__, str(e))


def _bad_arguments(rank: int, world: int) -> dict:
    import time

    out: dict = {}
    start = time.monotonic()
    out["data"] = _caught(gather_bytes, "text" if rank == 1 else b"ok", dst=0)
    out["dst"] = _caught(gather_bytes, b"ok", dst=7 if rank == 2 else 0)
    out["dst_type"] = _caught(gather_bytes, b"ok", dst="0" if rank == 0 else 0)
    out["chunk"] = _caught(gather_bytes, b"ok", dst=0, chunk_bytes=0 if rank == 1 else 64)
    out["differ"] = _caught(gather_bytes, b"ok", dst=1 if rank == 1 else 0)
    out["chunk_differ"] = _caught(gather_bytes, b"ok", dst=0, chunk_bytes=64 + rank)
    out["state"] = _caught(gather_state_dicts, [1] if rank == 2 else {"w": torch.zeros(1)}, dst=0)
    out["state_dst"] = _caught(
        gather_state_dicts, {"w": torch.zeros(1)}, dst=True if rank == 1 else 0
    )
    out["seconds"] = time.monotonic() - start
    for _ in gather_state_dicts({"w": torch.zeros(1000)}, dst=0):
        break  # dst leaves early: the dropped iterator still takes what the senders send
    # the group is still in step: a good gather works afterwards
    out["after"] = gather_bytes(bytes([rank]), dst=0)
    return out


@pytest.mark.slow
def test_a_bad_argument_on_one_rank_fails_every_rank_promptly() -> None:
    results = run_ranks(_bad_arguments, 3, timeout=45)
    for r, res in enumerate(results):
        assert res["seconds"] < 15
        kind, msg = res["data"]
        assert kind == "TypeError" and "rank 1 passed data of type str" in msg
        kind, msg = res["dst"]
        assert kind == "ValueError" and "rank 2 passed dst=7" in msg and "allowed: [0, 1, 2]" in msg
        kind, msg = res["dst_type"]
        assert kind == "TypeError" and "rank 0 passed dst='0'" in msg
        kind, msg = res["chunk"]
        assert kind == "ValueError" and "rank 1 passed chunk_bytes=0" in msg
        kind, msg = res["differ"]
        assert kind == "ValueError" and "different dst" in msg and "rank 1: dst=1" in msg
        kind, msg = res["chunk_differ"]
        assert kind == "ValueError" and "different chunk_bytes" in msg
        kind, msg = res["state"]
        assert kind == "TypeError" and "rank 2 passed a state of type list" in msg
        kind, msg = res["state_dst"]
        assert kind == "TypeError" and "rank 1 passed dst=True" in msg
        if r != 1:  # peers say why they raise too
            assert "rank 1 failed before the gather" in res["data"][1]
        assert res["after"] == (
            [bytearray([0]), bytearray([1]), bytearray([2])] if r == 0 else None
        )


# --------------------------------------------------------------------------- dst memory


def _rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


_MB = 1024 * 1024


def _memory(rank: int, world: int, per_rank_mb: int) -> dict:
    import ctypes
    import gc

    # fixed mmap threshold: freed blocks go back to the OS, so peak RSS measures what is held
    ctypes.CDLL("libc.so.6").mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD
    n = per_rank_mb * _MB // 8 // 4
    state = {f"t{i}": torch.full((n,), float(rank + i)) for i in range(8)}
    dict_bytes = sum(t.numel() * t.element_size() for t in state.values())
    gc.collect()
    base = _rss("VmRSS")
    _rss_peak_reset()
    seen = []
    for d in gather_state_dicts(state, dst=0):
        seen.append((float(d["t0"][0]), float(d["t7"][-1])))
        del d
    peak = _rss("VmHWM") - base
    return {"dict_bytes": dict_bytes, "peak": peak, "seen": seen}


@pytest.mark.slow
def test_gather_state_dicts_holds_one_rank_at_a_time_on_dst() -> None:
    try:
        _rss_peak_reset()
    except OSError:
        pytest.skip("needs /proc/self/clear_refs to reset the peak RSS")
    results = run_ranks(_memory, 4, 32, timeout=120)
    res = results[0]
    assert res["seen"] == [(float(r), float(r + 7)) for r in range(4)]
    assert all(r["seen"] == [] for r in results[1:])
    ratio = res["peak"] / res["dict_bytes"]
    assert ratio <= 2.5, f"dst peaked at {ratio:.2f}x one rank's dict ({res['peak'] / _MB:.0f} MiB)"
