"""Multi-node placement on simulated nodes of one machine (``ray.cluster_utils.Cluster``).

A head node (the driver and a rollout worker) and a train node, told apart by custom resources.
``ray.rollout_resources`` / ``ray.train_resources`` pin each worker kind to its node; the driver
joins through ``ray.address`` like on a real cluster. The disaggregated run trains the
single-process reference's losses, with its features crossing nodes over the p2p data plane.
Both nodes fork their workers from the suite's Ray zygote, as the session cluster does.
"""

import os
import sys

import pytest

from tests.conftest import forking_workers
from tests.helpers.ray_run import STEPS, assert_same_losses, make_cfg

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def cluster(_ray_zygote):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_register_timeout_seconds", "900")  # a starved box starts workers slowly
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")  # ... and registers its nodes slowly
    if ray.is_initialized():
        ray.shutdown()
    # Two nodes (each is a raylet + workers; a third only slows a loaded box): the head hosts the
    # driver and the rollout worker, the other node the train workers.
    # Both nodes' raylets start their workers as the session cluster's do: forked from the suite's zygote
    # (tests/conftest.py, _ray_zygote), ~1.5 CPU-s an actor against ~8 spawned on 2 busy cores.
    with forking_workers(_ray_zygote):
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"rollout_node": 1},
                                                          "include_dashboard": False})
    try:
        with forking_workers(_ray_zygote):
            nodes = {"rollout": c.head_node, "train": c.add_node(num_cpus=2, resources={"train_node": 2})}
        c.wait_for_nodes()
        yield c, {kind: node.node_id for kind, node in nodes.items()}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def _node_id(_actor=None) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def test_rollout_and_train_workers_on_their_nodes_train_the_reference(assets, reference, cluster, tmp_path):
    """The module docstring's run: each worker lands on its node, and the run trains the reference's losses.
    Over 30 s: a two-node Ray cluster of its own (two raylets and their agents) and three actors on it, beside
    the module's single-process reference."""
    import ray

    import specforge.ray_train as rt

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    c, node_of = cluster
    landed = {}
    real = rt.spawn_cluster

    def recording_spawn(cfg, data, use_gpu):
        placement = real(cfg, data, use_gpu)
        for group in (placement.rollout, placement.train):
            ids = ray.get([a.__ray_call__.remote(_node_id) for a in group.actors], timeout=60)
            landed.update(zip(group.labels, ids))
        return placement

    out = tmp_path / "multinode"
    cfg = make_cfg(assets, out, "placement.mode=disaggregated", "rollout.num_workers=1", "train.eval_every=2",
                   f"ray.address={c.address}", "ray.rollout_resources={rollout_node: 1}",
                   "ray.train_resources={train_node: 1}", "parallel.timeout_s=300")
    rt.spawn_cluster = recording_spawn
    try:
        path = rt.fit(cfg)
    finally:
        rt.spawn_cluster = real
    assert landed == {"rollout[0]": node_of["rollout"], "train[0]": node_of["train"], "train[1]": node_of["train"]}
    assert not ray.is_initialized()  # fit joined the cluster through ray.address and left it
    assert path.endswith(f"step-{STEPS:06d}")
    assert_same_losses(reference, out)
