"""The feature data plane end to end: Ray actors, one gloo communicator, tiny tensors.

Rank 0 is a rollout worker, ranks 1 and 2 are train workers. Workers return digests of what
they sent / received (small records), never tensors.
"""

import hashlib
import sys

import pytest
import torch
import torch.distributed as dist

from specforge.contracts import FeatureSpec, SampleRef, StepReport, assert_no_tensors
from specforge.runtime.actors import DistributedWorker, WorkerError, init_communicator, spawn_actors
from specforge.runtime.dataplane import (
    ObjectStoreTransport,
    P2PTransport,
    PendingRecv,
    Prefetcher,
    SendHandle,
    SendWindow,
    packed_layout,
    spawn_mailbox,
    synthetic_features,
)
from specforge.runtime.plan import plan_step

pytestmark = pytest.mark.timeout(600)
SPEC = FeatureSpec.hidden_states(hidden_size=8)
ROLLOUT, TRAIN = [0], [1, 2]


def _digest(t: torch.Tensor) -> str:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}{tuple(t.shape)}:{hashlib.sha256(raw).hexdigest()[:16]}"


def _transport(kind: str, rank: int, pack: bool = True):
    return P2PTransport(pack=pack) if kind == "p2p" else ObjectStoreTransport(rank=rank, timeout_s=60)


class Peer(DistributedWorker):
    def __init__(self):
        super().__init__(num_threads=1)

    def send(self, plans, kind, pack=True, seed=0):
        rank = dist.get_rank()
        transport, window, out = _transport(kind, rank, pack), SendWindow(max_inflight_bytes=1), []
        for plan in plans:
            lengths = dict(plan.lengths)
            feats = {sid: synthetic_features(SPEC, sid, lengths[sid], seed) for sid in plan.batch_of(rank)}
            handle = transport.send_step(plan, feats)
            window.push(handle)
            digests = {
                f"{plan.step}/{t.sample_id}/{t.dst_rank}/{name}": _digest(feats[t.sample_id][name][t.start : t.stop])
                for t in plan.sends_of(rank) for name in SPEC.names}
            out.append((StepReport(rank, plan.step, bytes_sent=handle.nbytes), digests))
        window.drain()
        return out

    def recv(self, plans, kind, pack=True):
        rank = dist.get_rank()
        transport, out = _transport(kind, rank, pack), []
        # Budget of one byte: still posts one step ahead (the minimum), exercising the queue.
        prefetcher, seen = Prefetcher(transport, plans, max_inflight_bytes=1), 0
        for plan, batches in prefetcher:
            digests = {f"{plan.step}/{sid}/{rank}/{name}": _digest(fb[name])
                       for sid, fb in batches.items() for name in fb}
            owned = {str(sid): float(fb.end - fb.start) for sid, fb in batches.items()}
            out.append((StepReport(rank, plan.step, metrics=owned, bytes_recv=prefetcher.bytes_recv - seen), digests))
            seen = prefetcher.bytes_recv
        return out

    def fail(self):
        raise RuntimeError("boom from inside the actor")


@pytest.fixture(scope="module")
def peers(ray_session):
    """Three actors joined in one communicator on the session's cluster (tests/conftest.py)."""
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    group = spawn_actors(Peer, 3, num_cpus=1, label="peer", timeout_s=300)
    group.labels = ["rollout[0]", "train[0]", "train[1]"]
    init_communicator(group.actors, group.labels, timeout_s=300)  # actor start-up is slow on a loaded box
    group.mailbox = spawn_mailbox()  # the driver owns it for the session
    yield group
    group.shutdown()
    ray.kill(group.mailbox)  # its name is free again for a later run on the session's cluster


def _run(group, plans, kind, pack=True):
    senders = [group.actors[r].send.remote(plans, kind, pack) for r in ROLLOUT]
    receivers = [group.actors[r].recv.remote(plans, kind, pack) for r in TRAIN]
    from specforge.runtime.actors import gather

    results = gather(senders + receivers, group.labels, timeout_s=180, what="transfer")
    for records in results:
        assert_no_tensors(records)
    sent = {k: v for records in results[: len(ROLLOUT)] for _, d in records for k, v in d.items()}
    received = {k: v for records in results[len(ROLLOUT):] for _, d in records for k, v in d.items()}
    reports = [r for records in results for r, _ in records]
    return sent, received, reports


def _dp_plans():
    groups = [[SampleRef(0, 7), SampleRef(1, 5)], [SampleRef(2, 9)]]
    step2 = [[SampleRef(3, 4)], [SampleRef(4, 6), SampleRef(5, 3)]]
    step3 = [[SampleRef(6, 8)], [SampleRef(7, 2)]]  # reuses step 1's recycled buffers
    return [plan_step(s, g, ROLLOUT, [[1], [2]], SPEC) for s, g in enumerate([groups, step2, step3])]


@pytest.mark.ray
def test_dp_steps_receivers_get_exactly_what_was_sent(peers):
    plans = _dp_plans()
    sent, received, reports = _run(peers, plans, "p2p")
    assert len(sent) == 8 * len(SPEC.names) and sent == received
    assert sum(r.bytes_sent for r in reports) == sum(r.bytes_recv for r in reports) > 0


