"""Which Ray cluster a cluster run uses, and what each of its actors holds.

Ray is imported here and in the cluster run's modules only, when a run asks for a cluster
(``replay(..., cluster="ray")``), never by ``import trace_replay``. A cluster this module
starts (no address given and this process not connected yet) is shut down after the run;
one this process was already connected to stays as it was.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["ClusterPlan", "RayCluster", "as_cluster", "connect", "import_ray", "plan_actors"]


@dataclass(frozen=True)
class RayCluster:
    """A Ray cluster to replay on, and the resources of each of its engines.

    ``replay(..., cluster="ray")`` is ``cluster=RayCluster()``. Validated on construction.

    Parameters
    ----------
    address
        ``None``: the cluster this process is connected to (``ray.init`` called before),
        else a new local one, started for the run and shut down after it. ``"auto"``: the
        cluster ``RAY_ADDRESS`` names, else the last one ``ray start`` started on this
        machine. Otherwise a head's address, ``"10.0.0.1:6379"``. Ray Client
        (``"ray://..."``) is refused: submit the run as a Ray job instead
        (docs/cluster.md says why).
    actors
        Engines, one per Ray actor (``None``: as many as the cluster's GPUs, or CPUs,
        hold at the per-actor resources below).
    num_gpus
        GPUs per actor (``None``: 1 when the engine's device is CUDA, or is left to the
        engine and the cluster has GPUs; else 0, and the engine runs on the CPU).
    num_cpus
        CPUs per actor; a CPU engine runs this many intra-op threads (Ray sets
        ``OMP_NUM_THREADS`` to it).
    """

    address: str | None = None
    actors: int | None = None
    num_gpus: float | None = None
    num_cpus: float = 1

    def __post_init__(self) -> None:
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ValueError(
                f"cluster address must be a non-empty str or None, got {self.address!r}"
            )
        if self.address is not None and self.address.startswith("ray://"):
            raise ValueError(
                f"cluster address {self.address!r} is Ray Client, which cluster runs "
                "refuse: Ray Client ends the run when the driver's connection drops for "
                "30 s, and its per-client server did not start reliably against a "
                "Ray 2.60 head (docs/cluster.md). Run the driver on the cluster instead: "
                "ray job submit --address http://HEAD_IP:8265 -- trace-replay replay "
                "... --ray auto"
            )
        if self.actors is not None and (
            isinstance(self.actors, bool) or not isinstance(self.actors, int) or self.actors < 1
        ):
            raise ValueError(f"cluster actors must be an integer >= 1, got {self.actors!r}")
        for name, lowest in (("num_gpus", 0), ("num_cpus", 0)):
            value = getattr(self, name)
            if value is None and name == "num_gpus":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < lowest
            ):
                raise ValueError(f"cluster {name} must be a number >= {lowest}, got {value!r}")
        if self.num_cpus == 0 and not self.num_gpus:
            raise ValueError(
                "cluster num_cpus and num_gpus are both 0: an actor needs a CPU "
                "or a GPU to run its engine on"
            )


@dataclass(frozen=True)
class ClusterPlan:
    """The actors a run starts: how many, with which resources, their engine's device."""

    actors: int
    num_cpus: float
    num_gpus: float
    device: Any  # what make_engine gets: the run's own device, "cpu" for GPU-less actors


def as_cluster(cluster: Any) -> RayCluster:
    """``"ray"`` or a :class:`RayCluster` as a :class:`RayCluster`; anything else refused."""
    if isinstance(cluster, RayCluster):
        return cluster
    if cluster == "ray":
        return RayCluster()
    raise ValueError(f"cluster must be None, 'ray' or a RayCluster, got {cluster!r}")


def import_ray() -> ModuleType:
    """The ``ray`` module; a clear ImportError naming the extra when absent."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            f"cluster runs need Ray ({error}); install the extra, from a "
            "checkout of this package: pip install -e '.[ray]'"
        ) from None
    return ray


@contextlib.contextmanager
def connect(cluster: RayCluster, *, verbose: bool = False) -> Iterator[str]:
    """Be connected to ``cluster`` for the block; yield its address.

    Connected already (``ray.init`` called before): that cluster, left connected after;
    an ``address`` given then is refused, since one process joins one cluster. Else
    ``ray.init`` with the address (none: a new local cluster, no dashboard), and
    ``ray.shutdown`` after the block, which stops a local cluster started here and only
    disconnects from any other. Ray's usage statistics stay off unless
    ``RAY_USAGE_STATS_ENABLED`` says otherwise; worker logs reach this process only with
    ``verbose``.
    """
    ray = import_ray()
    if ray.is_initialized():
        if cluster.address is not None:
            raise ValueError(
                f"this process is connected to a Ray cluster already, so cluster "
                f"address {cluster.address!r} cannot be joined; leave address "
                "None to use the connected one, or ray.shutdown() first"
            )
        yield ray.get_runtime_context().gcs_address
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    local = cluster.address is None
    options: dict[str, Any] = {
        "address": "local" if local else cluster.address,
        "log_to_driver": verbose,
        "logging_level": logging.INFO if verbose else logging.WARNING,
    }
    if local:
        options["include_dashboard"] = False
    ray.init(**options)
    try:
        yield "local" if cluster.address is None else cluster.address
    finally:
        ray.shutdown()


def plan_actors(cluster: RayCluster, device: Any, resources: dict[str, float]) -> ClusterPlan:
    """The actors to start on a cluster of ``resources`` (``ray.cluster_resources()``).

    Raises
    ------
    ValueError
        When the cluster has not the resources of one actor, or the device asks for CUDA
        on actors without a GPU.
    """
    cuda = device is not None and str(device).startswith("cuda")
    gpus = cluster.num_gpus
    if gpus is None:
        gpus = 1 if cuda or (device is None and resources.get("GPU", 0) > 0) else 0
    if cuda and gpus == 0:
        raise ValueError(f"device {device!r} needs a GPU per actor, but num_gpus is 0")
    have = {"GPU": resources.get("GPU", 0.0), "CPU": resources.get("CPU", 0.0)}
    need = {"GPU": gpus, "CPU": cluster.num_cpus}
    short = [f"{need[k]:g} {k}" for k in need if need[k] > have[k]]
    if short:
        raise ValueError(
            f"one actor needs {' and '.join(short)}, but the Ray cluster has "
            f"{have['CPU']:g} CPU and {have['GPU']:g} GPU in all"
        )
    fits = min(int(have[k] // need[k]) for k in need if need[k] > 0)
    return ClusterPlan(
        actors=cluster.actors or fits,
        num_cpus=cluster.num_cpus,
        num_gpus=gpus,
        device="cpu" if gpus == 0 and device is None else device,
    )
