"""The failure tests' disaggregated run and the worker killer (from tests/test_failures.py, which
tests/test_gpu.py shares for its NCCL run)."""

import contextlib
import os
import signal

from tests.helpers.plan import planner
from tests.helpers.ray_run import make_cfg

STEPS = 6


def failure_cfg(assets, out, *extra):
    # an in-flight budget of two of the largest steps: few plans at a time, so a worker killed after
    # step k has steps left to do
    common = ["placement.mode=disaggregated", "rollout.num_workers=1", f"train.max_steps={STEPS}",
              "checkpoint.every_steps=2", "checkpoint.keep_last=0", "checkpoint.resume=true"]
    largest = planner(make_cfg(assets, out, *common), train_ranks=(1, 2)).largest_step_bytes()
    return make_cfg(assets, out, *common, f"placement.max_inflight_mb={2 * largest / 2**20}", *extra)


@contextlib.contextmanager
def killing(group: str, index: int, after_step: int):
    """SIGKILL actor ``index`` of the first placement's ``group`` ("rollout"/"train") once the driver
    has collected train step ``after_step`` (once: a recovered run collects it again); yields the placements
    spawned meanwhile."""
    import ray

    import specforge.ray_train as rt

    spawned, real_spawn, real_collect = [], rt.spawn_cluster, rt.Cluster.collect

    def spawn(*args, **kw):
        cluster = real_spawn(*args, **kw)
        pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in getattr(cluster, group).actors],
                       timeout=60)
        spawned.append((cluster, pids))
        return cluster

    def collect(self, handle, what):
        out = real_collect(self, handle, what)
        first, pids = spawned[0]
        if self is first and what == f"train step {after_step}" and len(spawned) == 1:
            os.kill(pids[index], signal.SIGKILL)
        return out

    rt.spawn_cluster, rt.Cluster.collect = spawn, collect
    try:
        yield spawned
    finally:
        rt.spawn_cluster, rt.Cluster.collect = real_spawn, real_collect