@pytest.mark.ray
def test_sp_slices_with_halo_unpacked(peers):
    plans = [plan_step(s, [[SampleRef(10 + s, 9), SampleRef(20 + s, 4)]], ROLLOUT, [TRAIN], SPEC, halo=2)
             for s in range(2)]
    sent, received, reports = _run(peers, plans, "p2p", pack=False)
    assert sent == received
    owned = [r.metrics for r in reports if r.rank in TRAIN and r.step == 0]
    assert owned == [{"10": 5.0, "20": 2.0}, {"10": 4.0, "20": 2.0}]
    # rank 1 got [0, 7) of sample 10 (5 owned + 2 halo); rank 2 got [5, 9)
    assert received["0/10/1/aux_hidden"].startswith("torch.bfloat16(7, 24)")
    assert received["0/10/2/aux_hidden"].startswith("torch.bfloat16(4, 24)")


@pytest.mark.ray
def test_object_store_gives_the_same_result(peers):
    plans = _dp_plans()
    p2p = _run(peers, plans, "p2p")[1]
    sent, received, _ = _run(peers, plans, "object_store")
    assert sent == received == p2p


@pytest.mark.ray
def test_worker_error_names_the_actor(peers):
    from specforge.runtime.actors import gather

    with pytest.raises(WorkerError, match=r"(?s)fail failed on train\[1\].*boom from inside the actor"):
        gather([peers.actors[2].fail.remote()], ["train[1]"], timeout_s=30, what="fail")


# ------------------------------------------------------------- without Ray or a communicator


class _FakeTransport:
    """Records the order of posts and waits."""

    def __init__(self):
        self.log = []

    def resolve_rank(self, rank=None):
        return 1

    def post_recv(self, plan, my_rank=None):
        self.log.append(f"post {plan.step}")

        def finish():
            self.log.append(f"wait {plan.step}")
            return {}

        return PendingRecv(plan, finish, plan.recv_bytes(1))


def test_prefetcher_posts_next_step_before_handing_out_the_current_one():
    plans = [plan_step(s, [[SampleRef(s, 4)]], [0], [[1]], SPEC) for s in range(4)]
    step_bytes = plans[0].recv_bytes(1)
    fake = _FakeTransport()
    for plan, _ in Prefetcher(fake, plans, max_inflight_bytes=step_bytes):
        fake.log.append(f"compute {plan.step}")
    assert fake.log[:5] == ["post 0", "wait 0", "post 1", "compute 0", "wait 1"]
    assert fake.log[-2:] == ["wait 3", "compute 3"]
    fake = _FakeTransport()  # a budget of three steps keeps three posted
    next(iter(Prefetcher(fake, plans, max_inflight_bytes=3 * step_bytes)))
    assert fake.log == ["post 0", "post 1", "post 2", "wait 0", "post 3"]


def test_send_window_bounds_outstanding_sends():
    waited = []
    window = SendWindow(max_inflight_bytes=10)
    for i in range(4):
        window.push(SendHandle(lambda i=i: waited.append(i), nbytes=6))
    assert waited == [0, 1, 2] and window.inflight_bytes == 6
    window.drain()
    assert waited == [0, 1, 2, 3] and window.inflight_bytes == 0


def test_packed_layout_gives_aligned_typed_views():
    layout, total = packed_layout(SPEC, 5)
    buf = torch.zeros(total, dtype=torch.uint8)
    for field, offset, size in layout:
        assert offset % 8 == 0 and size == field.nbytes(5)
        view = buf[offset : offset + size].view(getattr(torch, field.dtype)).view(field.shape(5))
        assert view.data_ptr() == buf.data_ptr() + offset  # zero-copy


def test_auto_packing_switches_on_slice_size():
    from specforge.runtime.dataplane import PACK_BELOW_BYTES

    transport = P2PTransport(pack="auto")
    small = plan_step(0, [[SampleRef(0, 4)]], [0], [[1]], SPEC).transfers[0]
    large_len = PACK_BELOW_BYTES // SPEC.bytes_per_token() + 1
    large = plan_step(0, [[SampleRef(0, large_len)]], [0], [[1]], SPEC).transfers[0]
    assert transport._packs(SPEC, small) and not transport._packs(SPEC, large)
    with pytest.raises(ValueError, match="pack"):
        P2PTransport(pack="yes")


def test_buffer_pool_reuses_the_smallest_fitting_buffer():
    from specforge.runtime.dataplane import BufferPool

    pool = BufferPool(torch.device("cpu"), max_free=2)
    a, b = pool.take(100), pool.take(1000)
    assert a.numel() >= 100 and b.numel() >= 1000
    pool.give(b)
    pool.give(a)
    assert pool.take(50) is a and pool.take(900) is b
    pool.give(a), pool.give(b), pool.give(pool.take(5000))
    assert len(pool._free) == 2 and all(x is not a for x in pool._free)  # keeps the largest
