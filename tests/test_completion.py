"""NCCL's completion semantics, modelled on CPU (runtime/completion.py), and the data plane's
device check.

Under NCCL ``Work.wait()`` returns at once (it only orders the CUDA stream), a transfer shows it
finished only through ``is_completed()`` or a sync, and a receive whose peer died never fails.
``Completion(emulate=True)`` gives gloo those semantics; these tests pin them down, show that
the emulation catches code that trusts a blocking ``wait()`` (the negative control), and that the
data plane's own waits (``finish``) still see finished transfers, an abort and a timeout.
"""

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from specforge.contracts import FeatureSpec, SampleRef
from specforge.parallel.launch import run_ranks
from specforge.runtime.completion import Completion, PeerLost, StreamWork
from specforge.runtime.dataplane import P2PTransport, synthetic_features, wire_features
from specforge.runtime.plan import plan_step

SPEC = FeatureSpec.hidden_states(hidden_size=8)
BOUND_S = 2.0  # what "at once" may take on a loaded machine; the waits below that must not block stay under it
FALLBACK_S = 30.0  # rank 0 sends unasked after this: a wait that blocks (a defect) then ends, and fails its check


def _recv_post(completion: Completion):
    buf = torch.zeros(4)
    return buf, completion.post([dist.P2POp(dist.irecv, buf, peer=0)])


def _go(marks: str, i: int) -> None:
    """Rank 1 lets rank 0 send its ``i``-th tensor: at the moment the step needs it (after an abort or a
    timeout the receive is still posted, and that send lands in it), not after a fixed delay."""
    Path(marks, f"go{i}").touch()


def _send_when_told(marks: str, i: int) -> None:
    deadline = time.monotonic() + FALLBACK_S
    while not Path(marks, f"go{i}").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    dist.send(torch.arange(1.0, 5.0), dst=1)


def _semantics(rank, world, marks):
    if rank == 0:
        for i in range(7):
            _send_when_told(marks, i)
        return
    posted = []  # every receive posted here: each is completed by one of rank 0's 7 sends before the group goes
    # 1. emulated: wait() returns at once and the buffer is not there yet (as under NCCL): rank 0 has not sent
    c = Completion(stream=False, timeout_s=30, emulate=True)
    buf, works = _recv_post(c)
    t0 = time.monotonic()
    for w in works:
        w.wait()
    assert time.monotonic() - t0 < 0.2 * BOUND_S, "an emulated wait blocked"
    assert not any(w.is_completed() for w in works)
    assert torch.equal(buf, torch.zeros(4))  # what code that trusts wait() alone would read
    _go(marks, 0)
    c.finish(works, "recv 1")  # the data plane's wait: polls completion
    assert torch.equal(buf, torch.arange(1.0, 5.0)) and all(w.is_completed() for w in works)

    # 2. negative control: gloo's own wait blocks (the send comes 0.1 s after it began), so the same reading
    # code sees the data there
    buf, works = _recv_post(Completion(stream=False, timeout_s=30, emulate=False))
    threading.Timer(0.1, _go, args=(marks, 1)).start()
    for w in works:
        w.wait()
    assert torch.equal(buf, torch.arange(1.0, 5.0))

    # 3. the driver's abort (from another thread, as a Ray control method) ends a pending finish
    c = Completion(stream=False, timeout_s=30, emulate=True)
    buf, works = _recv_post(c)
    posted += works
    threading.Timer(0.2, c.abort, args=("rollout worker rollout[0] died",)).start()
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match=r"recv 3: rollout worker rollout\[0\] died"):
        c.finish(works, "recv 3")
    assert time.monotonic() - t0 < BOUND_S and c.aborted
    c.finish([], "nothing pending")  # an abort fails only what is not complete
    _go(marks, 2)

    # 4. no abort: parallel.timeout_s bounds the wait
    c = Completion(stream=False, timeout_s=0.3, emulate=True)
    buf, works = _recv_post(c)
    posted += works
    with pytest.raises(PeerLost, match=r"recv 4: not completed within parallel.timeout_s=0.3 s"):
        c.finish(works, "recv 4")
    _go(marks, 3)

    # 5. gloo's own semantics (no emulation): finish returns with the data, and an abort ends a wait
    # that gloo's blocking wait would have held until the peer sent or died
    c = Completion(stream=False, timeout_s=30, emulate=False)
    buf, works = _recv_post(c)
    _go(marks, 4)
    c.finish(works, "recv 5")
    assert torch.equal(buf, torch.arange(1.0, 5.0))
    for i, emulate in ((5, False), (6, True)):  # 6, 7: one abort wakes every waiter of the process at once
        c = Completion(stream=False, timeout_s=30, emulate=emulate)
        works = _recv_post(c)[1]
        posted += works
        raised: list = []

        def wait(works, c=c):
            try:
                c.finish(works, "a waiter")
            except PeerLost as e:
                raised.append((time.monotonic(), str(e)))

        waiters = [threading.Thread(target=wait, args=(works,)) for _ in range(3)]
        for t in waiters:
            t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        c.abort("rollout worker rollout[0] failed")
        for t in waiters:  # a late waiter is still counted (and fails the bound) rather than missed
            t.join(5 * BOUND_S)
        assert len(raised) == 3, (emulate, raised)
        assert all(at - t0 < BOUND_S and "rollout[0] failed" in why for at, why in raised), (emulate, raised)
        _go(marks, i)
    deadline = time.monotonic() + FALLBACK_S  # rank 0's last sends land before the group goes
    while not all(w.is_completed() for w in posted) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(w.is_completed() for w in posted), "a send of rank 0 never reached its receive"


