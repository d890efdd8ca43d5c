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
    assert "dst=2 is not a rank of the group; allowed: [1, 3]" in results[1]["dst_outside"]


def test_gather_bytes_single_process_and_bad_input() -> None:
    assert gather_bytes(b"abc", dst=0) == [bytearray(b"abc")]
    with pytest.raises(TypeError, match="data must be bytes"):
        gather_bytes("abc", dst=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"chunk_bytes=0 must be a positive int"):
        gather_bytes(b"abc", dst=0, chunk_bytes=0)
    with pytest.raises(ValueError, match=r"dst=1 is outside a single process's run"):
        gather_bytes(b"abc", dst=1)


class _NotATensor:
    def __init__(self, value: int) -> None:
        self.value = value


def _state_dicts(rank: int, world: int) -> dict:
    out: dict = {}
    state = {"w": torch.full((2, 3), float(rank)), "step": torch.tensor(rank), "meta": {"name": f"r{rank}"}}
    got = gather_state_dicts(state, dst=2)
    # tensors do not cross the harness's queue once a rank has exited: send lists back
    out["dicts"] = [{"w": d["w"].tolist(), "step": int(d["step"]), "meta": d["meta"],
                     "cpu": d["w"].device.type} for d in got]
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
    assert results[0]["bad"].startswith("UnpicklingError: gather_state_dicts: rank 0's state does not load")
    assert "weights_only" in results[0]["bad"]
    assert results[1]["bad"] == [] and results[2]["bad"] == []
    # a state that does not serialize on one rank fails every rank instead of hanging
    assert "rank 1 failed: state does not serialize" in results[1]["unserializable"]
    assert "rank 1 failed before the gather" in results[0]["unserializable"]
    assert "rank 1 failed before the gather" in results[2]["unserializable"]


def test_gather_state_dicts_single_process() -> None:
    [d] = list(gather_state_dicts({"w": torch.ones(2)}, dst=0))
    assert torch.equal(d["w"], torch.ones(2))
    with pytest.raises(TypeError, match="state must be a dict"):
        gather_state_dicts([torch.ones(1)], dst=0)  # type: ignore[arg-type]
