"""Which cluster a cluster run uses and what its actors hold (runs/cluster.py); arguments a
cluster run refuses before anything is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trace_replay.runs.cluster import RayCluster, as_cluster, plan_actors
from trace_replay.runs.replay import replay

TRACES = [{"id": "a", "prompt": "The capital of France is", "completion": " Paris."}]


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"address": ""}, "address must be a non-empty str"),
        ({"address": "ray://10.0.0.1:10001"}, "is Ray Client.*ray job submit"),
        ({"actors": 0}, "actors must be an integer >= 1"),
        ({"actors": True}, "actors must be an integer >= 1"),
        ({"num_gpus": -1}, "num_gpus must be a number >= 0"),
        ({"num_cpus": float("nan")}, "num_cpus must be a number >= 0"),
        ({"num_cpus": 0, "num_gpus": 0}, "both 0"),
    ],
)
def test_bad_cluster_options_are_refused_on_construction(options, problem):
    """A RayCluster with a bad option is a ValueError naming it, before any Ray call."""
    with pytest.raises(ValueError, match=problem):
        RayCluster(**options)


def test_ray_is_the_default_cluster_and_others_are_refused():
    """``"ray"`` is RayCluster(); any other value is refused, naming what is taken."""
    assert as_cluster("ray") == RayCluster()
    with pytest.raises(ValueError, match="None, 'ray' or a RayCluster"):
        as_cluster("dask")


@pytest.mark.parametrize(
    "cluster, device, resources, want",
    [
        (RayCluster(), None, {"CPU": 2.0}, (2, 1, 0, "cpu")),
        (RayCluster(), None, {"CPU": 16.0, "GPU": 4.0}, (4, 1, 1, None)),
        (RayCluster(num_cpus=4), "cpu", {"CPU": 16.0, "GPU": 4.0}, (4, 4, 0, "cpu")),
        (RayCluster(actors=2, num_gpus=2), "cuda", {"CPU": 64.0, "GPU": 8.0}, (2, 1, 2, "cuda")),
        (RayCluster(num_gpus=0.5), None, {"CPU": 8.0, "GPU": 2.0}, (4, 1, 0.5, None)),
    ],
)
def test_actors_fill_the_cluster_at_their_resources(cluster, device, resources, want):
    """By default one actor per GPU (a CUDA or unset device on a cluster with GPUs), else
    per ``num_cpus`` CPUs; GPU-less actors of an unset device run on the CPU."""
    plan = plan_actors(cluster, device, resources)
    assert (plan.actors, plan.num_cpus, plan.num_gpus, plan.device) == want


@pytest.mark.parametrize(
    "cluster, device, resources, problem",
    [
        (RayCluster(), "cuda", {"CPU": 8.0}, "needs 1 GPU, but the Ray cluster has 8 CPU and 0"),
        (RayCluster(num_cpus=4), "cpu", {"CPU": 2.0}, "needs 4 CPU"),
        (RayCluster(num_gpus=0), "cuda:0", {"CPU": 8.0, "GPU": 1.0}, "num_gpus is 0"),
    ],
)
def test_actors_the_cluster_cannot_hold_are_refused(cluster, device, resources, problem):
    """An actor the cluster has not the resources for, or a CUDA device on GPU-less actors,
    is a ValueError saying what is missing."""
    with pytest.raises(ValueError, match=problem):
        plan_actors(cluster, device, resources)


def test_an_engine_object_cannot_run_on_a_cluster(tiny_llama):
    """A cluster builds an engine per actor from a name and a model every node reads: an
    engine object or a loaded module is refused before the traces are read."""
    from trace_replay.engines import make_engine

    with make_engine("prefill", tiny_llama) as engine:
        with pytest.raises(ValueError, match="engine as a name"):
            replay("no-such-file.jsonl", engine=engine, cluster="ray")
    with pytest.raises(ValueError, match="model as a folder or model name"):
        replay("no-such-file.jsonl", tiny_llama, engine="prefill", cluster="ray")


def test_missing_ray_names_the_extra():
    """Without Ray, a cluster run's ImportError says which extra to install."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from trace_replay.runs.cluster import import_ray\n"
        "try:\n    import_ray()\nexcept ImportError as error:\n    print(error)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install -e '.[ray]'" in out.stdout


@pytest.mark.slow
def test_a_cluster_started_for_a_run_is_shut_down_after_it():
    """connect() with no address and no connection starts a local cluster and shuts it down
    after the block; a cluster this process was connected to before stays connected."""
    ray = pytest.importorskip("ray")
    from trace_replay.runs.cluster import connect

    if ray.is_initialized():
        pytest.skip("this process is connected to a Ray cluster already")
    with connect(RayCluster()) as address:
        assert address == "local" and ray.is_initialized()
        with connect(RayCluster()):  # connected now: used, and left connected
            pass
        assert ray.is_initialized()
        with pytest.raises(ValueError, match="connected to a Ray cluster already"):
            with connect(RayCluster(address="auto")):
                pass
    assert not ray.is_initialized()
