"""The feature data plane: execute a ``StepPlan``'s transfers between rollout and train ranks.

``P2PTransport`` is the real one: torch.distributed ``isend``/``irecv`` in the one communicator
that spans rollout and train ranks (built by ``runtime/actors.py``; NCCL on GPUs, gloo on CPU).
Both ends walk the same ordered ``plan.transfers``, so messages between a pair of ranks match
in order; each message also carries a tag derived from (step, index) so a mismatch fails loudly
on gloo instead of delivering the wrong bytes. The receiver knows every shape from the plan, so
it can post step k+1's receives before computing step k (``Prefetcher``).

``ObjectStoreTransport`` has the same interface over ``ray.put``/``ray.get``: a baseline for the
benchmark, not for the hot path.

Layout: a (sample, destination) slice below ``PACK_BELOW_BYTES`` is packed into one byte
buffer (one message instead of five; the receiver gets zero-copy typed views into it); a larger
one goes field by field, where the sender's packing copy costs more than the per-message
overhead it saves. ``benchmarks/bench_transfer.py`` on gloo, with pooled buffers: packed
1.4-2x faster at 128-512 KiB slices, even at 1-2 MiB, per-field ~1.2x faster at 8 MiB.
Both ends must use the same ``pack`` setting: the choice is a pure function of the slice size.
All of a rank's slices in a step share one buffer taken from a ``BufferPool``.

Devices: every tensor of a transfer lives on the transport's device (NCCL takes CUDA tensors only,
gloo CPU ones; one CPU tensor in an NCCL batch fails), and ``send_step`` refuses one that does not,
naming the field and both devices. Completion: ``runtime/completion.py`` (``wait()`` never blocks
on NCCL; a receive from a dead peer never fails there).

In-flight accounting: every transport records into its process's ``InflightLog`` (``INFLIGHT``)
when a rank posts a step's sends (+ feature bytes) and when a rank's receives of a step are
handed to the train step (- feature bytes). ``inflight_peak`` merges the logs of every rank: the
high-water mark of feature bytes sent but not yet consumed, which ``placement.max_inflight_mb``
bounds (``tests/test_memory_bound.py``, ``benchmarks/soak.py``).
"""

from __future__ import annotations

import asyncio
import collections
import time
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from specforge import device as device_mod
from specforge.contracts import FeatureField, FeatureSpec, StepPlan, Transfer
from specforge.device import torch_dtype
from specforge.runtime.completion import Completion

Features = Mapping[str, torch.Tensor]  # one sample's full-length features, field name -> tensor
_ALIGN = 64  # byte alignment of each field inside a packed buffer (typed views need >= 8)
PACK_BELOW_BYTES = 4 * 2**20  # pack="auto": pack slices smaller than this


