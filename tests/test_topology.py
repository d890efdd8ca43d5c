"""Rank layout as pure data: Megatron's order semantics and every bad layout."""

from __future__ import annotations

import itertools
import time

import pytest

from worldfoundry.core.distributed.topology import Layout, parse_order


def test_megatron_docstring_example_16_ranks() -> None:
    # Megatron's initialize_model_parallel docstring: tp=2, pp=4 on 16 GPUs, order tp-dp-pp.
    L = Layout(16, tp_size=2, pp_size=4, order="tp-dp-pp")
    assert L.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert L.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert L.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_megatron_cp_docstring_example() -> None:
    # "tp=4, cp=2 on 8 GPUs: cp groups [0,4] [1,5] [2,6] [3,7]".
    L = Layout(8, tp_size=4, cp_size=2)
    assert L.groups("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert L.groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert L.groups("tp-cp") == [list(range(8))]


@pytest.mark.parametrize(
    "order", ["-".join(p) for p in itertools.permutations(["tp", "cp", "pp", "dp"])]
)
def test_every_permutation_is_a_bijection_with_innermost_first_strides(order: str) -> None:
    L = Layout(24, tp_size=2, cp_size=3, pp_size=2, dp_size=2, order=order)
    dims = order.split("-")
    seen = set()
    for r in range(24):
        c = L.coords(r)
        stride, expect = 1, 0
        for d in dims:
            expect += c[d] * stride
            stride *= L.sizes[d]
        assert expect == r
        assert L.rank_of(c) == r
        seen.add(tuple(c[d] for d in dims))
    assert len(seen) == 24
    for name in ("tp", "cp", "pp", "dp", "tp-cp", "dp-cp", "tp-pp"):
        groups = L.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(24))
        for r in range(24):
            assert L.group_of(r, name) in groups


def test_size_one_tokens_may_be_left_out() -> None:
    assert Layout(4, cp_size=4, order="cp").groups("cp") == [[0, 1, 2, 3]]
    assert parse_order("pp-tp", {"tp": 2, "cp": 1, "pp": 2, "dp": 1}) == ("pp", "tp", "cp", "dp")


def test_dp_defaults_to_what_the_world_leaves() -> None:
    L = Layout(16, tp_size=2, cp_size=2)
    assert L.dp_size == 4 and L.describe() == "tp=2 cp=2 pp=1 dp=4 (order tp-cp-pp-dp, 16 ranks)"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"order": "tp-xp-pp-dp"}, "unknown token(s) ['xp']"),
        ({"order": "tp-tp-pp-dp"}, "token(s) ['tp'] appear more than once"),
        ({"order": "tp-pp-dp", "cp_size": 2}, "token(s) ['cp'] have size > 1 but are missing"),
        ({"tp_size": 0}, "tp_size must be an integer >= 1"),
        ({"pp_size": -2}, "pp_size must be an integer >= 1"),
        ({"cp_size": 3}, "tp*cp*pp = 3 does not divide the world size 8"),
        ({"tp_size": 2, "dp_size": 2}, "tp*cp*pp*dp = 4 != world size 8"),
        ({"order": ""}, "order must be"),
    ],
)
def test_bad_layouts_raise_one_value_error_naming_order_sizes_and_world(
    kwargs: dict, needle: str
) -> None:
    with pytest.raises(ValueError) as info:
        Layout(8, **kwargs)
    msg = str(info.value)
    assert needle in msg
    assert "order=" in msg and "tp_size=" in msg and "cp_size=" in msg and "world_size=8" in msg


def test_layout_math_is_cheap_at_a_million_ranks() -> None:
    t0 = time.perf_counter()
    L = Layout(1 << 20, tp_size=8, cp_size=4, pp_size=16)
    members = L.group_of(987_654, "pp")
    assert len(members) == 16 and 987_654 in members
    assert L.coords(L.rank_of(L.coords(987_654))) == L.coords(987_654)
    assert time.perf_counter() - t0 < 5  # generous: pure arithmetic, no per-rank tables


@pytest.mark.parametrize("dp", [None, 0, -1, "absent"])
def test_from_engine_takes_dp_from_the_world(dp: object) -> None:
    from types import SimpleNamespace

    engine = {"tp_size": 2, "cp_size": 2, "pp_size": 1, "order": "cp-tp-pp-dp"}
    if dp != "absent":
        engine["dp_size"] = dp
    for cfg in (engine, SimpleNamespace(**engine)):
        L = Layout.from_engine(cfg, 8)
        assert Layout(8, tp_size=2, cp_size=2, pp_size=1, dp_size=2, order="cp-tp-pp-dp") == L
    with pytest.raises(ValueError, match="dp_size must be given"):
        Layout.from_engine(engine)


def test_from_engine_world_is_the_product_when_not_given() -> None:
    L = Layout.from_engine(
        {"tp_size": 2, "cp_size": 3, "pp_size": 2, "dp_size": 2, "order": "tp-cp-pp-dp"}
    )
    assert L.world_size == 24 and L.sizes == {"tp": 2, "cp": 3, "pp": 2, "dp": 2}
    assert Layout.from_engine({"dp_size": 4}) == Layout(
        4
    )  # absent tp/cp/pp are 1, order the default
    with pytest.raises(ValueError, match=r"tp\*cp\*pp\*dp = 8 != world size 4"):
        Layout.from_engine({"tp_size": 2, "dp_size": 4}, 4)
    with pytest.raises(ValueError, match=r"cp_size must be an integer >= 1, got 'x'"):
        Layout.from_engine({"cp_size": "x", "dp_size": 1})
    with pytest.raises(ValueError, match="unknown token"):
        Layout.from_engine({"dp_size": 1, "order": "tp-xx"})
