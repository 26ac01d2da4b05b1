"""Spawn Ray actor groups and join them into one torch.distributed communicator.

    workers = spawn_actors(TrainWorker, 2, num_cpus=1, num_gpus=0, label="train")
    rollout = spawn_actors(RolloutWorker, 1, label="rollout")
    init_communicator(rollout.actors + workers.actors, labels=rollout.labels + workers.labels)

Actor classes inherit ``DistributedWorker`` for the few methods the setup needs. Every wait on
a remote call goes through ``gather``, which has a timeout and names the actor that failed
(Ray's error carries the remote traceback; we prepend which actor it was).

A method marked ``@control`` runs in the actor's own control thread, beside a busy step: how
the driver tells a train worker blocked on a dead peer's transfer to give up (``peer_lost``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import psutil
import ray
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.distributed.distributed_c10d import _abort_process_group

from specforge import device, failpoints
from specforge.children import REAP_GRACE_S, reaper, stop
from specforge.config import Config
from specforge.environment import env_defaults

CONTROL = "control"  # the concurrency group of an actor's control methods (one thread)


def control(method):
    """Run this actor method in the control thread, even while another method is running."""
    return ray.method(concurrency_group=CONTROL)(method)


def has_control(actor_cls) -> bool:
    """Whether ``actor_cls`` has ``@control`` methods (only then does its actor get the control thread)."""
    return any(getattr(getattr(actor_cls, name, None), "__ray_concurrency_group__", None) == CONTROL
               for name in dir(actor_cls))


class WorkerError(RuntimeError):
    """A remote call failed or timed out; the message names the actor (``label``, when one failed).
    ``cause`` is the exception the actor raised (None for a timeout or a dead actor)."""

    def __init__(self, message: str, label: Optional[str] = None, cause: Optional[BaseException] = None):
        super().__init__(message)
        self.label, self.cause = label, cause


class ActorDied(WorkerError):
    """The actor's process is gone (killed, crashed, its node lost): nothing it held survives."""


class DistributedWorker:
    """Mixin for Ray actor classes that join the data-plane communicator."""

    def __init__(self, num_threads: Optional[int] = None):
        device.set_threads(num_threads)  # Ray sets OMP_NUM_THREADS=1 in actors

    def node_address(self) -> str:
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def resolve_backend(self, choice: str = "auto") -> str:
        return device.pick_backend(choice, device.pick_device())

    def join_communicator(self, rank: int, world_size: int, init_method: str, backend: str, timeout_s: float) -> int:
        here = device.pick_device()
        device.init_process_group(rank, world_size, init_method, backend, timeout_s, here)  # binds the GPU
        device.barrier(here)  # first call involves every rank (NCCL wants that before batched p2p)
        return rank

    def leave_communicator(self) -> None:
        """Leave the communicator. After a lost peer a transfer may still be pending on it (NCCL
        never fails it): abort the communicator then, a plain destroy could wait on it forever."""
        if not dist.is_initialized():
            return
        if self.peer_was_lost() and dist.get_backend() == "nccl":  # gloo's transfers with a dead peer failed already

            _abort_process_group()
        else:
            dist.destroy_process_group()

    def peer_was_lost(self) -> bool:
        return False


@dataclass
class ActorGroup:
    actors: list
    labels: list[str]
    placement_group: Optional[PlacementGroup] = None
    timeout_s: float = 300.0

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
        self.actors, self.placement_group = [], None  # shut down once


def gather(refs: Sequence, labels: Sequence[str], timeout_s: float, what: str = "call") -> list:
    """``ray.get`` every ref within ``timeout_s``; fail fast on the first error, naming its actor."""
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
        if not ready:
            names = ", ".join(labels[index[r]] for r in pending)
            raise WorkerError(f"{what}: {names} did not finish within {timeout_s:.0f} s")
        for ref in ready:
            i = index[ref]
            try:
                results[i] = ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
            except ray.exceptions.RayError as err:
                raise most_telling(worker_error(err, labels[i], what), pending, index, labels, what) from err
    return results


SIBLINGS_S = 2.0  # how long a failed group call waits for its siblings' failures before it is told
TOLD_IN_ONE_LINE = (ValueError, OSError)  # a user mistake or a file problem: the message says what to fix


def says_the_fix(e: WorkerError) -> bool:
    """Whether an actor's failure says what the user fixes (its cause's message, in one line)."""
    return not isinstance(e, ActorDied) and isinstance(e.cause, TOLD_IN_ONE_LINE)


