"""What every step runs, decided once by the driver: prepared data + config -> ``StepPlan``.

THE partition: step k trains on ``global_batch_ids(n, global_batch, seed, k)`` (data order is a
pure function of (seed, step)); DP group g takes the g-th contiguous share (``split_for_ranks``);
``plan_step`` cuts each share into micro-batches of ``train.batch_size`` and pads each to its
longest sample. With sequence parallelism of degree P a DP group is the P consecutive train ranks
``train_ranks[g*P:(g+1)*P]`` (``ParallelDims``' layout), in SP-rank order, and the data plane
sends each only its slice (+ halo) of every sample. Workers execute the plan and derive nothing.

A run is a schedule of plans: every train step up to ``total_steps`` (the stop rule of
``TrainConfig``), and after every ``train.eval_every``-th an eval plan over the first held-out
samples, split and padded the same way (``split="eval"``), which every placement executes.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch

from specforge.config import Config
from specforge.contracts import FeatureSpec, Layout, SampleRef, StepPlan, Transfer
from specforge.data.packing import packed_rows
from specforge.data.prepare import prepare_dataset
from specforge.data.store import FeatureStore, check_replay_meta, store_root
from specforge.data.vocab import build_draft_vocab, save_draft_vocab
from specforge.models.target import load_tokenizer, resolve_target_path
from specforge.parallel.bounds import split_slices
from specforge.parallel.dims import ParallelDims
from specforge.registry import bound_algorithm, feature_layers
from specforge.targets import text_config
from specforge.training.batch import global_batch_ids, replay_batch_ids, replayed_before, split_for_ranks
from specforge.training.init_from import init_vocab_path
from specforge.training.trainer import build_vocab, vocab_path


@dataclass(frozen=True)
class RunData:
    """Metadata of the prepared data: sample lengths and where the workers find things."""

    lengths: tuple[int, ...]  # of the train split, by sample id
    eval_lengths: tuple[int, ...]  # of the held-out split
    vocab_path: str
    hidden_size: int
    wire_dtype: str  # dtype of the hidden-state features on the data plane
    data_key: str = ""  # identifies the samples (token cache key / feature store digest): checkpoints keep it
    num_aux_layers: int = 3  # target layers the draft algorithm reads (the aux feature is that many x H wide)
    num_replay: int = 0  # the last this many of ``lengths`` are a reference store's (store.replay_dir)


def run_facts(cfg: Config, data: RunData) -> dict:
    """What a train worker's checkpoints record about the data (its resume refuses other data):
    the data's key, and the data cursor's sample count and global batch (order = f(seed, step))."""
    global_batch = cfg.train.batch_size * cfg.train.grad_accum * ParallelDims.from_config(cfg).dp
    return {"data": data.data_key, "num_samples": len(data.lengths), "global_batch": global_batch}


def prepare(cfg: Config, use_gpu: bool) -> RunData:
    """Tokenize into the shared cache and write the draft vocab file (no model weights loaded).
    Offline: the samples are the feature store's (nothing is tokenized)."""
    from transformers import AutoConfig  # lazy: heavy (transformers)

    if cfg.placement.mode == "offline":
        return prepare_offline(cfg)

    tokenizer = load_tokenizer(cfg.model)
    data = prepare_dataset(cfg.data, tokenizer, chat_template=cfg.model.chat_template, cache_dir=cfg.model.cache_dir)
    print(data.stats.table())

    # an image-text target's text tower
    target_cfg = text_config(AutoConfig.from_pretrained(resolve_target_path(cfg.model),
                                                        trust_remote_code=cfg.model.trust_remote_code))
    algo = bound_algorithm(cfg)
    path = init_vocab_path(algo, cfg, target_cfg.vocab_size)  # draft.init_from: the folder's mapping
    if path is None:
        build_vocab(algo, cfg, data.train, target_cfg.vocab_size, data.cache_key)  # writes the file workers load
        path = vocab_path(algo, cfg, data.cache_key, target_cfg.vocab_size)
    return RunData(
        lengths=tuple(int(n) for n in data.train.data.column("length").to_pylist()),
        eval_lengths=tuple(int(n) for n in data.eval.data.column("length").to_pylist()),
        vocab_path=str(path),
        hidden_size=int(target_cfg.hidden_size),
        wire_dtype=wire_dtype(cfg.model.dtype, use_gpu),
        data_key=data.cache_key,
        num_aux_layers=len(feature_layers(cfg, target_cfg.num_hidden_layers)),
    )


