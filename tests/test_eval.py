import json

import pytest
import torch

from specforge import eval as ev
from specforge.algorithms.eagle3.model import ChainDrafter, DraftKVCache, Eagle3Draft, Eagle3DraftConfig
from specforge.algorithms.eagle3.propose import EagleProposer
from specforge.eval import (
    GreedyRun,
    PromptLookupProposer,
    RoundCosts,
    Setting,
    check_lossless,
    evaluate,
    evaluate_settings,
    greedy_decode,
    greedy_run,
    speculative_decode,
)
from specforge.models.target import TargetModel
from tests.helpers.models import tiny_target

V = 320  # tiny_target's vocab


def _target(layers=4):
    model = tiny_target(num_layers=layers)
    return TargetModel(model=model, tokenizer=None, aux_layer_ids=[0, 1, 2], device=torch.device("cpu"))


def _draft(target, n_vocab=100, seed=0):
    """A random draft shaped for the tiny target (hidden 48), draft vocab = n_vocab sparse target ids."""
    cfg = Eagle3DraftConfig(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=12, vocab_size=V, draft_vocab_size=n_vocab, target_hidden_size=48)
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg)
    d.reset_parameters(std=0.1)
    d.set_vocab(torch.sort(torch.randperm(V)[:n_vocab]).values - torch.arange(n_vocab))
    d.init_embeddings_from_target(target.embed_weight_VH)
    return d.eval()


class OracleProposer:
    """Proposes the target's own greedy continuation with a planted error every 3rd round; with
    ``costs`` it asks them like EagleProposer does, its probability per token being ``confidence``."""

    def __init__(self, reference, confidence=1.0):
        self.reference = reference
        self.confidence = confidence
        self.done = 0
        self.rounds = 0

    def start(self, ids, aux):
        self.done = 1

    def propose(self, k, costs=None):
        self.rounds += 1
        cont = self.reference[self.done : self.done + k]
        cont = cont + [0] * (k - len(cont))
        if self.rounds % 3 == 0:
            cont[1] = (cont[1] + 1) % V  # wrong at draft position 2
        if costs is None:
            return cont
        n = 0
        while costs.verify_pays(n + 1, self.confidence ** (n + 1)):
            n += 1
            if n == k or not costs.step_pays(n, self.confidence ** n):
                break
        return cont[:n]

    def accept(self, new, aux):
        assert aux.shape[0] == len(new)
        self.done += len(new)


class FixedCosts(RoundCosts):
    """Costs set by the test (measurements ignored): deterministic stopping decisions."""

    def __init__(self, draft_step_s, target_s_by_len):
        super().__init__()
        self.draft_step_s, self.target_s_by_len = draft_step_s, dict(target_s_by_len)

    def observe_draft(self, steps, seconds):
        pass

    def observe_target(self, tokens, seconds):
        pass


def test_speculative_equals_greedy_and_counts_acceptance():
    target = _target()
    prompt = torch.randint(0, V, (12,)).tolist()
    ref, _ = greedy_decode(target, prompt, 40, eos=set())
    assert len(ref) == 40
    out, st = speculative_decode(target, OracleProposer(ref), prompt, 40, chain=4, eos=set())
    assert out == ref
    # perfect rounds produce 5 tokens, every 3rd round exactly 2 (1 accepted + bonus)
    assert st.accepted_at[0] == st.verify_forwards
    assert st.accepted_at[1] < st.verify_forwards
    assert st.verify_forwards < 40 / 2
    assert st.drafted == 4 * st.verify_forwards


