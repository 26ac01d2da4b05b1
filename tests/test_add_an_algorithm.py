"""docs/ARCHITECTURE.md's "Add an algorithm", followed end to end with a tiny example
(``tests/helpers/example_algorithm.py``, a bigram draft): registered by its name alone, its ``draft.*``
keys read by the config layer, trained by THE train step, saved as a checkpoint, found and loaded by
the registry from the folder, and drafting in the eval, losslessly. If the section's steps stop being
enough, this fails."""

import sys

import pytest
import torch

import specforge.config as config
import specforge.registry as registry
from specforge.models.target import TargetModel
from tests.helpers import example_algorithm
from tests.helpers.trainer import feature_batch, setup_trainer


@pytest.fixture
def registered(monkeypatch):
    """The example as the section adds one: its package (here a module) and its name in ``NAMES``."""
    monkeypatch.setitem(sys.modules, "specforge.algorithms.example", example_algorithm)
    names = registry.NAMES + ("example",)
    monkeypatch.setattr(registry, "NAMES", names)
    monkeypatch.setattr(config, "NAMES", names)  # config.py holds the registry's tuple
    yield
    registry._CHECKED.discard("example")


def test_an_algorithm_added_as_the_section_says_trains_saves_loads_and_drafts(registered, tmp_path):
    from specforge.eval import evaluate
    from specforge.training.checkpoint import save_checkpoint
    from specforge.training.trainer import DraftTrainer

    algo = registry.get_algorithm("example")  # the registry's check: every role's member is there
    with pytest.raises(ValueError, match="'draft.hidden'=0: expected > 0"):  # its own key, checked by the config layer
        config.load_config(None, ["draft.algorithm=example", "draft.hidden=0"])
    with pytest.raises(ValueError, match="unknown.*draft.ttt_length|draft.ttt_length"):  # another's key: refused
        config.load_config(None, ["draft.algorithm=example", "draft.ttt_length=3"])
    cfg = config.load_config(None, ["draft.algorithm=example", "draft.hidden=24", "train.precision=fp32",
                                    "train.lr=0.05", "train.warmup_steps=0"])
    assert registry.bound_algorithm(cfg).opt.hidden == 24

    target, rows, _ = setup_trainer()  # a tiny target and 4 rows (tests/helpers/trainer.py)
    batch = feature_batch(target, rows)
    bound = algo.bind(cfg)
    draft = bound.build_draft(target, None)
    trainer = DraftTrainer(bound, draft, bound.train_state(target, None), cfg, torch.device("cpu"))
    losses = [trainer.step([batch])["loss"] for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], losses  # it learns the target's greedy bigrams

    folder = save_checkpoint(tmp_path / "checkpoints", 30, bound.hf_config(draft), draft.export_state_dict())
    assert registry.algorithm_name(registry.read_draft_config(folder)) == "example"
    loaded = registry.load_draft(folder, target)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in draft.state_dict().items())

    eval_target = TargetModel(model=target.model, tokenizer=None, aux_layer_ids=target.aux_layer_ids,
                              device=target.device)
    report = evaluate(eval_target, algo.proposer(loaded, torch.float32), [r["input_ids"][:8] for r in rows],
                      max_new=12, chain=3, progress=False)  # raises if an output differs from greedy decoding
    assert report.acceptance_length > 1.0  # its drafts are accepted, not only proposed