def store_split(store, cfg: Config) -> dict[str, list[int]]:
    """Store sample ids by split: with periodic eval on, the last few are held out for it (a tenth
    at most). The prompts ``specforge.eval`` measures are never in a store (regenerate and capture
    take the train split only). A ``ReplayStores`` adds the replayed ids to the train split."""
    if isinstance(store, ReplayStores):
        return store.split(cfg)
    n = min(cfg.data.num_eval, EVAL_SAMPLES, len(store.ids) // 10) if cfg.train.eval_every else 0
    return {"train": store.ids[: len(store.ids) - n], "eval": store.ids[len(store.ids) - n :]}


def replayable_ids(store) -> list[int]:
    """A reference store's samples that may be replayed: all but the last min(8, a tenth), the most
    any run on it holds out (``store_split``), whatever this run's eval settings."""
    return store.ids[: len(store.ids) - min(EVAL_SAMPLES, len(store.ids) // 10)]


class ReplayStores:
    """The run's store and a reference store behind the one interface ``StoreSource`` reads
    (``read``, ``read_tokens``, ``ids``, ``lengths``, ``meta``): own sample ids as they are, replayed sample j as
    ``offset + j`` (offset = 1 + the largest own id), after the own train ids in the train split."""

    def __init__(self, own, ref):
        check_replay_meta(own, ref)
        self.own, self.ref, self.meta, self.dtype, self.root = own, ref, own.meta, own.dtype, own.root
        self.replayed = replayable_ids(ref)
        self.offset = 1 + max(own.ids, default=-1)
        extra = range(self.offset, self.offset + len(self.replayed))
        self.ids = [*own.ids, *extra]
        self.lengths = {**own.lengths, **{i: ref.lengths[r] for i, r in zip(extra, self.replayed)}}
        self._out_dtype = torch.float32 if own.dtype == "int8" else torch.bfloat16  # what own.read gives

    @property
    def num_tokens(self) -> int:
        return self.own.num_tokens

    def split(self, cfg: Config) -> dict[str, list[int]]:
        own = store_split(self.own, cfg)
        return {"train": own["train"] + self.ids[len(self.own.ids):], "eval": own["eval"]}

    def read(self, sample_id: int, start: int = 0, stop: Optional[int] = None) -> dict:
        if sample_id < self.offset:
            return self.own.read(sample_id, start, stop)
        out = self.ref.read(self.replayed[sample_id - self.offset], start, stop)
        for name in ("aux_hidden", "last_hidden"):  # an int8 reference beside a bf16 store, or back
            out[name] = out[name].to(self._out_dtype)
        return out

    def read_tokens(self, sample_id: int) -> dict:
        if sample_id < self.offset:
            return self.own.read_tokens(sample_id)
        return self.ref.read_tokens(self.replayed[sample_id - self.offset])


def open_offline_store(cfg: Config, expect=None):
    """The run's feature store (``store_root``), with the reference store beside it when
    ``store.replay_dir`` is set; ``expect`` (a ``StoreMeta``) is checked against the run's."""
    store = FeatureStore(store_root(cfg), expect=expect)
    return ReplayStores(store, FeatureStore(cfg.store.replay_dir)) if cfg.store.replay_dir else store


def build_store_vocab(cfg: Config, store, train_ids: list[int], key: str) -> Path:
    """THE draft vocab of an offline run: the most frequent loss tokens of every sample it trains
    on (replayed ones too, so the vocab covers both stores), written once per (data, size). The
    driver runs it: it reads each sample's ids and loss mask (``read_tokens``), never its features."""
    algo = bound_algorithm(cfg)
    V = store.meta.vocab_size
    n = algo.draft_vocab_size(V)
    path = Path(cfg.model.cache_dir).expanduser() / "vocab" / f"store-{key}-n{n}.safetensors"
    path = init_vocab_path(algo, cfg, store.meta.vocab_size) or path  # draft.init_from: the folder's mapping
    if not path.is_file():
        counts = torch.zeros(V, dtype=torch.long)  # device: host (counts store rows)
        for i in train_ids:
            s = store.read_tokens(i)
            counts += torch.bincount(s["input_ids"][s["loss_mask"].bool()], minlength=V)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_draft_vocab(build_draft_vocab(counts.numpy(), V, n), path)
    return path


def prepare_offline(cfg: Config) -> RunData:
    """The feature store's samples (+ the replayed ones): lengths by split, and the draft vocab."""
    store = open_offline_store(cfg)
    split = store_split(store, cfg)
    own = store.own if isinstance(store, ReplayStores) else store
    if len(split["train"]) == (num_replay := len(store.ids) - len(own.ids)):
        raise ValueError(f"feature store {store.root} holds no samples; fill it (store.fill={cfg.store.fill})")
    ident = (own.meta, own.ids) if not num_replay else (own.meta, own.ids, store.ref.meta, store.replayed,
                                                          cfg.store.replay_share)
    key = hashlib.sha256(repr(ident).encode()).hexdigest()[:16]
    path = build_store_vocab(cfg, store, split["train"], key)
    replay = (f"; replaying {num_replay} samples of {store.ref.root} as {cfg.store.replay_share:g} of each step"
              if num_replay else "")
    print(f"feature store {store.root}: {len(split['train']) - num_replay} train + {len(split['eval'])} held-out "
          f"samples, {store.num_tokens} tokens ({store.dtype}){replay}")
    return RunData(
        lengths=tuple(store.lengths[i] for i in split["train"]),
        eval_lengths=tuple(store.lengths[i] for i in split["eval"]),
        vocab_path=str(path),
        hidden_size=store.meta.hidden_size,
        wire_dtype=store.dtype if store.dtype != "int8" else "float32",
        data_key=f"store-{key}",
        num_aux_layers=len(store.meta.aux_layer_ids),
        num_replay=num_replay,
    )


def wire_dtype(model_dtype: str, use_gpu: bool) -> str:
    """Features travel in the target's own dtype: bf16 on GPUs by default, fp32 on CPU
    (CPU matmuls are not faster in bf16 here, and fp32 keeps every placement bit-comparable)."""
    if model_dtype != "auto":
        return model_dtype
    return "bfloat16" if use_gpu else "float32"


EVAL_SAMPLES = 8  # held-out samples per periodic eval (the first of the split, a multiple of the DP groups)


def total_steps(cfg: Config, num_samples: int, num_replay: int = 0) -> int:
    """The optimizer steps a run trains: the first of ``train.max_steps`` and ``train.epochs``
    passes over ``num_samples`` (``train.max_minutes`` may stop it earlier). With ``num_replay``
    of them replayed, an epoch is a pass over the run's own samples, (1 - share) of each step."""
    global_batch = cfg.train.batch_size * cfg.train.grad_accum * ParallelDims.from_config(cfg).dp
    if num_replay:
        num_samples, global_batch = num_samples - num_replay, global_batch * (1 - cfg.store.replay_share)
    by_epochs = math.inf if cfg.train.epochs is None else math.ceil(cfg.train.epochs * num_samples / global_batch)
    return int(min(math.inf if cfg.train.max_steps is None else cfg.train.max_steps, by_epochs))


class Planner:
    """Step -> ``StepPlan``: a pure function of (seed, step), the same on every call."""

    def __init__(self, cfg: Config, data: RunData, layout: Layout):
        self.cfg, self.data, self.layout = cfg, data, layout
        self.dp = ParallelDims.from_config(cfg).dp
        self.global_batch = cfg.train.batch_size * cfg.train.grad_accum * self.dp
        self.total_steps = total_steps(cfg, len(data.lengths), data.num_replay)
        self.spec = FeatureSpec.hidden_states(data.hidden_size, data.wire_dtype, data.num_aux_layers)

        self.halo = bound_algorithm(cfg).sp_halo()  # rows past its slice an SP rank reads
        self._cache: dict[int, StepPlan] = {}
        n_eval = min(EVAL_SAMPLES, len(data.eval_lengths)) // self.dp * self.dp
        if cfg.train.eval_every and not n_eval:
            raise ValueError(f"config key 'train.eval_every'={cfg.train.eval_every}: periodic eval needs at least "
                             f"{self.dp} held-out samples (one per data-parallel group), the held-out split has "
                             f"{len(data.eval_lengths)} (data.num_eval={cfg.data.num_eval}); raise data.num_eval "
                             "or set train.eval_every=0")
        self._eval: Optional[StepPlan] = self._plan(0, list(range(n_eval)), "eval") if n_eval else None
        self.check_budget(int(cfg.placement.max_inflight_mb * 2**20))

    def schedule(self, start: int) -> list[tuple[str, int]]:
        """``(split, step)`` of every plan from step ``start`` on, in the order all workers run
        them: train steps, an eval (of the model after ``step`` steps) after every eval_every-th."""
        every = self.cfg.train.eval_every
        out = []
        for s in range(start, self.total_steps):
            out += [("train", s)] + ([("eval", s + 1)] if every and (s + 1) % every == 0 else [])
        return out

    def task(self, item: tuple[str, int]) -> StepPlan:
        split, step = item
        return self(step) if split == "train" else replace(self._eval, step=step)

    def __call__(self, step: int) -> StepPlan:
        if step not in self._cache:
            self._cache = {s: p for s, p in self._cache.items() if s >= step - 1}
            ids = self.batch_ids(step)
            self._cache[step] = self._plan(step, ids)
        return self._cache[step]

    def batch_ids(self, step: int) -> list[int]:
        """The train indices of step ``step`` (own samples, then replayed ones: ``RunData.num_replay``)."""
        n, seed = len(self.data.lengths), self.cfg.train.seed
        if not self.data.num_replay:
            return global_batch_ids(n, self.global_batch, seed, step)
        r = self.data.num_replay
        return replay_batch_ids(n - r, r, self.cfg.store.replay_share, self.global_batch, seed, step)

    def epochs_done(self, steps: int) -> float:
        """Passes over the run's own train samples in the first ``steps`` steps (replayed ones not counted)."""
        replayed = replayed_before(self.cfg.store.replay_share, self.global_batch, steps) if self.data.num_replay else 0
        return (steps * self.global_batch - replayed) / (len(self.data.lengths) - self.data.num_replay)

    def replayed_share(self, steps: int) -> float:
        """The share of the first ``steps`` steps' samples that were replayed (the metrics row's replay_share)."""
        return replayed_before(self.cfg.store.replay_share, self.global_batch, steps) / (steps * self.global_batch)

    def _plan(self, step: int, ids: list[int], split: str = "train") -> StepPlan:
        lengths = self.data.lengths if split == "train" else self.data.eval_lengths
        return self._plan_refs(step, [SampleRef(i, lengths[i]) for i in ids], split)

    def _plan_refs(self, step: int, refs: list[SampleRef], split: str = "train") -> StepPlan:
        groups = [list(share[0]) for share in split_for_ranks(refs, self.dp, 1)]
        P = len(self.layout.train_ranks) // self.dp
        ranks = [self.layout.train_ranks[g * P : (g + 1) * P] for g in range(self.dp)]
        return plan_step(step, groups, self.layout.rollout_ranks, ranks, self.spec, halo=self.halo,
                         micro_batch_size=self.cfg.train.batch_size, split=split,
                         pack_tokens=self.cfg.train.pack_tokens)

    def recv_bytes(self, plan: StepPlan) -> int:
        """Feature bytes the train ranks receive for ``plan`` (0 when they compute their own)."""
        return sum(plan.recv_bytes(r) for r in self.layout.train_ranks)

    def step_bytes(self, step: int) -> int:
        return self.recv_bytes(self(step))

    def largest_step_bytes(self) -> int:
        """A bound on the feature bytes of any plan of the schedule: a global batch of samples all as
        long as the longest one (padding never goes past it), or the periodic eval plan."""
        longest = max(self.data.lengths, default=0)
        worst = self.recv_bytes(self._plan_refs(0, [SampleRef(i, longest) for i in range(self.global_batch)]))
        return max(worst, self.recv_bytes(self._eval) if self._eval else 0)

    def check_budget(self, budget_bytes: int) -> None:
        """Refuse an in-flight budget that one step could exceed (the loop always lets one plan run,
        so the bound would not hold). The constructor checks ``placement.max_inflight_mb``: a run
        is refused when it is planned, before any step or checkpoint."""
        need = self.largest_step_bytes()
        if need > budget_bytes:
            raise ValueError(
                f"config key 'placement.max_inflight_mb'={self.cfg.placement.max_inflight_mb:g} is smaller than one "
                f"step's features: a step of {self.global_batch} samples of {max(self.data.lengths, default=0)} "
                f"tokens (the longest) sends {need / 2**20:.3g} MB; set placement.max_inflight_mb >= "
                f"{math.ceil(need / 2**20 * 100) / 100:g} (twice that lets rollout overlap training)")


# ------------------------------------------------------------------------------ one step: samples -> StepPlan

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
    into rows of at most that many tokens (``data/packing.packed_rows``); a row is one micro-batch whose samples sit
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
        offsets = [[[0] * len(mb) for mb in group] for group in micro]
    else:
        rows = [packed_rows([r.length for r in group], pack_tokens) for group in dp_groups_samples]
        micro = [[[group[i] for i in row.samples] for row in g_rows] for group, g_rows in zip(dp_groups_samples, rows)]
        padded = [[row.tokens for row in g_rows] for g_rows in rows]
        offsets = [[row.offsets for row in g_rows] for g_rows in rows]

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
        for mb, T, offs in zip(group, padded[g], offsets[g]):
            for ref, o in zip(mb, offs):
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