def most_telling(first: WorkerError, pending: Sequence, index: dict, labels: Sequence[str], what: str) -> WorkerError:
    """The failure to tell of a group call: ranks that agree to stop (a collective's flag) fail together,
    and only the rank whose own input was bad (a ValueError or OSError: a corrupt store shard) can say
    what the user fixes; the others know only that a rank failed. So unless the first failure is already
    that, or an actor's death, its siblings' failures are waited for (``SIBLINGS_S``) and the first of
    that kind among them is told instead."""
    if isinstance(first, ActorDied) or says_the_fix(first) or not pending:
        return first
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=SIBLINGS_S)
    for ref in ready:
        try:
            ray.get(ref, timeout=1.0)
        except ray.exceptions.RayError as err:
            if says_the_fix(sibling := worker_error(err, labels[index[ref]], what)):
                return sibling
    return first


def worker_error(err: "ray.exceptions.RayError", label: str, what: str) -> WorkerError:
    """``err`` as a ``WorkerError`` naming ``label``: ``ActorDied`` when its process is gone; a
    user mistake (ValueError) or a file problem (OSError) in one line, without the remote traceback."""
    if isinstance(err, ray.exceptions.RayActorError):
        return ActorDied(f"{what}: {label} died ({type(err).__name__})", label)
    cause = getattr(err, "cause", None)
    if isinstance(cause, TOLD_IN_ONE_LINE):
        return WorkerError(f"{what} failed on {label}: {cause}", label, cause)
    return WorkerError(f"{what} failed on {label}:\n{err}", label, cause)