def test_an_eos_inside_a_round_ends_the_decode_there():
    """Greedy stops at the EOS; so does speculative decoding, also when the EOS is accepted inside a
    round (not its last token): no later round is run or counted, or acceptance would be measured on
    tokens the answer does not have. The control: the same rounds as stopping at that length."""
    target = _target()
    prompt = torch.randint(0, V, (12,)).tolist()
    ref, _ = greedy_decode(target, prompt, 40, eos=set())
    i = next(j for j in range(8, 40) if ref[j] not in ref[:j])  # a token that first appears at j
    greedy, _ = greedy_decode(target, prompt, 40, eos={ref[i]})
    assert greedy == ref[: i + 1]
    out, st = speculative_decode(target, OracleProposer(ref), prompt, 40, chain=4, eos={ref[i]})
    assert out == greedy
    _, cut = speculative_decode(target, OracleProposer(ref), prompt, i + 1, chain=4, eos=set())
    _, full = speculative_decode(target, OracleProposer(ref), prompt, 40, chain=4, eos=set())
    assert (st.verify_forwards, st.accepted_at) == (cut.verify_forwards, cut.accepted_at)
    assert st.verify_forwards < full.verify_forwards  # the decode would have gone on to 40 tokens


def test_prompt_lookup_output_is_exactly_greedy():
    target = _target()
    prompts = [torch.randint(0, 50, (16,)).tolist() for _ in range(3)]
    rep = evaluate(target, PromptLookupProposer(), prompts, max_new=24, chain=5, progress=False)
    assert rep.prompts == 3 and rep.new_tokens == 3 * 24
    assert 1.0 <= rep.acceptance_length <= 6.0
    assert rep.ties == 0 and rep.drafted_per_round == 5


def test_round_costs_decide_from_measured_costs():
    c = RoundCosts()
    assert c.verify_pays(1, 1e-9) and c.step_pays(6, 1e-9)  # nothing measured: draft the whole chain
    c.observe_target(1, 0.050)
    c.observe_target(2, 0.070)  # the 2nd verified token costs 20 ms (1-row forwards are cheaper)
    c.observe_target(8, 0.100)  # then 5 ms per token
    c.observe_draft(7, 0.035)  # 5 ms per draft step
    assert c.verify_s(5) == pytest.approx(0.085) and c.extra_verify_s(1) == pytest.approx(0.020)
    # an accepted token saves a decode step (50 ms): verifying a 1st drafted token (20 ms) pays iff p > 0.4
    assert c.verify_pays(1, 0.41) and not c.verify_pays(1, 0.39)
    assert c.verify_pays(2, 0.11) and not c.verify_pays(2, 0.09)  # 5 ms: p > 0.1
    assert c.step_pays(2, 0.21) and not c.step_pays(2, 0.19)  # drafting a 3rd costs 5 + 5 ms: p > 0.2
    c.observe_draft(1, 0.100)  # the running average moves toward a slower draft step
    assert c.draft_step_s == pytest.approx(0.005 + 0.2 * 0.095)
    assert not c.step_pays(2, 0.21)


# a decode step saves 10; verifying one more token costs 1, drafting one 1 + 1: verify while
# p_all > 0.1, draft while p_all > 0.2
COSTS = {1: 10.0, 2: 11.0, 8: 17.0}


@pytest.mark.parametrize("confidence,drafted", [(0.9, 6), (0.3, 1), (0.05, 0)])
def test_dynamic_drafting_stops_when_confidence_drops_and_stays_greedy(confidence, drafted):
    target = _target()
    prompt = torch.randint(0, V, (12,)).tolist()
    ref, _ = greedy_decode(target, prompt, 40, eos=set())
    costs = FixedCosts(1.0, COSTS)
    out, st = speculative_decode(target, OracleProposer(ref, confidence), prompt, 40, chain=6, eos=set(), costs=costs)
    assert out == ref
    assert st.drafted == drafted * st.verify_forwards  # 0.9**6 > 0.2; 0.3**2 < 0.1 < 0.3; 0.05 < 0.1


