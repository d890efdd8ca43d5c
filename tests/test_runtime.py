"""The runtime object, the backend module and the launch attempt: state, device rule, start-up
path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks

from worldfoundry.core.distributed import (
    backends,
    context_parallel,
    groups,
    init,
    pipeline,
    run_control,
    runtime,
)

COMBINED_FORM = "cpu:gloo,cuda:nccl"


# ---------------------------------------------------------------- group_device


def _gloo_devices(rank: int, world: int) -> list[str]:
    groups.initialize_model_parallel(cp_size=world)
    cp_group = groups.get_cp_group()
    sub = dist.new_group([0, 1])
    out = [
        backends.group_device(),
        backends.group_device(dist.group.WORLD),
        backends.group_device(cp_group),
        backends.group_device(cp_group.device_group),
        backends.group_device(sub),
        backends.group_device(cp_group, control=True),
        pipeline.PPScheduler(cp_group).device,
    ]
    groups.destroy_model_parallel()
    return [str(d) for d in out]


@pytest.mark.slow
def test_group_device_of_a_real_gloo_group_is_the_cpu() -> None:
    assert run_ranks(_gloo_devices, 2, timeout=60) == [["cpu"] * 7] * 2


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's current device answers 0, as on a GPU machine (nothing else of CUDA is used)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.parametrize(
    ("backend_string", "expected", "control"),
    [
        (COMBINED_FORM, "cuda:0", "cpu"),  # NCCL for CUDA tensors; control traffic on the gloo half
        ("cuda:nccl,cpu:gloo", "cuda:0", "cpu"),
        ("nccl", "cuda:0", "cuda:0"),
        ("NCCL", "cuda:0", "cuda:0"),
        ("gloo", "cpu", "cpu"),
        ("mpi", "cpu", "cpu"),
    ],
)
def test_group_device_follows_the_backend_string(
    monkeypatch: pytest.MonkeyPatch,
    fake_cuda: None,
    backend_string: str,
    expected: str,
    control: str,
) -> None:
    seen: list[object] = []

    def get_backend(group: object = None) -> str:
        seen.append(group)
        return backend_string

    monkeypatch.setattr(dist, "get_backend", get_backend)
    pg = object()
    assert backends.group_device(pg) == torch.device(expected)
    assert backends.group_device(SimpleNamespace(device_group=pg)) == torch.device(expected)
    assert backends.group_device(pg, control=True) == torch.device(control)
    assert seen == [pg, pg, pg]
    # the sites that allocate communication buffers ask the same helper
    assert context_parallel._header_device(pg) == torch.device(control)
    lone = groups.GroupCoordinator("pp", [0], 0, pg, pg)
    assert pipeline.PPScheduler(lone).device == torch.device(expected)


def test_group_device_xccl_is_the_current_xpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "xccl")
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 1)
    assert backends.group_device() == torch.device("xpu", 1)


def test_one_backends_tuple_and_resolver() -> None:
    assert backends.BACKENDS == ("auto", "nccl", "gloo", "cpu:gloo,cuda:nccl")
    assert init.BACKENDS is backends.BACKENDS
    assert init.resolve_backend is backends.resolve_backend  # kept importable from init
    with pytest.raises(ValueError, match="distributed_backend='mpi' is not allowed"):
        backends.resolve_backend("mpi", 1, 0)


# ---------------------------------------------------------------- one start-up path


class _Started(Exception):
    """Raised by the fake init_default_group: how far start-up got, and with which backend."""


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []

    def init_default_group(
        backend_string: str,
        world_size: int = -1,
        rank: int = -1,
        init_method: str = "env://",
        timeout: object = None,
        device_id: object = None,
        join_timeout: object = None,
    ) -> bool:
        calls.append((backend_string, world_size, rank, init_method, device_id))
        raise _Started

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(runtime, "init_default_group", init_default_group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    return calls


def test_dist_init_and_distributed_run_start_nccl_alike(fake_gpus: list[tuple]) -> None:
    assert not dist.is_initialized()
    engine = SimpleNamespace(distributed_backend="nccl", distributed_timeout_minutes=1, cp_size=2)
    with pytest.raises(_Started):
        init.dist_init(SimpleNamespace(engine_config=engine))
    with pytest.raises(_Started), run_control.distributed_run(device="cuda"):
        pass
    cuda1 = torch.device("cuda", 1)
    assert fake_gpus == [(COMBINED_FORM, 2, 1, "env://", cuda1)] * 2


# ---------------------------------------------------------------- the runtime object


class _Scheduler:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_close_resets_everything_and_runs_hooks_once() -> None:
    rt = runtime.current()
    assert rt is runtime.current()
    assert rt.layout is None and rt.world is None and rt.pp_scheduler is None
    calls: list[object] = []
    rt.on_close(lambda r: calls.append(("first", r.cp_size_t)))
    rt.on_close(lambda r: calls.append(("second", r.cp_size_t)))
    rt.cache["helper"] = {"x": 1}
    scheduler = rt.pp_scheduler = _Scheduler()
    context_parallel.find_split((1, 16, 8, 32, 32), 4)
    assert groups.get_cp_size_t() == 4
    groups.destroy_model_parallel()
    assert calls == [("second", 4), ("first", 4)]  # newest first, before the state goes
    assert scheduler.closed and rt.pp_scheduler is None
    assert rt.cache == {} and rt.cp_size_t is None and rt.groups == {} and not rt.owns_world
    rt.close()
    assert len(calls) == 2  # hooks run once


def test_pp_scheduler_lives_in_the_runtime() -> None:
    rt = runtime.current()
    rt.pp_scheduler = sched = pipeline.PPScheduler(
        groups.GroupCoordinator("pp", [0], 0, None, None), device="cpu"
    )
    try:
        assert pipeline.pp_scheduler() is sched
    finally:
        rt.close()
    with pytest.raises(RuntimeError, match="not initialized"):
        pipeline.pp_scheduler()


# ---------------------------------------------------------------- launch attempt


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 0), ("", 0), ("0", 0), ("3", 3), (" 12 ", 12)]
)
def test_launch_attempt_reads_wf_attempt(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: int
) -> None:
    for other in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.setenv(other, "7")  # never read
    if value is None:
        monkeypatch.delenv("WF_ATTEMPT", raising=False)
    else:
        monkeypatch.setenv("WF_ATTEMPT", value)
    assert init.launch_attempt() == expected
    assert runtime.launch_attempt is init.launch_attempt


@pytest.mark.parametrize("value", ["one", "-1", "1.5"])
def test_launch_attempt_rejects_what_is_not_an_attempt_number(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("WF_ATTEMPT", value)
    with pytest.raises(ValueError, match=r"WF_ATTEMPT=.* must be an integer >= 0"):
        init.launch_attempt()


def _attempt_prefix(rank: int, world: int) -> list[str]:
    prefixes: list[str] = []
    real = dist.PrefixStore

    def recording(prefix: str, store: object) -> object:
        prefixes.append(prefix)
        return real(prefix, store)

    dist.PrefixStore = recording
    config = SimpleNamespace(
        engine_config=SimpleNamespace(distributed_backend="gloo", distributed_timeout_minutes=0.5)
    )
    try:
        for _ in range(2):  # the second init re-uses the launch's store under a fresh prefix
            init.dist_init(config)
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == world
            groups.destroy_model_parallel()
    finally:
        dist.PrefixStore = real
    return [p for p in prefixes if p.startswith("wf/")]


@pytest.mark.slow
def test_each_init_of_an_attempt_has_its_own_store_prefix() -> None:
    out = run_ranks(_attempt_prefix, 2, init=False, env={"WF_ATTEMPT": "5"}, timeout=60)
    assert out[0] == out[1] and len(out[0]) == 2
    # the init counter is process-wide (a forked rank continues its parent's count)
    first = int(out[0][0].removeprefix("wf/attempt5/init").rstrip("/"))
    assert out[0] == [f"wf/attempt5/init{first}/", f"wf/attempt5/init{first + 1}/"]


def test_backend_function_is_not_shadowed_by_the_backends_module() -> None:
    import worldfoundry.core.distributed as wfd

    assert (
        wfd.backend is run_control.backend
    )  # the contract's backend(), after backends.py is imported
    assert wfd.group_device is backends.group_device


def _run_owns_what_the_body_built(rank: int, world: int) -> list[object]:
    config = SimpleNamespace(
        engine_config=SimpleNamespace(
            distributed_backend="gloo", distributed_timeout_minutes=0.5, cp_size=2
        )
    )
    out: list[object] = []
    with run_control.distributed_run(device="cpu") as state:
        assert init.dist_init(config) == torch.device("cpu")
        out.append((state.rank, groups.get_cp_group().ranks))
    out.append((dist.is_initialized(), groups.model_parallel_is_initialized()))
    with pytest.raises(ValueError, match="body failed"), run_control.distributed_run(device="cpu"):
        init.dist_init(config)
        raise ValueError(
            "body failed"
        )  # every rank fails alike: the group is aborted, the runtime forgotten
    out.append((dist.is_initialized(), groups.model_parallel_is_initialized()))
    return out


@pytest.mark.slow
def test_distributed_run_closes_the_runtime_built_on_its_group() -> None:
    out = run_ranks(_run_owns_what_the_body_built, 2, init=False, timeout=60)
    assert out == [
        [(0, [0, 1]), (False, False), (False, False)],
        [(1, [0, 1]), (False, False), (False, False)],
    ]


def _late_joiner(rank: int, world: int) -> dict[str, float]:
    """Rank 1 starts 3 s after rank 0, with a collective timeout of 0.6 s."""
    import time

    if rank == 1:
        time.sleep(3.0)
    engine = SimpleNamespace(
        distributed_backend="gloo", distributed_timeout_minutes=0.01, init_timeout_s=60
    )
    init.dist_init(SimpleNamespace(engine_config=engine))
    t = torch.ones(1)
    dist.all_reduce(t)
    from worldfoundry.core.distributed import runtime

    store_waits = runtime._RDZV.store.timeout.total_seconds()
    groups.destroy_model_parallel()
    return {"sum": t.item(), "store_waits": store_waits}


@pytest.mark.slow
def test_ranks_that_start_apart_join_within_the_init_timeout_not_the_collective_one() -> None:
    """A scheduler starts ranks one by one: a 0.6 s collective timeout must not end a start
    where the ranks arrive 3 s apart; afterwards the store waits as the collectives do."""
    out = run_ranks(_late_joiner, 2, init=False, timeout=60)
    assert [o["sum"] for o in out] == [2.0, 2.0]
    assert [round(o["store_waits"], 1) for o in out] == [0.6, 0.6]
