"""What every step runs, decided once by the driver: prepared data + config -> ``StepPlan``.

THE partition: step k trains on ``global_batch_ids(n, global_batch, seed, k)`` (data order is a
pure function of (seed, step)); DP group g takes the g-th contiguous share (``split_for_ranks``);
``plan_step`` cuts each share into micro-batches of ``train.batch_size`` and pads each to its
longest sample. With sequence parallelism of degree P a DP group is the P consecutive train ranks
``train_ranks[g*P:(g+1)*P]`` (``ParallelDims``' layout), in SP-rank order, and the data plane
sends each only its slice (+ halo) of every sample. Workers execute the plan and derive nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from specforge.config import Config
from specforge.parallel.dims import ParallelDims
from specforge.runtime.contracts import FeatureSpec, Layout, SampleRef, StepPlan, plan_step, sp_halo
from specforge.train.batch import global_batch_ids, split_for_ranks


@dataclass(frozen=True)
class RunData:
    """Metadata of the prepared data: sample lengths and where the workers find things."""

    lengths: tuple[int, ...]  # of the train split, by sample id
    vocab_path: str
    hidden_size: int
    wire_dtype: str  # dtype of the hidden-state features on the data plane


def prepare(cfg: Config, use_gpu: bool) -> RunData:
    """Tokenize into the shared cache and write the draft vocab file (no model weights loaded)."""
    from transformers import AutoConfig

    from specforge.data.prepare import prepare_dataset
    from specforge.models.target import load_tokenizer, resolve_target_path
    from specforge.train.trainer import build_vocab, vocab_path

    tokenizer = load_tokenizer(cfg.model)
    data = prepare_dataset(cfg.data, tokenizer, chat_template=cfg.model.chat_template, cache_dir=cfg.model.cache_dir)
    print(data.stats.table())
    target_cfg = AutoConfig.from_pretrained(resolve_target_path(cfg.model), trust_remote_code=cfg.model.trust_remote_code)
    build_vocab(cfg, data.train, target_cfg.vocab_size, data.cache_key)  # writes the file workers load
    return RunData(
        lengths=tuple(int(n) for n in data.train.data.column("length").to_pylist()),
        vocab_path=str(vocab_path(cfg, data.cache_key)),
        hidden_size=int(target_cfg.hidden_size),
        wire_dtype=wire_dtype(cfg.model.dtype, use_gpu),
    )


def wire_dtype(model_dtype: str, use_gpu: bool) -> str:
    """Features travel in the target's own dtype: bf16 on GPUs by default, fp32 on CPU
    (CPU matmuls are not faster in bf16 here, and fp32 keeps every placement bit-comparable)."""
    if model_dtype != "auto":
        return model_dtype
    return "bfloat16" if use_gpu else "float32"


class Planner:
    """Step -> ``StepPlan``: a pure function of (seed, step), the same on every call."""

    def __init__(self, cfg: Config, data: RunData, layout: Layout):
        self.cfg, self.data, self.layout = cfg, data, layout
        self.dp = ParallelDims.from_config(cfg).dp
        self.global_batch = cfg.train.batch_size * cfg.train.grad_accum * self.dp
        self.spec = FeatureSpec.eagle3(data.hidden_size, data.wire_dtype)
        self._cache: dict[int, StepPlan] = {}

    def __call__(self, step: int) -> StepPlan:
        if step not in self._cache:
            self._cache = {s: p for s, p in self._cache.items() if s >= step - 1}
            ids = global_batch_ids(len(self.data.lengths), self.global_batch, self.cfg.train.seed, step)
            self._cache[step] = self._plan(step, ids)
        return self._cache[step]

    def _plan(self, step: int, ids: list[int]) -> StepPlan:
        groups = [[SampleRef(i, self.data.lengths[i]) for i in share[0]] for share in split_for_ranks(ids, self.dp, 1)]
        P = len(self.layout.train_ranks) // self.dp
        ranks = [self.layout.train_ranks[g * P : (g + 1) * P] for g in range(self.dp)]
        return plan_step(step, groups, self.layout.rollout_ranks, ranks, self.spec,
                         halo=sp_halo(self.cfg.draft.ttt_length), micro_batch_size=self.cfg.train.batch_size)

    def step_bytes(self, step: int) -> int:
        """Feature bytes the train ranks receive for ``step`` (0 when they compute their own)."""
        plan = self(step)
        return sum(plan.recv_bytes(r) for r in self.layout.train_ranks)
