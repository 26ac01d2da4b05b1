"""A single-process EAGLE-3 trainer on the tiny target (from tests/test_trainer.py, shared by tests/test_resume.py)."""

import dataclasses

import torch

from specforge.algorithms.eagle3 import ALGORITHM as EAGLE3
from specforge.algorithms.eagle3.algorithm import Eagle3Options
from specforge.config import Config, TrainConfig
from specforge.data.vocab import build_draft_vocab
from specforge.models.features import TrainBatch
from specforge.models.target import TargetModel, capture
from specforge.training.batch import collate
from specforge.training.trainer import DraftTrainer
from tests.helpers.models import tiny_target

V = 320  # tiny_target's vocab


def setup_trainer(seed=0, **train):
    """(target, 4 token rows, DraftTrainer) on a peaked tiny target; ``train``: TrainConfig keys."""
    torch.manual_seed(seed)
    model = tiny_target()
    with torch.no_grad():  # a peaked teacher (a random tiny model is near uniform: nothing to learn)
        model.lm_head.weight.mul_(40)
    target = TargetModel(model=model, tokenizer=None, aux_layer_ids=[1, 2, 2], device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    rows = []
    for n in (20, 27, 33, 24):
        ids = torch.randint(0, 60, (n,), generator=g).tolist()
        mask = [0] * 6 + [1] * (n - 6)
        rows.append({"input_ids": ids, "loss_mask": mask})
    vocab = build_draft_vocab(rows, V, 48)
    cfg = Config(draft=Eagle3Options(vocab_size=48, ttt_length=3, ttt_warmup_steps=train.pop("ttt_warmup_steps", 0)),
                 train=TrainConfig(precision="fp32", lr=1e-2, warmup_steps=0, max_grad_norm=10.0, **train))
    algo = EAGLE3.bind(cfg)
    draft = algo.build_draft(target, vocab)
    trainer = DraftTrainer(algo, draft, algo.train_state(target, vocab), cfg, torch.device("cpu"))
    return target, rows, trainer


def feature_batch(target, rows):
    """The TrainBatch of ``rows`` with ``target``'s captured features."""
    ids, mask, attn = collate(rows, 0)
    return dataclasses.replace(TrainBatch.from_features(ids, mask, capture(target, ids, attn)),
                               length_B=attn.sum(dim=1))


def trainable_params(trainer):
    return {k: v.detach().clone() for k, v in trainer.draft.trainable_state_dict().items()}
