"""Every row of the supported-targets table (``specforge.targets.FAMILIES``) through a user's whole
offline path, on its tiny random model saved to a folder with a chat-template tokenizer:
``capture_store`` -> ``specforge.train.run`` (placement.mode=offline, a few steps) -> ``python -m specforge.eval``
with the trained draft, whose speculative output must equal greedy decoding. The eval's greedy
reference is itself checked against decoding without any cache, and the eval's verify rounds are
driven through every acceptance count (0..chain) so that taking rejected tokens back out of the
target's cache (``Family.rollback``: a crop, or for linear-attention families a restored state and
a re-run) is exercised for every family."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from specforge import eval as ev
from specforge.config import load_config
from specforge.data import heldout
from specforge.models.target import TargetModel, forward_aux
from specforge.targets import FAMILIES, RESTORE, tiny
from tests.helpers.targets import AUX, NAMES, build_family, overrides, target_folder

built = functools.lru_cache(maxsize=None)(build_family)  # this module's own cache
# the reference implementations of linear attention (no fla / causal-conv1d kernels here) take seconds
SLOW = [pytest.param(f.name, marks=pytest.mark.slow) if f.rollback == RESTORE else f.name for f in FAMILIES]


# ---------------------------------------------------------------- the eval's cache rollback == no cache


@torch.no_grad()
def uncached_greedy(target: TargetModel, prompt: list[int], max_new: int, eos=frozenset()) -> list[int]:
    """Greedy decoding that re-runs the whole sequence every token: no cache to get wrong."""
    ids, out = list(prompt), []
    while len(out) < max_new and not (out and out[-1] in eos):
        _, last, _ = forward_aux(target, torch.tensor([ids], device=target.device))
        out.append(int((last[0, -1] @ target.lm_head_weight_VH.T).argmax()))
        ids.append(out[-1])
    return out


class Scripted:
    """Proposes the true continuation, wrong from draft position ``round % (chain + 1)`` on: the
    verify rounds accept 0, 1, ..., chain tokens in turn."""

    def __init__(self, prompt_len: int, reference: list[int], chain: int):
        self.prompt_len, self.reference, self.chain, self.rounds = prompt_len, reference, chain, 0

    def start(self, ids, aux_TH):
        self.ids = list(ids)

    def propose(self, k, costs=None):
        done = len(self.ids) - self.prompt_len
        good = (self.reference + [3] * k)[done : done + k]
        cut = self.rounds % (self.chain + 1)
        self.rounds += 1
        return good[:cut] + [(t + 1) % tiny.V for t in good[cut:]]

    def accept(self, new, aux_TH):
        assert aux_TH.shape[0] == len(new)
        self.ids += new


def _prompt():
    # past every sliding window (8)
    return torch.randint(3, 250, (11,), generator=torch.Generator().manual_seed(2)).tolist()


@pytest.mark.parametrize("name", SLOW)
def test_speculative_rounds_of_every_acceptance_equal_uncached_greedy(name):
    target, prompt, chain = built(name), _prompt(), 3
    ref = uncached_greedy(target, prompt, 12)
    assert ev.greedy_run(target, prompt, 12, set()).tokens == ref
    got, stats = ev.speculative_decode(target, Scripted(len(prompt), ref, chain), prompt, 12, chain, set())
    assert got == ref
    assert stats.accepted_at == [3, 2, 1] and stats.verify_forwards == 5  # rounds accepted 0, 1, 2, 3, 0 tokens


@pytest.mark.slow
def test_linear_attention_state_needs_the_restore(monkeypatch):
    """Negative control: qwen3_next with its recurrent state not restored no longer equals greedy."""
    target, prompt, chain = built("qwen3_next"), _prompt(), 3
    assert target.family.rollback == RESTORE
    ref = uncached_greedy(target, prompt, 12)
    live = ev._recurrent_snapshot
    monkeypatch.setattr(ev, "_recurrent_snapshot", lambda cache: {i: cache.layers[i] for i in live(cache)})  # no copies
    got, _ = ev.speculative_decode(target, Scripted(len(prompt), ref, chain), prompt, 12, chain, set())
    assert got != ref


# ---------------------------------------------------------------- capture -> offline training -> lossless eval


@pytest.mark.parametrize("name", NAMES)
def test_offline_training_and_lossless_eval(name, tmp_path):
    from specforge.capture import capture_store
    from specforge.models.target import load_target
    from specforge.train import run

    target_folder(name, tmp_path)
    cfg = load_config(None, overrides(tmp_path))
    capture_store(cfg, progress=False)
    ckpt = run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["loss"] > 0 for r in train)

    # the eval CLI raises unless every speculative output equals its greedy decoding
    out = tmp_path / "eval.json"
    assert ev.main(["--draft", str(ckpt), "--num-prompts", "3", "--max-new-tokens", "16", "--chain", "3",
                    "--json", str(out), *overrides(tmp_path)]) == 0
    report = json.loads(out.read_text())
    assert [r["setting"] for r in report["rows"]] == ["chain 3 fixed", "dynamic <=3"]
    assert report["prompts"] == 3 and report["ties"] == 0 and report["verify_forwards"] > 0

    # ... and that greedy decoding (cached, as the eval runs it) equals decoding without a cache
    target = load_target(cfg.model, layers=lambda n: AUX)
    eos = ev._eos_ids(target)
    for prompt in heldout.eval_prompts(heldout.heldout_rows(cfg, target.tokenizer), 3, 384):
        assert ev.greedy_run(target, prompt, 16, eos).tokens == uncached_greedy(target, prompt, 16, eos)


def test_online_training_of_an_image_text_target(tmp_path):
    """Online (the target captures in the train process): the planner reads the text tower's sizes."""
    from specforge.train import run

    target_folder("gemma3", tmp_path)
    ckpt = run(load_config(None, overrides(tmp_path) + ["placement.mode=colocated", "train.max_steps=2"]))
    assert ckpt is not None and (ckpt / "model.safetensors").is_file()
