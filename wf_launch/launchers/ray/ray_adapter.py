"""Every name of Ray's this launcher relies on, private ones included, in one place.

Nothing else imports ``ray`` (``import wf_launch`` never pays for it); :func:`check_names`
lists what a Ray upgrade removed or renamed."""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import os
import pkgutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any

INSTALL_HINT = "pip install 'worldfoundry-launch[ray]'"
"""How to get Ray (the ``ray`` extra: ``ray[default]``)."""
RAYLET_PID_ENV = "RAY_RAYLET_PID"
"""Set (undocumented) by the raylet in every process it starts: the drill's nodekill finds it."""
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
PRIVATE_NAMES = {
    "ray._private.ray_constants:ENABLE_RAY_CLUSTER": "False keeps 127.0.0.1 as the node address",
    "ray._raylet:AuthenticationTokenLoader.instance": "reset for a private instance's own token",
    "ray._raylet:Config.initialize": "reads RAY_AUTH_MODE again (a private instance's)",
    "ray._private.worker:print_to_stdstream": "the cluster's messages, routed to launcher.log",
}
PUBLIC_NAMES = {
    "ray": "init shutdown is_initialized nodes remote get wait kill get_actor get_gpu_ids "
    "get_runtime_context",
    "ray.actor": "exit_actor",
    "ray.util": "get_node_ip_address",
    "ray.util.placement_group": "placement_group remove_placement_group placement_group_table",
    "ray.util.scheduling_strategies": "PlacementGroupSchedulingStrategy "
    "NodeAffinitySchedulingStrategy",
    "ray.exceptions": "RayTaskError ActorDiedError RayActorError ActorUnavailableError "
    "RuntimeEnvSetupError",
}


class RayMissing(ImportError):
    """Ray is not installed (or not importable) in this environment."""


def _ray() -> Any:
    _token_auth_when_available()  # read by Ray when it is first imported
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise RayMissing(
            f"launcher=ray needs Ray, which is not importable here ({exc}); install it with: "
            f"{INSTALL_HINT}"
        ) from None


def check_names() -> list[str]:
    """What a Ray upgrade removed: one line per missing name (empty when all are there)."""
    missing = []
    public = [
        f"{module}:{name}" for module, names in PUBLIC_NAMES.items() for name in names.split()
    ]
    for name in [*public, *PRIVATE_NAMES]:
        try:
            pkgutil.resolve_name(name)
        except (ImportError, AttributeError) as exc:
            why = PRIVATE_NAMES.get(name, "public")
            missing.append(f"{name.replace(':', '.')} ({why}): {type(exc).__name__}: {exc}")
    return missing


def is_connected() -> bool:
    return bool(_ray().is_initialized())


def _token_auth_when_available() -> None:
    """Ray 2.60 clusters use token authentication and a driver must ask for it: when
    ``RAY_AUTH_MODE`` is unset and the user has a token, ask (a cluster without it accepts it)."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"


def set_env(values: dict[str, str | None]) -> dict[str, str | None]:
    """Set (None: unset) each of Ray's variables in this process; what they were."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return saved


@contextlib.contextmanager
def loopback() -> Iterator[None]:
    """Ray's single-machine mode for this process and those it starts: servers bind 127.0.0.1."""
    constants = importlib.import_module("ray._private.ray_constants")
    saved = set_env({LOOPBACK_ENV: "0"}), constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved[1]
        set_env(saved[0])


def reset_auth_token() -> None:
    """Forget the token this process loaded (a private instance brings its own)."""
    _ray()
    raylet = importlib.import_module("ray._raylet")
    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()


def join_cluster(address: str) -> None:
    """Connect this process to the cluster at ``address`` ('auto' or 'HOST:PORT'); a loopback
    address in single-machine mode (Ray would replace 127.0.0.1 by the host's address)."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    with loopback() if local else contextlib.nullcontext():
        _ray().init(address=address, log_to_driver=False, logging_level="ERROR")


def start_private(num_cpus: float, temp_dir: str) -> None:
    """Start a private Ray instance on this machine (temp dir ``temp_dir``) and connect."""
    _ray().init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        _temp_dir=temp_dir,
    )


def route_cluster_messages(write: Callable[[str], None]) -> None:
    """The cluster's messages a driver prints ("A worker died ...") go to ``write`` (the log)."""
    worker = importlib.import_module("ray._private.worker")

    def to_log(data: dict[str, Any], ignore_prefix: bool) -> None:
        for line in data.get("lines") or []:
            write(f"[ray {data.get('pid')}] {line}")

    worker.print_to_stdstream = to_log


def shutdown() -> None:
    ray = _ray()
    if ray.is_initialized():
        ray.shutdown()