def dead_actors(group: "ActorGroup", wait_s: float = 5.0) -> list[str]:
    """Labels of the actors of ``group`` whose process is gone. A call to a dead actor fails at
    once; a live one may be busy (its answer is not waited for beyond ``wait_s``)."""
    refs = [a.node_address.remote() for a in group.actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    dead = []
    for label, ref in zip(group.labels, refs):
        if ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                dead.append(label)
    return dead


def spawn_actors(
    actor_cls,
    num: int,
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    label: str = "worker",
    args: tuple = (),
    kwargs: Optional[dict] = None,
    strategy: str = "PACK",
    timeout_s: float = 300.0,
    runtime_env: Optional[dict] = None,
    resources: Optional[dict[str, float]] = None,
) -> ActorGroup:
    """Start ``num`` actors of ``actor_cls``, one per bundle of a placement group with
    ``num_cpus`` CPUs (+ ``num_gpus`` GPUs when > 0, + custom ``resources``, which pin the bundles
    to nodes that have them) each. Actor i is labelled ``label[i]``."""
    if num < 1 or num_cpus <= 0:
        raise ValueError(f"spawn_actors: need num >= 1 and num_cpus > 0, got {num}, {num_cpus}")
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus > 0 else {}), **(resources or {})}
    pg = placement_group([dict(bundle) for _ in range(num)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as err:
        remove_placement_group(pg)
        raise WorkerError(f"placement group for {num} x {label} {bundle} not ready within {timeout_s:.0f} s "
                          f"(the cluster has {ray.available_resources()})") from err
    if isinstance(actor_cls, ray.actor.ActorClass):
        remote_cls = actor_cls
    elif has_control(actor_cls):
        remote_cls = ray.remote(concurrency_groups={CONTROL: 1})(actor_cls)
    else:
        remote_cls = ray.remote(actor_cls)
    # our switches reach the workers: through a runtime environment where the cluster's processes did not
    # inherit them from us (a runtime environment costs each worker Ray's setup_worker.py, ~0.3 CPU-s)
    if env := not_inherited({**device.worker_env(), **failpoints.worker_env()}):
        runtime_env = {**(runtime_env or {}), "env_vars": {**(runtime_env or {}).get("env_vars", {}), **env}}
    options = {"num_cpus": num_cpus, "num_gpus": num_gpus, **({"runtime_env": runtime_env} if runtime_env else {})}
    actors = [
        remote_cls.options(
            **options,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(*args, **(kwargs or {}))
        for i in range(num)
    ]
    return ActorGroup(actors, [f"{label}[{i}]" for i in range(num)], pg, timeout_s)


def init_communicator(
    actors: Sequence,
    labels: Sequence[str],
    backend: str = "auto",
    timeout_s: float = 300.0,
) -> str:
    """Join ``actors`` (in rank order) into one default process group, rendezvous on a free
    port of the first actor's node. Returns the backend used (chosen once, by rank 0)."""
    first = actors[0]
    addr, port, backend = gather(
        [first.node_address.remote(), first.free_port.remote(), first.resolve_backend.remote(backend)],
        [labels[0]] * 3, timeout_s, what="rendezvous",
    )
    init_method = f"tcp://{addr}:{port}"
    refs = [a.join_communicator.remote(r, len(actors), init_method, backend, timeout_s) for r, a in enumerate(actors)]
    gather(refs, labels, timeout_s + 30, what="join_communicator")
    return backend


# ---------------------------------------------------------------- joining or starting Ray


def check_ray_address(address: Optional[str], timeout_s: float) -> None:
    """A ``ray.address`` of host:port must answer a TCP connect within ``timeout_s``: Ray itself
    retries a dead address for minutes, printing warnings. (``auto`` is resolved, and refused
    when no cluster runs, by Ray at once.)"""
    if not address or address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"config key 'ray.address'={address!r} must be 'auto' or host:port of the Ray head, "
                         "e.g. 10.0.0.1:6379")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"config key 'ray.address'={address!r}: no Ray head answers there within {timeout_s:g} s "
                         f"({e.strerror or e}); start one (ray start --head --port={port}) "
                         "or fix the address") from None


# What Ray starts with where the caller's environment says nothing (for ray.init alone: Ray reads it there
# and the processes it starts inherit it; specforge/environment.py): no token authentication (Ray 2.5x
# turns it on for a new local cluster, writing a token file and RAY_AUTH_MODE=token into the process); no
# workers started ahead (Ray starts idle Python workers when the first driver connects, one a core here, ~0.7
# CPU-s each to import Ray: an actor without a runtime environment of its own may take one, one with it never
# does, and on a machine with more cores than the run has actors the rest stay idle for the whole run;
# tests/test_caller_state.py counts them beside two actors. Starting one when it is asked for costs the same).
RAY_START_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_prestart_worker_first_driver": "0"}
# What the workers get where the caller's environment says nothing: one tokenizer thread each (the actors
# of a machine share its cores). Our own cluster inherits it from this process at its start, a joined one
# through the job's runtime environment.
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false"}

# The environment the processes of the cluster this driver started inherited from it, with the cluster's
# GCS address: (address, environment), or None. A worker spawned there gets no runtime environment for what
# it already has: with one, Ray starts each worker through its setup_worker.py (a Python process importing
# Ray, ~0.3 CPU-s and ~0.3 s more a worker) instead of starting it directly.
_INHERITED: Optional[tuple[str, dict[str, str]]] = None


def note_inherited(env: Optional[dict[str, str]]) -> None:
    """Record that the cluster this driver is connected to now started here with ``env`` (None: forget).
    ``start_ray`` calls it; so does a test suite that starts its own cluster with ``ray.init``."""
    global _INHERITED
    _INHERITED = None if env is None else (ray.get_runtime_context().gcs_address, dict(env))


def not_inherited(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` the connected cluster's workers do not already have from this process."""
    if _INHERITED is None or not ray.is_initialized() or ray.get_runtime_context().gcs_address != _INHERITED[0]:
        return dict(env)
    return {k: v for k, v in env.items() if _INHERITED[1].get(k) != v}


def start_ray(cfg: Config, num_actors: int, on_head_lost: Optional[Callable[[str], None]] = None) -> bool:
    """Join or start Ray; True if we started it (and so must shut it down). The workers' environment
    (``WORKER_ENV``, our switches) goes through Ray: a joined cluster's through the job's runtime
    environment, our own cluster's set for ``ray.init`` alone (its processes inherit it), never left in
    this process' ``os.environ``. ``on_head_lost(what)`` is
    called (from a watcher thread) if the cluster's head goes while it runs (``HeadWatch``), until
    ``shutdown_ray``."""
    if ray.is_initialized():
        return False
    if cfg.ray.address:
        with env_defaults(RAY_START_ENV):
            check_ray_address(cfg.ray.address, cfg.parallel.timeout_s)
            ray.init(address=cfg.ray.address, runtime_env={"env_vars": WORKER_ENV})
        note_inherited(None)
    else:  # our own cluster ("local": never one another job started here), one CPU per actor bundle,
        # oversubscribed if the machine has fewer cores; its processes inherit WORKER_ENV from here
        num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, num_actors + 1)
        with env_defaults({**RAY_START_ENV, **WORKER_ENV}):
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     _temp_dir=cfg.ray.temp_dir or f"/tmp/sfray-{os.getuid()}")
            note_inherited(dict(os.environ))
        global _REAPER
        # its processes (GCS, raylet, their agents; the raylet's workers go with it) are this process'
        # children: they end with it even if it is SIGKILLed (children.reaper). The signal follows the
        # starting thread: only from the main thread, which outlives the cluster.
        if threading.current_thread() is threading.main_thread():
            _REAPER = reaper(ray_processes())
    if on_head_lost is not None:
        global _WATCH
        _WATCH = HeadWatch(on_head_lost, own=not cfg.ray.address)
    return True


def ray_processes() -> list[int]:
    """This process' children that are Ray's: the GCS, the raylet and the Python daemons Ray runs."""
    def ours(p) -> bool:
        return any(k in " ".join(_cmdline(p)) for k in ("gcs_server", "raylet", "/ray/"))

    return [p.pid for p in psutil.Process().children() if ours(p)]


_REAPER = None  # the reaper of the cluster start_ray started, until shutdown_ray
_WATCH = None  # the watch on its head, until shutdown_ray


def shutdown_ray() -> None:
    """End the Ray cluster ``start_ray`` started (or leave the one it joined), its head's watch and its reaper."""
    global _REAPER, _WATCH
    if _WATCH is not None:  # first: the orderly end of the head is not its loss
        _WATCH.stop()
        _WATCH = None
    ray.shutdown()
    note_inherited(None)
    if _REAPER is not None:
        stop(_REAPER)
        _REAPER = None


# A joined cluster's head may come back (GCS fault tolerance): it is lost once unreachable this long, short of
# the time after which Ray itself ends the driver (RAY_gcs_rpc_server_reconnect_timeout_s, 60 s by default).
RAY_GCS_RECONNECT_S = 60.0
HEAD_POLL_S = 1.0


class HeadWatch:
    """Calls ``on_lost(what)`` once, from a daemon thread, when the Ray head goes while the driver runs. Without
    it Ray's core worker ends the driver itself 60 s later with a C++ log line (``Failed to connect to GCS``),
    while the train workers go on for that minute. Our own cluster (``own``): its GCS and raylet are this
    process' children, lost the moment either exits (no fault-tolerant GCS without Redis). A joined cluster:
    its GCS address refuses connections for ``grace_s`` (default: Ray's reconnect timeout less 10 s)."""

    def __init__(self, on_lost: Callable[[str], None], own: bool, grace_s: Optional[float] = None,
                 poll_s: float = HEAD_POLL_S, address: Optional[str] = None):
        self.on_lost, self.poll_s = on_lost, poll_s
        reconnect = float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", RAY_GCS_RECONNECT_S))
        self.grace_s = max(reconnect - 10.0, 1.0) if grace_s is None else grace_s
        self.heads = [(p, role) for p in psutil.Process().children() if own
                      for role in ("gcs_server", "raylet") if role in " ".join(_cmdline(p))]
        self.address = None if own else (address or ray.get_runtime_context().gcs_address)
        self._down_since: Optional[float] = None  # when a joined head began to refuse connections
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-head-watch", daemon=True)
        self._thread.start()

    def lost(self) -> Optional[str]:
        """What is gone now, or None (a joined head that refuses connections counts once ``grace_s`` passed)."""
        for p, role in self.heads:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                pass
            return f"its {'GCS' if role == 'gcs_server' else role} process {p.pid} exited"
        if self.address is None:
            return None
        host, _, port = self.address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=self.poll_s).close()
            self._down_since = None
            return None
        except OSError as e:
            since = self._down_since = self._down_since or time.monotonic()
            if time.monotonic() - since < self.grace_s:
                return None
            return f"its GCS at {self.address} refused connections for {self.grace_s:.0f} s ({e.strerror or e})"

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if (what := self.lost()) is not None:
                if not self._stop.is_set():
                    self.on_lost(what)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.poll_s + 5)


def exit_on_head_lost(kept: Callable[[], str]) -> Callable[[str], None]:
    """An ``on_head_lost`` for an entry point: one ``error:`` line naming what went and what is kept (``kept()``:
    e.g. the last good checkpoint and the command that resumes), then this process ends (exit status 1) as Ray
    would end it a minute later: every remote call would fail or hang meanwhile. Our own cluster's remaining
    processes go with it (the reaper)."""
    def lost(what: str) -> None:
        try:
            if _REAPER is not None:  # our cluster's processes go first: a save that lands meanwhile is counted
                _REAPER.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    _REAPER.wait(timeout=2 * REAP_GRACE_S + 5)
            # on a line of its own (after a progress bar's)
            print(f"\nerror: the Ray head was lost ({what}): the run stopped; {kept()}", file=sys.stderr, flush=True)
        finally:
            os._exit(1)

    return lost


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []
