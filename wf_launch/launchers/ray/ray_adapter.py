"""Every name of Ray's this launcher relies on, private ones included, in one place.

Nothing else in the repository imports ``ray``: the launcher's modules call these wrappers,
so ``import wf_launch`` never imports Ray (a launch with another launcher never pays for it),
and a missing Ray is one clear error (:class:`RayMissing`, with the install command).
:func:`check_names` lists what a Ray upgrade removed or renamed; tests/test_ray_units.py
fails loudly on it.
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import os
import pkgutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "INSTALL_HINT",
    "PRIVATE_NAMES",
    "PUBLIC_NAMES",
    "RayMissing",
    "actor_by_name",
    "bundle_nodes",
    "check_names",
    "classify_error",
    "current_node_id",
    "exit_actor",
    "gcs_address",
    "get",
    "gpu_ids",
    "in_bundle",
    "is_connected",
    "join_cluster",
    "kill",
    "list_nodes",
    "loopback",
    "node_ip",
    "on_node",
    "pg_ready",
    "placement_group",
    "raylet_pid",
    "remote",
    "remove_placement_group",
    "reset_auth_token",
    "route_cluster_messages",
    "shutdown",
    "start_private",
    "wait",
    "wait_all",
]

INSTALL_HINT = "pip install 'worldfoundry-launch[ray]'"
"""How to get Ray (the ``ray`` extra: ``ray[default]``)."""

RAYLET_PID_ENV = "RAY_RAYLET_PID"
"""Set by the raylet in every process it starts (not documented): the node's raylet, for the drill's
nodekill."""

PRIVATE_NAMES = (
    (
        "ray",
        "RAY_RAYLET_PID",
        "environment variable the raylet sets in its workers (nodekill finds its raylet)",
    ),
    (
        "ray",
        "~/.ray/auth_token",
        "the default token file of Ray's token authentication (RAY_AUTH_MODE=token)",
    ),
    (
        "ray._private.ray_constants",
        "ENABLE_RAY_CLUSTER",
        "False (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) keeps 127.0.0.1 as the node address: "
        "a private instance binds loopback only",
    ),
    (
        "ray._raylet",
        "AuthenticationTokenLoader.instance",
        "its cache is reset when a private instance brings its own token",
    ),
    ("ray._raylet", "Config.initialize", "reads RAY_AUTH_MODE again (a private instance's)"),
    (
        "ray._private.worker",
        "print_to_stdstream",
        "where a driver prints the cluster's error messages (a worker or "
        "raylet that died): routed to launcher.log",
    ),
)
PUBLIC_NAMES = (
    ("ray", "init", "join a cluster (address) or start a private instance (address='local')"),
    ("ray", "shutdown", "leave the cluster; stops a private instance"),
    ("ray", "is_initialized", "whether this process is connected"),
    ("ray", "nodes", "the cluster's nodes, alive or dead, with their resources"),
    ("ray", "remote", "actors (ranks, supervisor) and tasks (signals)"),
    ("ray", "get", "results"),
    ("ray", "wait", "the monitor's poll"),
    ("ray", "kill", "teardown"),
    ("ray", "get_actor", "a detached run's supervisor, by name"),
    ("ray.actor", "exit_actor", "a detached supervisor leaves once its run is recorded"),
    ("ray", "get_gpu_ids", "the GPUs Ray gave a rank"),
    ("ray", "get_runtime_context", "node id, GCS address"),
    ("ray.util", "get_node_ip_address", "a rank's node address (MASTER_ADDR)"),
    ("ray.util.placement_group", "placement_group", "one placement group per attempt"),
    ("ray.util.placement_group", "remove_placement_group", "teardown"),
    ("ray.util.placement_group", "placement_group_table", "which node holds each bundle"),
    ("ray.util.scheduling_strategies", "PlacementGroupSchedulingStrategy", "a rank in its bundle"),
    (
        "ray.util.scheduling_strategies",
        "NodeAffinitySchedulingStrategy",
        "signals sent on a rank's node",
    ),
    ("ray.exceptions", "RayTaskError", "a rank raised"),
    ("ray.exceptions", "ActorDiedError", "a rank died"),
    (
        "ray.exceptions",
        "ActorUnavailableError",
        "a rank's process is unreachable (its node may be gone)",
    ),
    ("ray.exceptions", "RayActorError", "any actor loss"),
    ("ray.exceptions", "GetTimeoutError", "bounded waits"),
    ("ray.exceptions", "RuntimeEnvSetupError", "launcher.runtime_env could not be set up"),
)


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


def _resolve(module: str, dotted: str) -> Any:
    return pkgutil.resolve_name(f"{module}:{dotted}")


def check_names() -> list[str]:
    """What a Ray upgrade removed: one line per missing name (empty when all are there)."""
    missing = []
    for module, dotted, why in (
        *PUBLIC_NAMES,
        *(n for n in PRIVATE_NAMES if not n[1].startswith(("RAY_", "~"))),
    ):
        try:
            _resolve(module, dotted)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{module}.{dotted} ({why}): {type(exc).__name__}: {exc}")
    return missing


# ------------------------------------------------------------------ connecting
def is_connected() -> bool:
    return bool(_ray().is_initialized())


def _token_auth_when_available() -> None:
    """Ray 2.60 clusters use token authentication by default, and a driver must ask for it
    (``RAY_AUTH_MODE``):
    when unset and the user has a token, ask for it (a cluster without authentication accepts it
    too)."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback() -> Iterator[None]:
    """Ray's single-machine mode, for this process and the processes it starts meanwhile.

    By default Ray replaces 127.0.0.1 by the host's address, and its servers then listen on
    every interface; in this mode the node address stays 127.0.0.1 and every server binds it.
    """
    constants = importlib.import_module("ray._private.ray_constants")
    saved = (os.environ.get(LOOPBACK_ENV), constants.ENABLE_RAY_CLUSTER)
    os.environ[LOOPBACK_ENV] = "0"
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved[1]
        if saved[0] is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = saved[0]