def test_eagle_proposer_fixed_and_dynamic_are_exactly_greedy():
    target = _target()
    draft = _draft(target)
    prompts = [torch.randint(0, V, (10,)).tolist() for _ in range(2)]
    settings = [Setting("d", EagleProposer(draft)), Setting("d", EagleProposer(draft), dynamic=True)]
    fixed, dyn = evaluate_settings(target, settings, prompts, max_new=20, chain=4, progress=False)
    assert (fixed.setting, dyn.setting) == ("chain 4 fixed", "dynamic <=4")
    assert fixed.new_tokens == dyn.new_tokens == 40 and fixed.ties == dyn.ties == 0
    assert fixed.drafted_per_round == 4 and 0 <= dyn.drafted_per_round <= 4
    assert fixed.target_tokens_per_s == dyn.target_tokens_per_s  # one shared baseline


@pytest.mark.parametrize("lm_head_scale,drafted", [(0.0, 0), (1e4, 5)])
def test_eagle_dynamic_drafting_follows_the_drafts_confidence(lm_head_scale, drafted):
    target = _target()
    draft = _draft(target)
    with torch.no_grad():  # 0: uniform over 100 draft tokens (p = 0.01); huge: p = 1
        draft.lm_head.weight.mul_(lm_head_scale)
    prompt = torch.randint(0, V, (10,)).tolist()
    ref, _ = greedy_decode(target, prompt, 16, eos=set())
    out, st = speculative_decode(target, EagleProposer(draft), prompt, 16, chain=5, eos=set(),
                                 costs=FixedCosts(1.0, COSTS))
    assert out == ref and st.drafted == drafted * st.verify_forwards


def test_chain_drafter_equals_forward_cached():
    target = _target()
    draft = _draft(target, seed=3)
    ids = torch.randint(0, V, (14,))
    aux = torch.randn(14, 3 * 48)
    with torch.inference_mode():
        cache = DraftKVCache()
        h_ref, l_ref = draft.forward_cached(ids[None, :9], aux[None, :9], torch.arange(9)[None], cache)
        fast = ChainDrafter(draft, capacity=4)  # small: the cache and the RoPE table must grow
        h, logits = fast.prefill(ids[:9], aux[:9])
        torch.testing.assert_close(logits, l_ref[0], rtol=1e-5, atol=1e-5)
        committed = len(fast.cache)
        for rnd in range(2):  # drafting, rollback to the committed rows, drafting again
            hr, lr, hf, lf = h_ref[:, -1:], l_ref[0, -1], h[-1:], logits[-1]
            for i in range(5):
                tok = lf.argmax()
                assert int(fast.to_target(tok)) == int(draft.draft_to_target_ids(lr.argmax()))
                hr, lr = draft.forward_cached(fast.to_target(tok).view(1, 1), hr, torch.tensor([[9 + i]]), cache)
                hf, lf = fast.step(tok, hf)
                lr, lf = lr[0, -1], lf[0]
                torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-5, msg=lambda m: f"round {rnd} step {i}: {m}")
            cache.crop(committed)
            fast.cache.crop(committed)


def test_chain_drafter_bf16_is_close_to_fp32():
    target = _target()
    draft = _draft(target, seed=4)
    ids, aux = torch.randint(0, V, (8,)), torch.randn(8, 3 * 48)
    with torch.inference_mode():
        _, l32 = ChainDrafter(draft).prefill(ids, aux)
        _, l16 = ChainDrafter(draft, dtype=torch.bfloat16).prefill(ids, aux)
    assert l16.dtype == torch.bfloat16
    assert (l16.float() - l32).abs().max() < 0.05 * l32.abs().max()


def _planted_tie(ref: GreedyRun, j: int, rel_gap: float) -> GreedyRun:
    """The reference with token j replaced by the runner-up, made the max by ``rel_gap`` x scale."""
    logits = [row.clone() for row in ref.logits]
    row = logits[j]
    other = int(row.topk(2).indices[1])
    row[other] = row.max() + rel_gap * row.abs().max()
    return GreedyRun(ref.tokens[:j] + [other] + ref.tokens[j + 1 :], logits, ref.seconds, ref.decode_step_s)


