"""The draft train step every placement shares, and the single-process trainer around it.

    python -m specforge.train --config configs/smollm2-135m-cpu.yaml [dotted.overrides=...]

``DraftTrainer`` owns the draft, its optimizer and the frozen teacher head, and runs THE train
step (TTT forward/backward, clipping, AdamW, schedule) on a list of micro-batches. Every train
worker (``runtime/workers.py``) runs it, on FSDP2-sharded drafts when there are several; only
where the features come from differs. ``run`` is the single-process placement: one in-process
train worker under THE loop, the reference the distributed placements are tested against.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from specforge.config import Config, load_config
from specforge.data.vocab import DraftVocab, build_draft_vocab, load_draft_vocab, save_draft_vocab
from specforge.device import autocast, autocast_dtype, pick_device
from specforge.models.draft import Eagle3Draft, draft_config_from_target
from specforge.models.target import TargetModel, _decoder_layers, capture
from specforge.train.batch import TrainBatch, collate, pad_id
from specforge.train.checkpoint import latest_checkpoint, tensor_digest
from specforge.train.optim import build_optimizer
from specforge.train.ttt import metrics_from_counts, num_valid_rows, teacher_weight_from_target, ttt_loss

# ---------------------------------------------------------------- building


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.output_dir) / "checkpoints")


def keep_old_checkpoints(cfg: Config) -> None:
    """A fresh start (``checkpoint.resume=false``) in a folder holding checkpoints moves them aside
    first, and says where: its saves would otherwise replace step folders of the same number."""
    from specforge.train.checkpoint import set_aside

    if not cfg.checkpoint.resume and (moved := set_aside(checkpoint_root(cfg))):
        print(f"checkpoint.resume=false: moved the existing checkpoints of {checkpoint_root(cfg)} aside to {moved}")


def vocab_path(cfg: Config, data_key: str) -> Path:
    """Where the draft vocab of this data + tokenizer is cached (workers load it from here)."""
    return Path(cfg.model.cache_dir).expanduser() / "vocab" / f"{data_key}-n{cfg.draft.vocab_size}.safetensors"


def build_vocab(cfg: Config, train_rows, target_vocab_size: int, data_key: str) -> DraftVocab:
    """The draft vocab of this data + tokenizer, cached next to the tokenized data."""
    path = vocab_path(cfg, data_key)
    if path.is_file():
        return load_draft_vocab(path)
    vocab = build_draft_vocab(train_rows, target_vocab_size, cfg.draft.vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_draft_vocab(vocab, path)
    return vocab


def build_draft(cfg: Config, target: TargetModel, vocab: DraftVocab) -> Eagle3Draft:
    """A fresh draft shaped from the target, embedding copied (frozen), lm_head warm-started."""
    dcfg = draft_config_from_target(target.config, cfg.draft, target.aux_layer_ids)
    with torch.random.fork_rng(devices=[]):  # the init is a function of the seed alone, whatever ran before
        torch.manual_seed(cfg.train.seed)
        draft = Eagle3Draft(dcfg)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    draft.init_embeddings_from_target(target.embed_weight_VH)
    if cfg.draft.init_lm_head_from_target and dcfg.hidden_size == dcfg.target_hidden_size:
        draft.init_lm_head_from_target(target.lm_head_weight_VH)
        final_norm = getattr(getattr(target.model, target.model.base_model_prefix), "norm", None)
        if final_norm is not None:  # lm_head rows were trained against this norm's scale
            with torch.no_grad():
                draft.norm.weight.copy_(final_norm.weight.to(draft.norm.weight))
    if cfg.draft.init_midlayer_from_target:
        layers = _decoder_layers(target.model)
        draft.init_midlayer_from_target(layers[min(max(target.aux_layer_ids) + 1, len(layers) - 1)],
                                        target.aux_layer_ids.index(max(target.aux_layer_ids)))
    return draft


def teacher_weight(target: TargetModel, vocab: DraftVocab) -> torch.Tensor:
    """Target lm_head rows of the draft vocab (N x H): the teacher over the draft vocab."""
    return teacher_weight_from_target(target.lm_head_weight_VH, vocab.d2t).clone()


# Config keys that change what a step computes (besides the draft's shape, draft.*): a checkpoint
# resumes only into a run with the same values (a restored scheduler would silently keep the old LR).
RESUME_KEYS = ("train.seed", "train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.ttt_warmup_steps",
               "train.weight_decay", "train.betas", "train.max_grad_norm", "train.precision")


def run_identity(cfg: Config, target: TargetModel, vocab: DraftVocab, facts: dict, total_steps: int) -> dict:
    """What a checkpoint must share with the run resuming it: hashes of the target weights and the
    vocab mapping, the data (``plan.run_facts``: key, sample count, global batch), the LR horizon
    and the config keys that change the math (``RESUME_KEYS``, every draft.* but the attention impl)."""
    def get(key: str):
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    draft_keys = [f"draft.{f.name}" for f in dataclasses.fields(cfg.draft) if f.name != "attention"]
    return {
        "target": tensor_digest(target.model.state_dict().items(), sample=64),
        "vocab": tensor_digest([("d2t", vocab.d2t), ("t2d", vocab.t2d)]),
        **facts,
        "total_steps": total_steps,
        **{k: get(k) for k in (*RESUME_KEYS, *draft_keys)},
    }


# ---------------------------------------------------------------- the train step


class DraftTrainer:
    """THE train step, shared by every placement (single process, colocated, disaggregated)."""

    def __init__(self, draft: torch.nn.Module, teacher_NH: torch.Tensor, cfg: Config, device: torch.device,
                 reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x, total_steps: Optional[int] = None):
        # reduce_sum sums a tensor over all train ranks (data and sequence parallel; identity in one
        # process): the loss is normalized by the GLOBAL valid count, so gradients are summed.
        # total_steps: the LR schedule's horizon (default train.max_steps).
        self.draft, self.cfg, self.device, self.reduce_sum = draft, cfg, device, reduce_sum
        self.teacher_NH = teacher_NH.to(device, torch.float32)  # small (N x H); autocast casts it down where it runs
        self.amp_dtype = autocast_dtype(cfg.train.precision, device)
        self.optimizer, self.scheduler = build_optimizer(draft.parameters(), cfg.train, total_steps or cfg.train.max_steps)
        self.step_count = 0

    def _counts(self, micro_batches: Sequence[TrainBatch], num_valid: Optional[float]) -> torch.Tensor:
        """Run the loss over ``micro_batches`` (backward too when training); the summed counters."""
        counts = torch.zeros(self.cfg.draft.ttt_length, 4, dtype=torch.float64)
        steps = self.unroll_length() if torch.is_grad_enabled() else self.cfg.draft.ttt_length
        for mb in micro_batches:
            mb = _compute_dtype(mb.to(self.device), self.amp_dtype)
            with autocast(self.device, self.amp_dtype):
                loss, c = ttt_loss(self.draft, mb, self.teacher_NH, steps, self.cfg.draft.ttt_decay,
                                   num_valid_global=num_valid)
            if torch.is_grad_enabled():
                loss.backward()
            counts[:steps] += c.cpu()
        return self.reduce_sum(counts)

    def unroll_length(self) -> int:
        """TTT steps this optimizer step trains: 1 during ``train.ttt_warmup_steps``, then
        ``draft.ttt_length``. A function of the step alone, so every rank agrees without talking."""
        return 1 if self.step_count < self.cfg.train.ttt_warmup_steps else self.cfg.draft.ttt_length

    def step(self, micro_batches: Sequence[TrainBatch]) -> dict[str, float]:
        """One optimizer step over this rank's ``micro_batches``; the loss is normalized by the
        valid-token count of all micro-batches of all train ranks."""
        cfg = self.cfg
        self.draft.train()
        local = sum(num_valid_rows(mb, self.draft.t2d, cfg.draft.ttt_length) for mb in micro_batches)
        num_valid = self.reduce_sum(torch.tensor([float(local)], dtype=torch.float64)).item()
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        counts = self._counts(micro_batches, max(num_valid, 1.0))
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.draft.parameters() if p.requires_grad], cfg.train.max_grad_norm
        )
        self.optimizer.step()
        self.scheduler.step()
        self.step_count += 1
        out = metrics_from_counts(counts, cfg.draft.ttt_decay)
        gn = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        out.update(
            lr=self.scheduler.get_last_lr()[0],
            grad_norm=gn,
            tokens=float(sum(mb.num_tokens for mb in micro_batches)),
            train_ms=(time.perf_counter() - t0) * 1000,
        )
        return out

    @torch.no_grad()
    def evaluate(self, batches: Sequence[TrainBatch]) -> dict[str, float]:
        """Metrics of ``batches`` (summed over all train ranks), no update."""
        self.draft.eval()
        return metrics_from_counts(self._counts(batches, None), self.cfg.draft.ttt_decay)


def local_batches(target: TargetModel, rows: Sequence[dict], batch_size: int, chunk_tokens: int) -> list[TrainBatch]:
    """Features for ``rows`` computed by the in-process target, ``batch_size`` rows at a time."""
    pad = pad_id(target.tokenizer)
    out = []
    for s in range(0, len(rows), batch_size):
        ids, mask, attn = collate(rows[s : s + batch_size], pad)
        out.append(TrainBatch.from_features(ids, mask, capture(target, ids, attn, chunk_tokens)))
    return out


def _compute_dtype(mb: TrainBatch, amp_dtype: Optional[torch.dtype]) -> TrainBatch:
    """Without autocast the draft computes in fp32: bf16 features (a bf16 store or wire) are
    upcast here, once, whatever source they came from (under autocast they stay as they are)."""
    if amp_dtype is not None or mb.aux_hidden_BT3H.dtype == torch.float32:
        return mb
    return dataclasses.replace(mb, aux_hidden_BT3H=mb.aux_hidden_BT3H.float(), last_hidden_BTH=mb.last_hidden_BTH.float())


# ---------------------------------------------------------------- the single-process placement


def run(cfg: Config) -> Optional[Path]:
    """Train in this process: the simplest placement of THE loop (``runtime/loop.py``) with the
    same global batch, data order and loss as ``specforge.ray_train``; the reference the
    distributed placements are tested against. Returns the newest checkpoint folder."""
    from specforge.preflight import check_run
    from specforge.runtime.loop import LocalCluster, check, not_applied, single_process, train_loop
    from specforge.runtime.plan import Planner, prepare
    from specforge.tracking import MetricsLogger

    check(cfg)
    check_run(cfg)  # the config against the target's config.json, before the target loads
    keep_old_checkpoints(cfg)
    if skipped := not_applied(cfg, "single"):
        print(f"single process: not applying {', '.join(skipped)} (they distribute a run: python -m specforge.ray_train)")
    local = single_process(cfg)
    data = prepare(local, use_gpu=pick_device(cfg.model.device).type == "cuda")
    cluster = LocalCluster(local, data)
    logger = MetricsLogger(cfg.tracking, cfg.train.output_dir, cfg.to_dict())
    try:
        train_loop(local, cluster, Planner(local, data, cluster.layout), logger)
    finally:
        cluster.save()
        logger.close()
    path = latest_checkpoint(checkpoint_root(cfg))
    print(f"saved {path}")
    return path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge.train", description="Single-process EAGLE-3 draft training.")
    ap.add_argument("--config", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    run(load_config(args.config, args.overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
