import pytest
import torch

from specforge.eval import PromptLookupProposer, evaluate, greedy_decode, speculative_decode
from specforge.models.target import TargetModel
from tests.test_target import tiny_target


def _target(layers=6):
    model = tiny_target(num_layers=layers)
    return TargetModel(model=model, tokenizer=None, aux_layer_ids=[1, 2, 2], device=torch.device("cpu"))


class OracleProposer:
    """Proposes the target's own greedy continuation with a planted error every 3rd round."""

    def __init__(self, reference):
        self.reference = reference
        self.done = 0
        self.rounds = 0

    def start(self, ids, aux):
        self.done = 1

    def propose(self, k):
        self.rounds += 1
        cont = self.reference[self.done : self.done + k]
        cont = cont + [0] * (k - len(cont))
        if self.rounds % 3 == 0:
            cont[1] = (cont[1] + 1) % 320  # wrong at draft position 2
        return cont

    def accept(self, new, aux):
        assert aux.shape[0] == len(new)
        self.done += len(new)


def test_speculative_equals_greedy_and_counts_acceptance():
    target = _target()
    prompt = torch.randint(0, 320, (12,)).tolist()
    ref, _ = greedy_decode(target, prompt, 40, eos=set())
    assert len(ref) == 40
    out, st = speculative_decode(target, OracleProposer(ref), prompt, 40, chain=4, eos=set())
    assert out == ref
    # perfect rounds produce 5 tokens, every 3rd round exactly 2 (1 accepted + bonus)
    assert st.accepted_at[0] == st.verify_forwards
    assert st.accepted_at[1] < st.verify_forwards
    assert st.verify_forwards < 40 / 2


def test_prompt_lookup_output_is_exactly_greedy():
    target = _target()
    prompts = [torch.randint(0, 50, (16,)).tolist() for _ in range(3)]
    rep = evaluate(target, PromptLookupProposer(), prompts, max_new=24, chain=5, progress=False)
    assert rep.prompts == 3 and rep.new_tokens == 3 * 24
    assert 1.0 <= rep.acceptance_length <= 6.0


def test_a_wrong_verifier_is_caught():
    target = _target()
    prompt = torch.randint(0, 320, (10,)).tolist()
    ref, _ = greedy_decode(target, prompt, 12, eos=set())

    from specforge import eval as ev

    bad_target = _target()
    with torch.no_grad():
        bad_target.model.lm_head.weight.mul_(-1)  # a different model gives different tokens
    ref_bad, _ = greedy_decode(bad_target, prompt, 12, eos=set())
    assert ref_bad != ref

    class Liar:
        def start(self, ids, aux): pass
        def propose(self, k): return [0] * k
        def accept(self, new, aux): pass

    orig = ev.greedy_decode
    try:
        ev.greedy_decode = lambda t, p, m, e: (ref_bad, 0.01)
        with pytest.raises(AssertionError, match="differs from greedy"):
            evaluate(target, Liar(), [prompt], max_new=12, chain=3, progress=False)
    finally:
        ev.greedy_decode = orig