@dataclass(eq=False)
class FeatureBatch(Mapping):
    """The received features of one sample slice: field name -> tensor covering tokens
    ``[start, stop)``; the receiver owns ``[start, end)``, the rest is halo. The one type in the
    runtime that carries tensors."""

    sample_id: int
    start: int
    end: int
    stop: int
    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def packed_layout(spec: FeatureSpec, num_tokens: int) -> tuple[list[tuple[FeatureField, int, int]], int]:
    """``([(field, byte offset, nbytes), ...], total bytes)`` of one packed slice."""
    layout, offset = [], 0
    for f in spec.fields:
        n = f.nbytes(num_tokens)
        layout.append((f, offset, n))
        offset += -(-n // _ALIGN) * _ALIGN
    return layout, offset


def wire_features(spec: FeatureSpec, fields_BT: Mapping[str, torch.Tensor], lengths: Sequence[int],
                  device: torch.device) -> list[dict[str, torch.Tensor]]:
    """THE place a batch's features become what a transfer sends: per sample ``b``, every field of
    ``spec`` cut to its ``lengths[b]`` real tokens, in the spec's dtype, on ``device`` (the
    transport's: ids and masks from the CPU collate included)."""
    missing = [f.name for f in spec.fields if f.name not in fields_BT]
    if missing:
        raise ValueError(f"no {missing} among the features {sorted(fields_BT)}")
    return [{f.name: fields_BT[f.name][b, :n].to(device=device, dtype=torch_dtype(f.dtype))
             for f in spec.fields} for b, n in enumerate(lengths)]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` name one device in a process whose current GPU is 0; compare by type and index."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _slice(features: Features, f: FeatureField, tr: Transfer, device: Optional[torch.device] = None) -> torch.Tensor:
    t = features[f.name]
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"sample {tr.sample_id} field {f.name!r} is on {t.device}, the data plane's communicator "
                         f"on {device}: every tensor of a transfer must be on the communicator's device")
    expected = f.shape(t.shape[0]) if t.dim() else ()
    if t.dtype != torch_dtype(f.dtype) or tuple(t.shape) != expected or t.shape[0] < tr.stop:
        raise ValueError(
            f"sample {tr.sample_id} field {f.name!r}: got {t.dtype} {tuple(t.shape)}, the spec wants "
            f"{f.dtype} {f.shape(tr.stop)[1:]} per token and at least {tr.stop} tokens"
        )
    return t[tr.start : tr.stop].contiguous()


def _tag(plan: StepPlan, index: int) -> int:
    # Unique per (step mod 1024, split, transfer index) and within int32; NCCL ignores tags.
    return ((plan.step % 1024) << 21) | (int(plan.split != "train") << 20) | (index % (1 << 20))


class BufferPool:
    """Reusable byte buffers. A fresh large CPU buffer costs its page faults on first touch
    (64 MiB: ~27 ms vs ~4 ms to copy into a warm one here), which is most of a transfer's time,
    so steady-state steps reuse buffers instead. ``take`` returns the smallest free buffer that
    fits (else a new one with 25% headroom); at most ``max_free`` are kept."""

    def __init__(self, device: torch.device, max_free: int = 4):
        self.device, self.max_free = device, max_free
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]  # by index: tensors' == is elementwise
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes + nbytes // 4, dtype=torch.uint8, device=self.device)

    def give(self, buf: Optional[torch.Tensor]) -> None:
        if buf is not None:
            self._free.append(buf)
            if len(self._free) > self.max_free:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


class SendHandle:
    """Returned by ``send_step``; ``wait()`` returns the bytes sent once they are out."""

    def __init__(self, wait_fn, nbytes: int):
        self._wait_fn, self.nbytes = wait_fn, nbytes

    def wait(self) -> int:
        if self._wait_fn is not None:
            self._wait_fn()
            self._wait_fn = None
        return self.nbytes


class PendingRecv:
    """Receives posted for one step; ``wait()`` returns ``{sample_id: FeatureBatch}``.
    ``release()`` hands the step's buffer back for reuse: call it only when no tensor of the
    step is referenced any more (the ``Prefetcher`` does it when the next step is requested)."""

    def __init__(self, plan: StepPlan, wait_fn, nbytes: int, release_fn=None):
        self.plan, self._wait_fn, self.nbytes, self._release_fn = plan, wait_fn, nbytes, release_fn
        self._result: Optional[dict[int, FeatureBatch]] = None

    def wait(self) -> dict[int, FeatureBatch]:
        if self._result is None:
            self._result = self._wait_fn()
        return self._result

    def release(self) -> None:
        self.wait()
        if self._release_fn is not None:
            self._release_fn()
            self._release_fn = None
        self._result = {}


def _step_layout(spec: FeatureSpec, transfers: list[tuple[int, Transfer]]):
    """One buffer for all of a rank's slices in a step: ``[(index, transfer, base, layout)], total``."""
    out, base = [], 0
    for index, tr in transfers:
        layout, size = packed_layout(spec, tr.num_tokens)
        out.append((index, tr, base, layout))
        base += size
    return out, base


# ------------------------------------------------------------------------ in-flight log


class InflightLog:
    """One process's data-plane events: ``(wall time, +bytes)`` when a rank posts its sends of a
    step (before they can arrive anywhere), ``(wall time, -bytes)`` when a rank's receives of a
    step complete and go to the train step. Bytes are feature bytes (``FeatureSpec.nbytes``, the
    unit of the in-flight budget), not wire bytes. Wall time, so logs of several processes merge
    (one machine: one clock; across nodes NTP skew, ms, against steps of seconds). 16 bytes per
    event, one event per rank per step: ~1.6 MB for a 100k-step run."""

    def __init__(self):
        self.times, self.deltas = array("d"), array("q")

    def record(self, nbytes: int) -> None:
        if nbytes:
            self.times.append(time.time())
            self.deltas.append(nbytes)

    def snapshot(self) -> tuple[list[float], list[int]]:
        return list(self.times), list(self.deltas)

    def clear(self) -> None:
        self.times, self.deltas = array("d"), array("q")


INFLIGHT = InflightLog()  # this process's log: what a transport records into by default


def inflight_snapshot(_actor=None) -> tuple[list[float], list[int]]:
    """This process's log; ``actor.__ray_call__.remote(inflight_snapshot)`` fetches a worker's."""
    return INFLIGHT.snapshot()


def inflight_peak(snapshots: Iterable[tuple[Sequence[float], Sequence[int]]]) -> int:
    """High-water mark of feature bytes sent but not yet consumed, over the merged logs of every
    rank of a run (sends first on a time tie: the conservative order)."""
    events = sorted(((t, d) for times, deltas in snapshots for t, d in zip(times, deltas)), key=lambda e: (e[0], -e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    return peak


# ------------------------------------------------------------------------- point-to-point


class P2PTransport:
    """Execute a plan with isend/irecv on ``group`` (None = the default group; plan ranks are
    ranks of that group). Counts bytes in ``bytes_sent`` / ``bytes_recv``. Each step's receive
    buffer (and the sender's packing buffer) comes from a ``BufferPool``. ``completion``: how
    finished transfers are learnt (default: by the group's backend, ``timeout_s`` at most per wait)."""

    def __init__(self, group=None, device: Optional[torch.device] = None, pack: bool | str = "auto",
                 log: Optional[InflightLog] = None, completion: Optional[Completion] = None, timeout_s: float = 300.0):
        if pack not in (True, False, "auto"):
            raise ValueError(f"P2PTransport pack={pack!r}: expected True, False or 'auto'")
        self.log = log or INFLIGHT
        self.group = group
        self.device = device or device_mod.pick_device()
        self.pack = pack
        self.completion = completion or Completion.for_group(timeout_s, group)
        self.pool = BufferPool(self.device)
        self.bytes_sent = 0
        self.bytes_recv = 0

    def resolve_rank(self, rank: Optional[int] = None) -> int:
        return dist.get_rank(self.group) if rank is None else rank

    def _packs(self, spec: FeatureSpec, tr: Transfer) -> bool:
        return self.pack is True or (self.pack == "auto" and spec.nbytes(tr.num_tokens) < PACK_BELOW_BYTES)

    def _op(self, op, buf: torch.Tensor, peer: int, plan: StepPlan, index: int) -> dist.P2POp:
        return dist.P2POp(op, buf, group=self.group, group_peer=peer, tag=_tag(plan, index))

    def send_step(self, plan: StepPlan, features_by_sample: Mapping[int, Features],
                  my_rank: Optional[int] = None) -> SendHandle:
        """Post this rank's sends of ``plan`` (full-length features per sample; slicing is done
        here). The tensors must stay unchanged until ``wait()`` returns."""
        rank, spec = self.resolve_rank(my_rank), plan.feature_spec
        mine = [(i, tr) for i, tr in enumerate(plan.transfers) if tr.src_rank == rank and tr.num_tokens]
        for _, tr in mine:
            missing = [n for n in spec.names if n not in features_by_sample.get(tr.sample_id, {})]
            if missing:
                raise ValueError(f"step {plan.step}: no {missing} for sample {tr.sample_id} on rank {rank}")
        # every slice checked (dtype, shape, device) before anything is taken, logged or posted
        sliced = {index: [_as_bytes(_slice(features_by_sample[tr.sample_id], f, tr, self.device)) for f in spec.fields]
                  for index, tr in mine}
        slots, total = _step_layout(spec, [(i, tr) for i, tr in mine if self._packs(spec, tr)])
        packed = {index: (base, layout) for index, _, base, layout in slots}
        buf = self.pool.take(total) if packed else None
        self.log.record(sum(spec.nbytes(tr.num_tokens) for _, tr in mine))  # before anything can arrive
        ops = []
        for index, tr in mine:  # plan order on both ends (NCCL ignores tags)
            slices = sliced[index]
            if index not in packed:
                ops += [self._op(dist.isend, t, tr.dst_rank, plan, index) for t in slices]
                continue
            base, layout = packed[index]
            for (_, offset, n), src in zip(layout, slices):
                buf[base + offset : base + offset + n].copy_(src)
            size = packed_layout(spec, tr.num_tokens)[1]
            ops.append(self._op(dist.isend, buf[base : base + size], tr.dst_rank, plan, index))
        works = self.completion.post(ops)
        nbytes = sum(op.tensor.numel() for op in ops)
        self.bytes_sent += nbytes

        def finish() -> None:
            self.completion.finish(works, f"{plan.split} step {plan.step}: sends of rank {rank}")
            self.pool.give(buf)

        return SendHandle(finish, nbytes)

    def post_recv(self, plan: StepPlan, my_rank: Optional[int] = None) -> PendingRecv:
        """Take one buffer for this rank's slices of the step (shapes from the plan), give each
        sample typed views into it, and post the receives now."""
        rank, spec = self.resolve_rank(my_rank), plan.feature_spec
        mine = [(i, tr) for i, tr in enumerate(plan.transfers) if tr.dst_rank == rank]
        assert len({tr.sample_id for _, tr in mine}) == len(mine), f"rank {rank} receives two slices of one sample"
        slots, total = _step_layout(spec, mine)
        buf = self.pool.take(total) if total else None
        ops, batches = [], {}
        for index, tr, base, layout in slots:
            n = tr.num_tokens
            views = {f.name: buf[base + off : base + off + size] for f, off, size in layout} if n else {}
            tensors = {f.name: views[f.name].view(torch_dtype(f.dtype)).view(f.shape(n)) if n
                       else torch.empty(f.shape(0), dtype=torch_dtype(f.dtype), device=self.device)
                       for f in spec.fields}
            batches[tr.sample_id] = FeatureBatch(tr.sample_id, tr.start, tr.end, tr.stop, tensors)
            if not n:
                continue
            if self._packs(spec, tr):
                ops.append(self._op(dist.irecv, buf[base : base + packed_layout(spec, n)[1]], tr.src_rank, plan, index))
            else:
                ops += [self._op(dist.irecv, views[f.name], tr.src_rank, plan, index) for f in spec.fields]
        works = self.completion.post(ops)
        nbytes = sum(op.tensor.numel() for op in ops)
        self.bytes_recv += nbytes

        def finish() -> dict[int, FeatureBatch]:
            self.completion.finish(works, f"{plan.split} step {plan.step}: receives of rank {rank}")
            self.log.record(-plan.recv_bytes(rank))
            return batches

        return PendingRecv(plan, finish, nbytes, release_fn=lambda: self.pool.give(buf))


# ---------------------------------------------------------------------- double buffering


class Prefetcher:
    """Receiver side: iterate ``(plan, {sample_id: FeatureBatch})`` over ``plans`` while keeping
    later steps' receives posted, at most ``max_inflight_bytes`` of them (always at least one
    step, or nothing could move). The next step is posted before the current one is handed out,
    so its transfer overlaps the caller's compute. Memory held = the budget + the batch in use.

    With ``recycle`` (default) a step's tensors are valid until the next step is requested:
    their buffer is then reused for a later step. Clone anything you keep longer.
    """

    def __init__(self, transport, plans: Iterable[StepPlan], max_inflight_bytes: int,
                 my_rank: Optional[int] = None, recycle: bool = True):
        self.transport, self.max_inflight_bytes = transport, max_inflight_bytes
        self.my_rank = transport.resolve_rank(my_rank)
        self._plans = iter(plans)
        self._lookahead: Optional[StepPlan] = None
        self._posted: collections.deque[PendingRecv] = collections.deque()
        self._current: Optional[PendingRecv] = None
        self.recycle = recycle
        self.inflight_bytes = 0
        self.wait_ms = 0.0  # time spent blocked on the data plane (compute did not hide it)
        self.bytes_recv = 0  # wire bytes of the steps handed out so far

    def _peek(self) -> Optional[StepPlan]:
        if self._lookahead is None:
            self._lookahead = next(self._plans, None)
        return self._lookahead

    def _fill(self) -> None:
        while (plan := self._peek()) is not None:
            size = plan.recv_bytes(self.my_rank)
            if self._posted and self.inflight_bytes + size > self.max_inflight_bytes:
                return
            self._posted.append(self.transport.post_recv(plan, self.my_rank))
            self.inflight_bytes += size
            self._lookahead = None

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> tuple[StepPlan, dict[int, FeatureBatch]]:
        if self._current is not None and self.recycle:
            self._current.release()  # the caller is done with the previous step
        self._current = None
        self._fill()
        if not self._posted:
            raise StopIteration
        pending = self._current = self._posted.popleft()
        t0 = time.perf_counter()
        batches = pending.wait()
        self.wait_ms += (time.perf_counter() - t0) * 1e3
        self.bytes_recv += pending.nbytes
        self.inflight_bytes -= pending.plan.recv_bytes(self.my_rank)
        self._fill()
        return pending.plan, batches


class SendWindow:
    """Sender side: keep at most ``max_inflight_bytes`` of sends outstanding (the oldest is
    waited on first), so a rollout worker running ahead cannot pile up features."""

    def __init__(self, max_inflight_bytes: int):
        self.max_inflight_bytes = max_inflight_bytes
        self._handles: collections.deque[SendHandle] = collections.deque()
        self.inflight_bytes = 0

    def push(self, handle: SendHandle) -> None:
        self._handles.append(handle)
        self.inflight_bytes += handle.nbytes
        while len(self._handles) > 1 and self.inflight_bytes > self.max_inflight_bytes:
            self.inflight_bytes -= self._handles.popleft().wait()

    def drain(self) -> None:
        while self._handles:
            self.inflight_bytes -= self._handles.popleft().wait()


# ---------------------------------------------------------------------- object-store baseline


class _Mailbox:
    """A Ray actor holding ObjectRefs by key until the receiver takes them (FIFO per key)."""

    def __init__(self):
        self._items: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._changed = asyncio.Condition()

    async def put(self, items: dict) -> None:
        async with self._changed:
            for key, ref in items.items():
                self._items[key].append(ref)
            self._changed.notify_all()

    async def take(self, keys: list) -> list:
        async with self._changed:
            await self._changed.wait_for(lambda: all(self._items.get(k) for k in keys))
            return [self._items[k].popleft() for k in keys]


MAILBOX_NAME = "specforge-feature-mailbox"


def spawn_mailbox(name: str = MAILBOX_NAME):
    """Start the named mailbox actor for ``ObjectStoreTransport``. The caller (the driver)
    keeps the returned handle for the run: Ray ends a non-detached actor with its owner's
    last handle, so a worker-owned mailbox would die with that worker's transport."""
    import ray  # lazy: heavy (ray)

    return ray.remote(num_cpus=0)(_Mailbox).options(name=name).remote()


class ObjectStoreTransport:
    """Same interface as ``P2PTransport``, moving each slice through the Ray object store
    (``ray.put`` by the sender, refs handed over by the mailbox actor from ``spawn_mailbox``,
    ``ray.get`` by the receiver). For comparison only: every byte is serialized and copied."""

    def __init__(self, mailbox_name: str = MAILBOX_NAME, timeout_s: float = 300.0, rank: Optional[int] = None,
                 log: Optional[InflightLog] = None):
        import ray  # lazy: heavy (ray)

        self._ray, self.timeout_s, self.rank, self.log = ray, timeout_s, rank, log or INFLIGHT
        self._mailbox = ray.get_actor(mailbox_name)
        self.bytes_sent = 0
        self.bytes_recv = 0

    def resolve_rank(self, rank: Optional[int] = None) -> int:
        rank = self.rank if rank is None else rank
        if rank is None:
            raise ValueError("ObjectStoreTransport needs my_rank (or rank= at construction)")
        return rank

    def send_step(self, plan: StepPlan, features_by_sample: Mapping[int, Features],
                  my_rank: Optional[int] = None) -> SendHandle:
        rank, items, nbytes = self.resolve_rank(my_rank), {}, 0
        self.log.record(sum(plan.feature_spec.nbytes(tr.num_tokens) for tr in plan.sends_of(rank)))
        for index, tr in enumerate(plan.transfers):
            if tr.src_rank != rank:
                continue
            tensors = {f.name: _slice(features_by_sample[tr.sample_id], f, tr)  # device: the sender's own
                       for f in plan.feature_spec.fields}
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
            items[f"{plan.split}:{plan.step}:{index}"] = self._ray.put(tensors)
        done = self._mailbox.put.remote(items)
        self.bytes_sent += nbytes
        return SendHandle(lambda: self._ray.get(done, timeout=self.timeout_s), nbytes)

    def post_recv(self, plan: StepPlan, my_rank: Optional[int] = None) -> PendingRecv:
        rank = self.resolve_rank(my_rank)
        mine = [(index, tr) for index, tr in enumerate(plan.transfers) if tr.dst_rank == rank]
        refs_ref = self._mailbox.take.remote([f"{plan.split}:{plan.step}:{index}" for index, _ in mine])
        nbytes = plan.recv_bytes(rank)
        self.bytes_recv += nbytes

        def finish() -> dict[int, FeatureBatch]:
            refs = self._ray.get(refs_ref, timeout=self.timeout_s)
            values = self._ray.get(refs, timeout=self.timeout_s)
            self.log.record(-nbytes)
            return {tr.sample_id: FeatureBatch(tr.sample_id, tr.start, tr.end, tr.stop, dict(v))
                    for (_, tr), v in zip(mine, values)}

        return PendingRecv(plan, finish, nbytes)


# ------------------------------------------------------------------------------ synthetic


def synthetic_features(spec: FeatureSpec, sample_id: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random features of one sample (tests and benchmarks)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + sample_id)
    out = {}
    for f in spec.fields:
        dtype = torch_dtype(f.dtype)
        if dtype.is_floating_point:
            out[f.name] = torch.randn(f.shape(length), generator=gen).to(dtype)  # device: host (synthetic)
        elif dtype == torch.bool:
            out[f.name] = torch.randint(0, 2, f.shape(length), generator=gen).bool()  # device: host (synthetic)
        else:
            out[f.name] = torch.randint(0, 100, f.shape(length), generator=gen, dtype=dtype)  # device: host (synthetic)
    return out