def reset_auth_token() -> None:
    """Forget the token this process loaded (a private instance brings its own)."""
    _ray()
    raylet = importlib.import_module("ray._raylet")
    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()


def _is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def join_cluster(address: str, namespace: str | None = None) -> dict[str, Any]:
    """Connect this process to the cluster at ``address`` ('auto' or 'HOST:PORT'); its address info.

    A loopback address is a cluster of this machine that may listen on loopback only: joined
    in Ray's single-machine mode (Ray would replace 127.0.0.1 by the host's address).
    """
    ray = _ray()
    mode = loopback() if _is_loopback(address) else contextlib.nullcontext()
    with mode:
        ctx = ray.init(
            address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR"
        )
    return dict(ctx.address_info)


def start_private(
    num_cpus: float, num_gpus: int | None, namespace: str | None, temp_dir: str
) -> dict[str, Any]:
    """Start a private Ray instance on this machine (``address='local'``, its temp dir
    ``temp_dir``) and connect; its address info."""
    ctx = _ray().init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        namespace=namespace,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        _temp_dir=temp_dir,
    )
    return dict(ctx.address_info)


def route_cluster_messages(write: Callable[[str], None]) -> None:
    """Send the cluster's error messages this driver would print ("A worker died ...", a dead
    raylet's last
    lines) to ``write`` (the launcher's log) instead of the console: the launcher reports the root
    cause."""
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


# ------------------------------------------------------------------ the cluster
def list_nodes() -> list[dict[str, Any]]:
    """``ray.nodes()``: every node the GCS knows (``Alive``, ``NodeID``, ``NodeManagerAddress``,
    ``Resources`` ...)."""
    return list(_ray().nodes())


def current_node_id() -> str:
    return str(_ray().get_runtime_context().get_node_id())


def node_ip() -> str:
    return str(importlib.import_module("ray.util").get_node_ip_address())


def gpu_ids() -> list[str]:
    return [str(g) for g in _ray().get_gpu_ids()]


def raylet_pid() -> int | None:
    """The pid of this worker's raylet, from the variable the raylet sets (None outside a Ray
    worker)."""
    raw = os.environ.get(RAYLET_PID_ENV, "")
    return int(raw) if raw.isdigit() else None


# ------------------------------------------------------------------ placement
def placement_group(
    bundles: list[dict[str, float]], strategy: str, name: str = "", detached: bool = False
) -> Any:
    from ray.util.placement_group import placement_group as make

    return make(bundles, strategy=strategy, name=name, lifetime="detached" if detached else None)


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

    try:
        remove(pg)
    except Exception:
        pass  # already removed (its creator died, or a second teardown)


def in_bundle(pg: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False
    )


def on_node(node_id: str, soft: bool = False) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=soft)


# ------------------------------------------------------------------ actors and tasks
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
    """Every ref that is ready within ``timeout_s`` (at least one, unless the time ran out), and the
    rest."""
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
    """The refs ready within ``timeout_s`` (waiting for all of them, at most that long), and the
    rest."""
    if not refs:
        return [], []
    with _signal_raised():
        ready, pending = _ray().wait(list(refs), num_returns=len(refs), timeout=max(0.0, timeout_s))
    return list(ready), list(pending)


def exit_actor() -> None:
    """End the actor this runs in (a detached supervisor, once its run is recorded)."""
    importlib.import_module("ray.actor").exit_actor()


def kill(actor: Any) -> None:
    try:
        _ray().kill(actor, no_restart=True)
    except Exception:
        pass  # already dead


def actor_by_name(name: str, namespace: str) -> Any | None:
    """The live actor ``name`` in ``namespace``; None when there is none."""
    try:
        return _ray().get_actor(name, namespace=namespace)
    except ValueError:
        return None


def classify_error(exc: BaseException) -> str:
    """'raised' (the method raised), 'died' (its process died), 'unavailable' (unreachable: its node
    may be
    gone), 'timeout', 'runtime_env' (launcher.runtime_env failed), or 'other'."""
    from ray import exceptions as ex

    if isinstance(exc, ex.RuntimeEnvSetupError) or "RuntimeEnvSetupError" in type(exc).__name__:
        return "runtime_env"
    if isinstance(exc, ex.ActorUnavailableError):
        return "unavailable"
    if isinstance(exc, ex.RayActorError):
        cause = str(exc)
        return (
            "runtime_env" if "runtime env" in cause.lower() and "setup" in cause.lower() else "died"
        )
    if isinstance(exc, ex.RayTaskError):
        return "raised"
    if isinstance(exc, ex.GetTimeoutError):
        return "timeout"
    return "other"
