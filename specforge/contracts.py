"""Control-plane records: what the driver and the workers tell each other.

Stdlib only, frozen, and tensor-free: these travel through Ray calls, so they must stay small.
Tensors move on the data plane (``runtime/dataplane.py``, whose ``FeatureBatch`` is the one
tensor-bearing type). ``assert_no_tensors`` guards the boundary.

The ground of the package: it imports nothing of specforge, so every layer may read the records
(the memory model counts a ``FeatureSpec``'s bytes, the dry run builds one). ``runtime/plan.py``
writes a step down (``plan_step``); workers execute a plan, they derive nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Optional, Sequence

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


def row_offsets(lengths: Sequence[int]) -> list[int]:
    """Where each of the samples of a packed row starts (the tokens of those before it): a packed
    ``StepPlan``'s micro-batch is its samples end to end, in order."""
    return list(accumulate(lengths, initial=0))[:-1]


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


# --------------------------------------------------------------------------------- guard


def _is_tensor_like(obj: Any) -> bool:
    # Checked by type name so this module needs neither torch nor numpy.
    for klass in type(obj).__mro__:
        if (klass.__module__, klass.__name__) in {("torch", "Tensor"), ("torch._C", "TensorBase"),
                                                  ("numpy", "ndarray")}:
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
