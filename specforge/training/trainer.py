"""The draft train step every placement shares, whatever the draft algorithm.

``DraftTrainer`` owns the draft, its optimizer and the algorithm's frozen train state (EAGLE-3: the
teacher rows), and runs THE train step (the algorithm's loss forward/backward over micro-batches,
clipping, AdamW, schedule). Every train worker (``runtime/workers.py``) and the single process
(``specforge/train.py``: ``python -m specforge.train``) run it, on FSDP2-sharded drafts when there
are several; only where the features come from differs. The algorithm (``specforge/seam.py``, bound to the run)
decides the loss and the metrics; this file never asks which one runs. Nor how a micro-batch is laid
out: a source hands it over in its final layout (padded rows, or a packed row whose ``doc_ids_BT``
the algorithm reads: ``data/packing.py``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from specforge.config import Config, TrainConfig
from specforge.data.packing import target_packs
from specforge.data.vocab import DraftVocab, build_draft_vocab, load_draft_vocab, save_draft_vocab
from specforge.device import autocast, autocast_dtype
from specforge.models.features import TrainBatch
from specforge.models.layers import hold_frozen_tables, set_mlp_recompute
from specforge.models.target import TargetModel, capture
from specforge.seam import Training
from specforge.training.batch import collate, pad_id
from specforge.training.checkpoint import clear_interrupted, set_aside, tensor_digest
from specforge.training.optim import build_optimizer

# ---------------------------------------------------------------- building


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.output_dir) / "checkpoints")


def keep_old_checkpoints(cfg: Config) -> None:
    """A fresh start (``checkpoint.resume=false``) in a folder holding checkpoints moves them aside
    first, and says where: its saves would otherwise replace step folders of the same number. What a
    killed save left (``clear_interrupted``) goes, and is named."""
    root = checkpoint_root(cfg)
    if left := clear_interrupted(root):
        print(f"{root}: removed the partial save an interrupted run left ({', '.join(left)}); "
              "the checkpoints before it are whole")
    if not cfg.checkpoint.resume and (moved := set_aside(root)):
        print(f"checkpoint.resume=false: moved the existing checkpoints of {root} aside to {moved}")


def vocab_path(algo: Training, cfg: Config, data_key: str, target_vocab_size: int) -> Path:
    """Where the draft vocab of this data + tokenizer is cached (workers load it from here)."""
    n = algo.draft_vocab_size(target_vocab_size)
    return Path(cfg.model.cache_dir).expanduser() / "vocab" / f"{data_key}-n{n}-{cfg.draft.algorithm}.safetensors"


def build_vocab(algo: Training, cfg: Config, train_rows, target_vocab_size: int, data_key: str) -> DraftVocab:
    """The draft vocab of this data + tokenizer, cached next to the tokenized data."""
    path = vocab_path(algo, cfg, data_key, target_vocab_size)
    if path.is_file():
        return load_draft_vocab(path)
    vocab = build_draft_vocab(train_rows, target_vocab_size, algo.draft_vocab_size(target_vocab_size))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_draft_vocab(vocab, path)
    return vocab


# Config keys that change what a step computes (besides the draft's shape, draft.*): a checkpoint
# resumes only into a run with the same values (a restored scheduler would silently keep the old LR).
RESUME_KEYS = ("train.seed", "train.lr", "train.min_lr_ratio", "train.warmup_steps",
               "train.weight_decay", "train.betas", "train.max_grad_norm", "train.precision")
# keys that change the math, added after checkpoints were written: recorded only off their defaults, so
# those checkpoints still resume
LATER_KEYS = ("train.adam_eps", "train.loss", "train.optimizer", "train.muon_lr", "train.muon_weight_decay")


def run_identity(algo: Training, cfg: Config, target: TargetModel, vocab: DraftVocab, facts: dict,
                 total_steps: int) -> dict:
    """What a checkpoint must share with the run resuming it: hashes of the target weights and the
    vocab mapping, the data (``plan.run_facts``: key, sample count, global batch), the LR horizon
    and the config keys that change the math (``RESUME_KEYS``, and ``algo``'s ``identity``)."""

    def get(key: str):
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    return {
        "target": tensor_digest(target.model.state_dict().items(), sample=64,
                                dtype=getattr(target, "digest_dtype", None)),  # an engine's host copy: the run's
        "vocab": tensor_digest([("d2t", vocab.d2t), ("t2d", vocab.t2d)]),
        **facts,
        "total_steps": total_steps,
        **{k: get(k) for k in RESUME_KEYS},
        **{k: get(k) for k in LATER_KEYS if get(k) != getattr(TrainConfig, k.split(".")[1])},
        **algo.identity(),
    }


# ---------------------------------------------------------------- the train step


class DraftTrainer:
    """THE train step, shared by every placement (single process, colocated, disaggregated)."""

    def __init__(self, algorithm: Training, draft: torch.nn.Module, state, cfg: Config, device: torch.device,
                 reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x, total_steps: Optional[int] = None):
        # algorithm: the config's draft algorithm bound to it (``registry.bound_algorithm(cfg)``): its
        # loss, normalizer, counters and metrics are what a step runs.
        # state: the algorithm's frozen train state (``algorithm.train_state``; EAGLE-3: the teacher rows).
        # reduce_sum sums a tensor over all train ranks (data and sequence parallel; identity in one
        # process): the loss is normalized by the GLOBAL denominator, so gradients are summed.
        # total_steps: the LR schedule's horizon (default train.max_steps).
        bound = getattr(algorithm, "facts", None) is not None
        if algorithm.name != cfg.draft.algorithm or not bound:
            raise ValueError(f"DraftTrainer got algorithm {algorithm.name!r}{'' if bound else ' unbound'} for a config "
                             f"whose draft.algorithm is {cfg.draft.algorithm!r}; pass registry.bound_algorithm(cfg)")
        self.draft, self.cfg, self.device, self.reduce_sum, self.algorithm = draft, cfg, device, reduce_sum, algorithm
        # small (EAGLE-3: N x H) and fp32; autocast casts it down where it runs
        self.state = state.to(device, torch.float32) if hasattr(state, "to") else state
        # fp16 would need loss scaling (none here): config validation refuses train.precision=fp16, and
        # "auto" on a GPU without bf16 (where autocast_dtype picks fp16) trains in fp32
        self.amp_dtype = autocast_dtype(cfg.train.precision, device)
        if self.amp_dtype == torch.float16:
            if cfg.train.precision == "fp16":
                raise ValueError("config key 'train.precision'='fp16' is refused (no loss scaling); use 'bf16'")
            self.amp_dtype = None
        # the target's tables the draft copied (frozen) held in the autocast dtype when it holds them exactly
        hold_frozen_tables(draft, self.amp_dtype)
        set_mlp_recompute(draft, cfg.train.recompute_mlp)
        self.optimizer, self.scheduler = build_optimizer(draft.named_parameters(), cfg.train,
                                                         total_steps or cfg.train.max_steps)
        self.step_count = 0

    def on_device(self, micro_batches: Sequence[TrainBatch]) -> list[TrainBatch]:
        """THE one place a micro-batch moves to the trainer's device, before any algorithm hook sees
        it: a source may hand over fields on two devices (the single process's collate leaves the
        loss mask on the host while its capture wrote the features on the GPU)."""
        return [mb.to(self.device) for mb in micro_batches]

    def _counts(self, micro_batches: Sequence[TrainBatch], normalizer: Optional[torch.Tensor],
                training: bool) -> torch.Tensor:
        """Run the loss over ``micro_batches`` (backward too when ``training``); the summed counters,
        on the trainer's device (summed there: no host sync per micro-batch)."""
        algo = self.algorithm
        counts = torch.zeros(algo.counts_shape(), dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            mb = _compute_dtype(mb, self.amp_dtype)
            with autocast(self.device, self.amp_dtype):
                loss, c = algo.loss(self.draft, mb, self.state, self.step_count, normalizer, training=training)
            if training:
                loss.backward()
            counts[: c.shape[0]] += c.to(self.device)
        return self.reduce_sum(counts)

    def _global_normalizer(self, micro_batches: Sequence[TrainBatch]) -> torch.Tensor:
        """The loss denominator of all micro-batches of all train ranks, on the device (summed there,
        reduced there, divided there: a host read of it would be one GPU sync a step). An algorithm's
        normalizer is a 0-dim tensor, or a vector where it averages terms apart (summed entrywise)."""
        total = None
        for mb in micro_batches:  # a denominator: nothing to differentiate (a train step's anchors all the same)
            with torch.no_grad():
                n = self.algorithm.normalizer(self.draft, mb, self.step_count, training=True)
            n = torch.as_tensor(n, dtype=torch.float64, device=self.device)
            total = n if total is None else total + n
        if total is None:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
        return self.reduce_sum(total.reshape(-1)).reshape(total.shape)

    def step(self, micro_batches: Sequence[TrainBatch]) -> dict[str, float]:
        """One optimizer step over this rank's ``micro_batches``; the loss is normalized by the
        denominator (EAGLE-3: valid rows) of all micro-batches of all train ranks."""
        cfg = self.cfg
        self.draft.train()
        useful = _useful_tokens(micro_batches)
        micro_batches = self.on_device(micro_batches)
        total = self._global_normalizer(micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        counts = self._counts(micro_batches, total, training=True)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.draft.parameters() if p.requires_grad], cfg.train.max_grad_norm
        )
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        # the step's one read of device values: counters and gradient norm in one copy to the host,
        # queued after the optimizer's kernels, so train_ms is finished work with no sync of its own
        gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        host = torch.cat([counts.reshape(-1), gn.reshape(1).to(counts)]).cpu()
        train_ms = (time.perf_counter() - t0) * 1000
        out = self.algorithm.metrics(host[:-1].view(counts.shape))
        out.update(
            lr=self.scheduler.get_last_lr()[0],
            grad_norm=host[-1].item(),
            tokens=float(sum(mb.num_tokens for mb in micro_batches)),  # padding included
            **({} if useful is None else {"useful_tokens": float(useful)}),  # padding left out
            train_ms=train_ms,
        )
        return out

    @torch.no_grad()
    def evaluate(self, batches: Sequence[TrainBatch]) -> dict[str, float]:
        """Metrics of ``batches`` (summed over all train ranks), no update."""
        self.draft.eval()
        # the metrics hooks read host counters, as step's do (one copy to the host)
        return self.algorithm.metrics(self._counts(self.on_device(batches), None, training=False).cpu())


def local_batches(target: TargetModel, rows: Sequence[dict], batch_size: int, chunk_tokens: int,
                  pack_tokens: Optional[int] = None) -> list[TrainBatch]:
    """Features for ``rows`` computed by the in-process target, ``batch_size`` rows at a time
    (``pack_tokens``: in packed target rows, ``capture``'s)."""
    pad = pad_id(target.tokenizer)
    out = []
    for s in range(0, len(rows), batch_size):
        ids, mask, attn = collate(rows[s : s + batch_size], pad)
        feats = capture(target, ids, attn, chunk_tokens, target_packs(attn, pack_tokens))
        batch = TrainBatch.from_features(ids, mask, feats)
        out.append(dataclasses.replace(batch, length_B=attn.sum(dim=1).cpu()))  # host metadata (TrainBatch.length_B)
    return out


def _useful_tokens(micro_batches: Sequence[TrainBatch]) -> Optional[int]:
    """The tokens of the samples, padding left out (None where a source did not record lengths)."""
    if any(mb.length_B is None for mb in micro_batches):
        return None
    return int(sum(int(mb.length_B.sum()) for mb in micro_batches))


def _compute_dtype(mb: TrainBatch, amp_dtype: Optional[torch.dtype]) -> TrainBatch:
    """Without autocast the draft computes in fp32: bf16 features (a bf16 store or wire) are
    upcast here, once, whatever source they came from (under autocast they stay as they are)."""
    if amp_dtype is not None or mb.aux_hidden_BTKH.dtype == torch.float32:
        return mb
    return dataclasses.replace(mb, aux_hidden_BTKH=mb.aux_hidden_BTKH.float(),
                               last_hidden_BTH=mb.last_hidden_BTH.float())