def test_tie_aware_check_accepts_a_planted_numerical_tie(monkeypatch):
    target = _target()
    prompt = torch.randint(0, V, (10,)).tolist()
    ref = greedy_run(target, prompt, 16, eos=set())
    assert not check_lossless(ref.tokens, ref, 1e-4)
    assert check_lossless(ref.tokens, _planted_tie(ref, 5, 1e-6), 1e-4)
    with pytest.raises(AssertionError, match="differs from greedy at token 5"):
        check_lossless(ref.tokens, _planted_tie(ref, 5, 1e-2), 1e-4)  # bf16-sized gap under the fp32 rule
    assert check_lossless(ref.tokens, _planted_tie(ref, 5, 1e-2), 2e-2)  # ... is a tie under the bf16 rule

    monkeypatch.setattr(ev, "greedy_run", lambda t, p, m, e: _planted_tie(ref, 5, 1e-6))
    rep = evaluate(target, PromptLookupProposer(), [prompt], max_new=16, chain=3, progress=False)
    assert rep.ties == 1 and rep.new_tokens == 16


def test_a_wrong_verifier_is_caught(monkeypatch):
    target = _target()
    prompt = torch.randint(0, V, (10,)).tolist()
    bad_target = _target()
    with torch.no_grad():
        bad_target.model.lm_head.weight.mul_(-1)  # a different model gives different tokens
    ref_bad = greedy_run(bad_target, prompt, 12, eos=set())
    assert ref_bad.tokens != greedy_run(target, prompt, 12, eos=set()).tokens

    class Liar:
        def start(self, ids, aux): pass
        def propose(self, k, costs=None): return [0] * k
        def accept(self, new, aux): pass

    monkeypatch.setattr(ev, "greedy_run", lambda t, p, m, e: ref_bad)
    monkeypatch.setitem(ev.TIE_RTOL, torch.float32, 2e-2)  # even the loose bf16 tolerance catches it
    with pytest.raises(AssertionError, match="differs from greedy"):
        evaluate(target, Liar(), [prompt], max_new=12, chain=3, progress=False)


def test_cli_runs_several_drafts_in_one_table(monkeypatch, tmp_path, capsys):
    from specforge.models import target as target_mod  # compat's check_drafts reads the target's config.json
    from specforge.training.checkpoint import save_checkpoint

    target = _target()
    draft = _draft(target)
    ckpt = save_checkpoint(tmp_path / "ckpt", 3, draft.config.to_hf_config(), draft.export_state_dict())
    rows = [{"input_ids": torch.randint(0, V, (20,)).tolist(), "loss_mask": [0] * 8 + [1] * 12} for _ in range(3)]
    loads = []
    monkeypatch.setattr(ev, "load_target", lambda cfg, **kw: loads.append(cfg) or target)
    monkeypatch.setattr(target_mod, "load_target_config", lambda cfg: target.model.config)
    from specforge.data import heldout

    monkeypatch.setattr(heldout, "heldout_rows", lambda cfg, tokenizer: rows)
    out_json = tmp_path / "eval.json"
    ev.main(["--draft", str(ckpt), "--draft", "prompt-lookup", "--num-prompts", "2", "--max-new-tokens", "10",
             "--chain", "3", "--threads", str(torch.get_num_threads()), "--draft-dtype", "float32",
             "--json", str(out_json)])
    assert len(loads) == 1  # the target is loaded once for every draft
    main_table = capsys.readouterr().out.split("\n\n")[0]  # the per-bucket table follows a blank line
    table = [line for line in main_table.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[:2] for line in table[1:]] == [
        [f"| {ckpt}", "chain 3 fixed"], [f"| {ckpt}", "dynamic <=3"], ["| prompt-lookup", "chain 3 fixed"]]
    report = json.loads(out_json.read_text())
    assert [r["setting"] for r in report["rows"]] == ["chain 3 fixed", "dynamic <=3", "chain 3 fixed"]
    assert all(r["prompts"] == 2 and r["new_tokens"] == 20 for r in report["rows"])
    assert report["acceptance_length"] == report["rows"][0]["acceptance_length"]