def gcs_address() -> str:
    return str(_ray().get_runtime_context().gcs_address)


def list_nodes() -> list[dict[str, Any]]:
    """``ray.nodes()``: every node the GCS knows (``Alive``, ``NodeID``, ``Resources`` ...)."""
    return list(_ray().nodes())


def current_node_id() -> str:
    return str(_ray().get_runtime_context().get_node_id())


def node_ip() -> str:
    return str(importlib.import_module("ray.util").get_node_ip_address())


def gpu_ids() -> list[str]:
    return [str(g) for g in _ray().get_gpu_ids()]


def raylet_pid() -> int | None:
    """The pid of this worker's raylet (None outside a Ray worker)."""
    raw = os.environ.get(RAYLET_PID_ENV, "")
    return int(raw) if raw.isdigit() else None


def placement_group(bundles: list[dict[str, float]], strategy: str, name: str = "") -> Any:
    from ray.util.placement_group import placement_group as make

    return make(bundles, strategy=strategy, name=name)


def pg_ready(pg: Any, timeout_s: float) -> bool:
    """Whether the group is placed within ``timeout_s`` (it stays pending otherwise)."""
    ready, _ = _ray().wait([pg.ready()], timeout=max(0.0, timeout_s))
    return bool(ready)


def bundle_nodes(pg: Any) -> dict[int, str]:
    """Which node holds each bundle of a placed group."""
    from ray.util.placement_group import placement_group_table

    return {int(k): str(v) for k, v in placement_group_table(pg)["bundles_to_node_id"].items()}


def remove_placement_group(pg: Any) -> None:
    from ray.util.placement_group import remove_placement_group as remove

    with contextlib.suppress(Exception):  # already removed (its creator died, or a second call)
        remove(pg)


def in_bundle(pg: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False
    )


def on_node(node_id: str, soft: bool = False) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=soft)


def remote(obj: type | Callable[..., Any], **options: Any) -> Any:
    """``ray.remote(**options)(obj)``: an actor class or a remote function."""
    return _ray().remote(**options)(obj) if options else _ray().remote(obj)


@contextlib.contextmanager
def _signal_raised() -> Iterator[None]:
    """What a signal handler raised while Ray waited in C (SIGTERM's ``Stopped``), as itself:
    Ray's Cython call hands it on as a ``SystemError`` with it as the cause."""
    try:
        yield
    except SystemError as exc:
        if isinstance(exc.__cause__, BaseException):
            raise exc.__cause__ from None
        raise


def get(refs: Any, timeout_s: float | None = None) -> Any:
    with _signal_raised():
        return _ray().get(refs, timeout=timeout_s)


def wait(refs: Sequence[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
    """Every ref ready within ``timeout_s`` (at least one, unless the time ran out), the rest."""
    if not refs:
        return [], []
    ray = _ray()
    with _signal_raised():
        ready, pending = ray.wait(list(refs), num_returns=1, timeout=timeout_s)
    if ready and pending:
        more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
        ready += more
    return ready, pending


def wait_all(refs: Sequence[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
    """The refs ready within ``timeout_s`` (waiting for all, at most that long), the rest."""
    if not refs:
        return [], []
    with _signal_raised():
        ready, pending = _ray().wait(list(refs), num_returns=len(refs), timeout=max(0.0, timeout_s))
    return list(ready), list(pending)


def exit_actor() -> None:
    """End the actor this runs in (a detached supervisor, once its run is recorded)."""
    importlib.import_module("ray.actor").exit_actor()


def kill(actor: Any) -> None:
    with contextlib.suppress(Exception):  # already dead
        _ray().kill(actor, no_restart=True)


def actor_by_name(name: str, namespace: str) -> Any | None:
    """The live actor ``name`` in ``namespace``; None when there is none."""
    try:
        return _ray().get_actor(name, namespace=namespace)
    except ValueError:
        return None


def classify_error(exc: BaseException) -> str:
    """'raised' (the method raised), 'died' (its process died), 'unavailable' (unreachable: its
    node may be gone), 'runtime_env' (launcher.runtime_env failed), or 'other'."""
    from ray import exceptions as ex

    if isinstance(exc, ex.RuntimeEnvSetupError) or "RuntimeEnvSetupError" in type(exc).__name__:
        return "runtime_env"
    if isinstance(exc, ex.ActorUnavailableError):
        return "unavailable"
    if isinstance(exc, ex.RayActorError):
        cause = str(exc).lower()
        return "runtime_env" if "runtime env" in cause and "setup" in cause else "died"
    return "raised" if isinstance(exc, ex.RayTaskError) else "other"