def test_emulated_nccl_completion(tmp_path):
    (marks := tmp_path / "marks").mkdir()
    run_ranks(_semantics, 2, str(marks), workdir=tmp_path, backend="gloo", timeout_s=120)


def test_a_failed_post_never_completes_and_never_raises():
    """A receive gloo refuses at once (its peer already gone) behaves as NCCL's: never complete."""
    c = Completion(stream=False, timeout_s=0.2, emulate=True)
    w = StreamWork(None, RuntimeError("connection closed by peer"))
    assert w.wait() is True and not w.is_completed()
    with pytest.raises(PeerLost, match="not completed within"):
        c.finish([w], "recv")


def test_a_tensor_off_the_communicators_device_is_refused():
    """The negative control of the device check: a field on another device (``meta`` here, as a
    CPU ``input_ids`` would be beside CUDA features) is refused, naming sample, field and devices,
    before anything is posted; the same features made by ``wire_features`` pass it."""
    plan = plan_step(0, [[SampleRef(0, 5)]], [0], [[1]], SPEC)
    transport = P2PTransport(device=torch.device("cpu"))
    feats = synthetic_features(SPEC, 0, 5, seed=0)
    bad = {**feats, "loss_mask": feats["loss_mask"].to("meta")}
    with pytest.raises(ValueError,
                       match=r"sample 0 field 'loss_mask' is on meta, the data plane's communicator on cpu"):
        transport.send_step(plan, {0: bad}, my_rank=0)
    assert transport.bytes_sent == 0

    # wire_features puts every field, CPU ids and masks included, on the transport's device
    fields = {name: feats[name].unsqueeze(0) for name in SPEC.names}
    fields["input_ids"] = fields["input_ids"].to("meta")
    (wired,) = wire_features(SPEC, fields, [5], torch.device("meta"))
    assert {t.device.type for t in wired.values()} == {"meta"}
    assert all(str(t.dtype) == f"torch.{f.dtype}" for f, t in zip(SPEC.fields, (wired[n] for n in SPEC.names)))


def test_the_cpu_suite_forces_the_cpu():
    """tests/conftest.py sets SPECFORGE_DEVICE=cpu: ``auto`` means CPU and gloo even with CUDA
    present, and Ray workers get the switch (``worker_env``); without it, CUDA would be picked."""
    from unittest import mock

    from specforge import device

    assert device.worker_env().get(device.FORCE_ENV) == "cpu"
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert device.pick_device("auto").type == "cpu" and not device.wants_gpu("auto", cluster_gpus=8)
        with mock.patch.dict("os.environ", {device.FORCE_ENV: ""}):  # negative control
            assert device.cuda_allowed() and device.wants_gpu("auto", cluster_gpus=8)
            assert not device.wants_gpu("auto", cluster_gpus=0) and not device.wants_gpu("cpu", cluster_gpus=8)


def test_the_completion_of_a_group_follows_its_backend(monkeypatch):
    """NCCL: its own semantics, never the emulation (whose watcher would call NCCL's non-blocking
    wait() and mark a pending work complete); gloo: emulated only under SPECFORGE_EMULATE_NCCL=1."""
    from specforge.device import EMULATE_NCCL_ENV

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for backend, env, want in (("nccl", "1", (True, False)), ("nccl", None, (True, False)),
                               ("gloo", "1", (True, True)), ("gloo", None, (False, False))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        if env:
            monkeypatch.setenv(EMULATE_NCCL_ENV, env)
        else:
            monkeypatch.delenv(EMULATE_NCCL_ENV, raising=False)
        c = Completion.for_group(timeout_s=5)
        assert (c.stream, c.emulate) == want, (backend, env)
