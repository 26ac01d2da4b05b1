"""benchmarks/syncs.py: the host-sync counter counts the device-to-host reads a GPU would make."""

import torch

from benchmarks.syncs import HostSyncs


def two_syncs(x, t):
    x.item()
    bool(t)


def no_sync(x, t):
    return (x * 2 + t.float()).sum() / x.numel()


def test_a_known_sync_counts_and_a_step_without_one_counts_nothing():
    x, t = torch.tensor(3.0), torch.tensor(True)
    with HostSyncs() as s:
        two_syncs(x, t)
    assert s.count == 2
    assert s.kinds == {"item / truth value": 2}
    with HostSyncs() as s:
        no_sync(x, t)
    assert s.count == 0


def test_each_kind_of_read_counts_once():
    x = torch.arange(6.0)
    reads = {
        ".tolist()": lambda: x.tolist(),
        ".cpu()": lambda: x.cpu(),
        '.to("cpu")': lambda: x.to("cpu"),
        ".numpy()": lambda: x.numpy(),
        "item / truth value": lambda: float(x.sum()),
        "nonzero": lambda: x.nonzero(),
        "boolean-mask index": lambda: x[x > 2],
        "masked_select": lambda: x.masked_select(x > 2),
    }
    for kind, read in reads.items():
        with HostSyncs() as s:
            read()
        assert (s.count, dict(s.kinds)) == (1, {kind: 1}), kind


def test_reads_of_host_tensors_and_device_side_work_are_free():
    x = torch.randn(4, 3, requires_grad=True)
    idx = torch.tensor([0, 2])
    with HostSyncs() as s:
        host = x.detach().cpu()  # the one read
        host[0, 0].item(), host.tolist(), bool(host.sum() > 0)  # reads of the host copy: free
        loss = (x[idx] ** 2).sum() + x.to(x.device).mean()  # integer index, .to(the device): no read
        loss.backward()
    assert s.count == 1 and s.kinds == {".cpu()": 1}
    step = torch.tensor(5.0)
    with HostSyncs() as s:
        s.mark_host(step)
        (step + 1).item()  # a host tensor (an optimizer's step counter) and what is computed from it
        torch.tensor([2.0]).item(), torch.zeros(2, device="cpu").sum().item()  # made on the host
    assert s.count == 0
    with HostSyncs() as s:
        torch.tensor([2.0], device=x.device).item()  # made on the device (x's): a read
    assert s.count == 1


def test_the_counter_leaves_torch_as_it_was():
    methods = (torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.tolist, torch.Tensor.numpy, torch.tensor, torch.zeros)
    with HostSyncs():
        pass
    assert (torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.tolist, torch.Tensor.numpy, torch.tensor,
            torch.zeros) == methods


class FloatNormalizer:
    """The bound algorithm with the old normalizer hook: a Python float (one host read per micro-batch)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def normalizer(self, draft, batch, step, *, training):
        return float(self.inner.normalizer(draft, batch, step, training=training))


def test_an_eagle3_train_step_reads_the_device_once_per_micro_batch_and_once_at_its_end():
    """DraftTrainer.step over two micro-batches: the loss's one read of its sizes per micro-batch
    (``_step_rows``), the step's one copy of counters and gradient norm; the loss denominator is
    summed, reduced and divided on the device. Control: a normalizer hook that returns a Python
    float reads the device once more per micro-batch, and the counter sees it."""
    from benchmarks.launches import optimizer_steps
    from tests.helpers.trainer import feature_batch, setup_trainer

    target, rows, trainer = setup_trainer(seed=0)
    b = feature_batch(target, rows)

    def counted_step():
        with HostSyncs() as s:
            s.mark_host(b.length_B, *optimizer_steps(trainer.optimizer))  # host metadata, host counters
            trainer.step([b, b])
        return s

    trainer.step([b, b])  # AdamW's state exists from here on
    s = counted_step()
    assert (s.count, dict(s.kinds)) == (3, {".tolist()": 2, ".cpu()": 1}), s.where
    trainer.algorithm = FloatNormalizer(trainer.algorithm)
    s = counted_step()
    assert (s.count, s.kinds["item / truth value"]) == (5, 2), s.where


class _FakeEvent:
    """CUDA's event, as far as ``StageClock`` uses it: a "device" time set at record, and a log of waits."""

    now = 0.0
    waits: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        self.t = _FakeEvent.now

    def synchronize(self):
        _FakeEvent.waits.append(self.t)

    def elapsed_time(self, end):
        return end.t - self.t


def test_stage_clock_waits_only_when_read_and_only_for_the_later_mark():
    """A step's timers (``device.StageClock``) never wait at a mark: on CUDA each mark is an event and
    the report waits for the later one once, when it reads the time. Control: the host clock on the
    CPU measures the same span."""
    import time

    from specforge.device import StageClock

    _FakeEvent.waits = []
    clock = StageClock(torch.device("cpu"), event=_FakeEvent)
    _FakeEvent.now = 10.0
    clock.mark("start")
    _FakeEvent.now = 17.5
    clock.mark("forward")
    assert _FakeEvent.waits == []  # marking waits for nothing
    assert clock.ms("start", "forward") == 7.5 and _FakeEvent.waits == [17.5]
    host = StageClock(torch.device("cpu"))
    host.mark("a")
    time.sleep(0.02)
    host.mark("b")
    assert 15 <= host.ms("a", "b") < 2000
