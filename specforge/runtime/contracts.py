"""Control-plane records: what the driver and the workers tell each other.

Stdlib only, frozen, and tensor-free: these travel through Ray calls, so they must stay small.
Tensors move on the data plane (``runtime/dataplane.py``, whose ``FeatureBatch`` is the one
tensor-bearing type). ``assert_no_tensors`` guards the boundary.

``plan_step`` writes a step down: from the samples each data-parallel (DP) group trains on it
cuts the groups' micro-batches and their padded lengths, decides which rollout worker runs the
target over which samples (one batched forward per rollout worker) and the ordered list of
point-to-point transfers that both ends execute. Workers execute a plan; they derive nothing.
``runtime/plan.py`` (``Planner``) decides the samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

# the slice and packing rules (stdlib), which training/slicing.py imports too
from specforge.parallel.bounds import pack_rows, row_offsets, split_slices

# Plans the driver keeps submitted but not yet collected (and so not yet logged), whatever the byte
# budget allows. Train workers record this many recent metric rows in every checkpoint, so a driver
# killed after a save but before it logged the steps behind it loses none of their rows.
MAX_STEPS_AHEAD = 8

# Bytes per element of the dtype names a FeatureField may use (torch dtype names).
DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclass(frozen=True)
class SampleRef:
    """A training sample, by id (metadata only: the tokens live in the shared data cache)."""

    sample_id: int
    length: int  # tokens


@dataclass(frozen=True)
class Layout:
    """Who is who in the communicator, and where features come from (metadata only)."""

    mode: str  # placement.mode: "colocated" | "disaggregated" (picks the train ranks' feature source)
    rollout_ranks: tuple[int, ...]  # empty when the train ranks compute their own features
    train_ranks: tuple[int, ...]  # in ParallelDims order: DP group g = train_ranks[g*sp:(g+1)*sp]
    vocab_path: str
    mailbox: Optional[str] = None  # object-store transport: name of the mailbox actor


@dataclass(frozen=True)
class FeatureField:
    """One per-token quantity on the wire. A width-1 field travels as a 1-D ``(T,)`` tensor
    (ids, masks); a wider one as ``(T, width)``."""

    name: str
    width: int
    dtype: str  # a key of DTYPE_BYTES

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"feature field {self.name!r}: dtype {self.dtype!r} not one of {sorted(DTYPE_BYTES)}")
        if self.width < 1:
            raise ValueError(f"feature field {self.name!r}: width must be >= 1, got {self.width}")

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens,) if self.width == 1 else (num_tokens, self.width)

    def nbytes(self, num_tokens: int) -> int:
        return num_tokens * self.width * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class FeatureSpec:
    """What travels per token, in wire order."""

    fields: tuple[FeatureField, ...]

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"feature spec has duplicate field names: {names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def bytes_per_token(self) -> int:
        return sum(f.nbytes(1) for f in self.fields)

    def nbytes(self, num_tokens: int) -> int:
        return sum(f.nbytes(num_tokens) for f in self.fields)

    @classmethod
    def hidden_states(cls, hidden_size: int, hidden_dtype: str = "bfloat16", num_layers: int = 3) -> "FeatureSpec":
        """The draft features: ``num_layers`` (K) target layer outputs concatenated (the layers the
        algorithm's ``feature_layers`` chose), the last hidden state (from which a train side may
        rebuild the teacher distribution), the target argmax, the ids and loss mask."""
        return cls((
            FeatureField("aux_hidden", num_layers * hidden_size, hidden_dtype),
            FeatureField("last_hidden", hidden_size, hidden_dtype),
            FeatureField("target_ids", 1, "int64"),
            FeatureField("input_ids", 1, "int64"),
            FeatureField("loss_mask", 1, "int8"),
        ))


@dataclass(frozen=True)
class Transfer:
    """Send tokens ``[start, stop)`` of one sample from ``src_rank`` to ``dst_rank``.

    The destination owns ``[start, end)``; ``stop >= end`` adds a halo of extra positions a
    sequence-parallel rank needs for the TTT shifts (``stop = min(end + halo, length)``).
    Ranks are ranks of the data-plane communicator.
    """

    sample_id: int
    src_rank: int
    dst_rank: int
    start: int
    end: int
    stop: int

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class StepPlan:
    """Everything both ends of the data plane need for one step, identical on every rank."""

    step: int
    rollout_ranks: tuple[int, ...]  # empty: the train ranks compute their features (no transfers)
    # rollout_batches[i]: the sample ids rollout_ranks[i] runs in its ONE forward this step
    # (the union of what the DP groups it serves need, each sample exactly once globally).
    rollout_batches: tuple[tuple[int, ...], ...]
    lengths: tuple[tuple[int, int], ...]  # (sample_id, length), sorted by id
    # per DP group, its micro-batches (sample ids, training order) and what each is padded to
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    padded_lengths: tuple[tuple[int, ...], ...]
    group_ranks: tuple[tuple[int, ...], ...]  # per DP group, its train ranks (SP slice order)
    transfers: tuple[Transfer, ...]  # the order both ends execute
    feature_spec: FeatureSpec
    split: str = "train"  # the data split the sample ids index ("train" | "eval")
    # train.pack_tokens: each micro-batch is ONE packed row, its samples end to end in order
    # (``row_offsets``), padded_lengths its tokens; else the samples are rows padded to it
    packed: bool = False

    def row_offsets(self, ids: Sequence[int]) -> Optional[list[int]]:
        """Where each sample of micro-batch ``ids`` starts in its packed row; None unless ``packed``."""
        if not self.packed:
            return None
        length = dict(self.lengths)
        return row_offsets([length[i] for i in ids])

    def batch_of(self, rollout_rank: int) -> tuple[int, ...]:
        return self.rollout_batches[self.rollout_ranks.index(rollout_rank)]

    def sends_of(self, rank: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.src_rank == rank)

    def recvs_of(self, rank: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.dst_rank == rank)

    def recv_bytes(self, rank: int) -> int:
        return sum(self.feature_spec.nbytes(t.num_tokens) for t in self.recvs_of(rank))


@dataclass(frozen=True)
class StepReport:
    """What a worker returns after a step: numbers only."""

    rank: int
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_recv: int = 0


# ------------------------------------------------------------------------------ planning

Policy = Literal["balanced", "round_robin"]


def assign_groups(group_tokens: Sequence[int], num_rollout: int, policy: Policy = "balanced") -> list[int]:
    """Rollout worker index for each DP group.

    ``round_robin``: group g -> worker g % R. ``balanced`` (default): greedy longest-first, each
    group to the worker with the fewest tokens so far (ties: lower index), so one long group
    does not make every step wait on one worker. Both are pure functions of their inputs.
    """
    if num_rollout < 1:
        raise ValueError("assign_groups: need at least one rollout worker")
    if policy == "round_robin":
        return [g % num_rollout for g in range(len(group_tokens))]
    if policy != "balanced":
        raise ValueError(f"assignment policy {policy!r}: expected 'balanced' or 'round_robin'")
    load = [0] * num_rollout
    owner = [0] * len(group_tokens)
    for g in sorted(range(len(group_tokens)), key=lambda g: (-group_tokens[g], g)):
        w = min(range(num_rollout), key=lambda w: (load[w], w))
        owner[g] = w
        load[w] += group_tokens[g]
    return owner


def plan_step(
    step: int,
    dp_groups_samples: Sequence[Sequence[SampleRef]],
    rollout_ranks: Sequence[int],
    dp_dst_ranks: Sequence[Sequence[int]],
    feature_spec: FeatureSpec,
    policy: Policy = "balanced",
    halo: int = 0,
    micro_batch_size: int = 1,
    split: str = "train",
    pack_tokens: Optional[int] = None,
) -> StepPlan:
    """Plan one step.

    Each DP group's samples are cut, in order, into micro-batches of ``micro_batch_size``, each
    padded to its longest sample. Each DP group is assigned to a rollout worker
    (``assign_groups``); no rollout ranks = the train ranks compute their own features (no
    transfers). A sample is forwarded once, by the worker of the first group that lists it, so
    each rollout batch is the union of its groups' samples. Every sample goes to every rank of
    each group that lists it; with several ranks per group (sequence parallelism) rank j gets the
    j-th slice of the micro-batch's padded length plus ``halo`` (:func:`split_slices`).
    ``pack_tokens`` (``train.pack_tokens``): instead, each DP group's samples are packed, in order,
    into rows of at most that many tokens (``pack_rows``); a row is one micro-batch whose samples sit
    end to end, and rank j of a group gets the part of each sample that lies in its slice of the row.
    Transfers are ordered by (source, position in its batch, group, slice), a pure function of
    the inputs, so all ranks derive the same order.
    """
    if len(dp_groups_samples) != len(dp_dst_ranks):
        raise ValueError(f"plan_step: {len(dp_groups_samples)} DP groups but {len(dp_dst_ranks)} rank lists")
    lengths: dict[int, int] = {}
    for g, group in enumerate(dp_groups_samples):
        if not dp_dst_ranks[g]:
            raise ValueError(f"plan_step: DP group {g} has no train ranks")
        if len({r.sample_id for r in group}) != len(group):
            raise ValueError(f"plan_step: DP group {g} lists a sample twice")
        for ref in group:
            if lengths.setdefault(ref.sample_id, ref.length) != ref.length:
                raise ValueError(f"sample {ref.sample_id} listed with two lengths")
    if pack_tokens is None:
        micro = [[group[s : s + micro_batch_size] for s in range(0, len(group), micro_batch_size)]
                 for group in dp_groups_samples]
        padded = [[max(r.length for r in mb) for mb in group] for group in micro]
    else:
        micro = [[[group[i] for i in row] for row in pack_rows([r.length for r in group], pack_tokens)]
                 for group in dp_groups_samples]
        padded = [[sum(r.length for r in mb) for mb in group] for group in micro]

    source: dict[int, int] = {}  # sample id -> rollout worker index
    batches: list[list[int]] = [[] for _ in rollout_ranks]
    if rollout_ranks:
        owner = assign_groups([sum(r.length for r in group) for group in dp_groups_samples], len(rollout_ranks), policy)
    for g, group in enumerate(dp_groups_samples if rollout_ranks else ()):
        for ref in group:
            if ref.sample_id not in source:
                source[ref.sample_id] = owner[g]
                batches[owner[g]].append(ref.sample_id)

    receivers: dict[int, list[tuple[int, int, int]]] = {}  # sample id -> (group, padded length, offset in the row)
    for g, group in enumerate(micro):
        for mb, T in zip(group, padded[g]):
            offsets = row_offsets([r.length for r in mb]) if pack_tokens is not None else [0] * len(mb)
            for ref, o in zip(mb, offsets):
                receivers.setdefault(ref.sample_id, []).append((g, T, o))
    transfers = []
    for w, batch in enumerate(batches):
        for sid in batch:
            for g, T, o in receivers[sid]:
                ranks = dp_dst_ranks[g]
                for dst, (start, end, stop) in zip(ranks, split_slices(lengths[sid], len(ranks), halo, T, o)):
                    transfers.append(Transfer(sid, rollout_ranks[w], dst, start, end, stop))
    return StepPlan(
        step=step,
        rollout_ranks=tuple(rollout_ranks),
        rollout_batches=tuple(tuple(b) for b in batches),
        lengths=tuple(sorted(lengths.items())),
        micro_batches=tuple(tuple(tuple(r.sample_id for r in mb) for mb in group) for group in micro),
        padded_lengths=tuple(tuple(group) for group in padded),
        group_ranks=tuple(tuple(r) for r in dp_dst_ranks),
        transfers=tuple(transfers),
        feature_spec=feature_spec,
        split=split,
        packed=pack_tokens is not None,
    )


# --------------------------------------------------------------------------------- guard


def _is_tensor_like(obj: Any) -> bool:
    # Checked by type name so this module needs neither torch nor numpy.
    for klass in type(obj).__mro__:
        if (klass.__module__, klass.__name__) in {("torch", "Tensor"), ("torch._C", "TensorBase"), ("numpy", "ndarray")}:
            return True
    return False


def assert_no_tensors(obj: Any, path: str = "record") -> None:
    """Raise ``TypeError`` naming the path (``record.metrics['loss']``) of any torch tensor or
    numpy array inside dataclasses, tuples, lists, sets and dicts."""
    if _is_tensor_like(obj):
        raise TypeError(f"control-plane record holds a {type(obj).__module__}.{type(obj).__name__} at {path}")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            assert_no_tensors(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, dict):
        for key, value in obj.items():
            assert_no_tensors(key, f"{path}<key {key!r}>")
            assert_no_tensors(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            assert_no_tensors(value, f"{path}[{i}]")
