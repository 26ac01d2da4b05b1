"""Acceptance per prompt-length bucket (``specforge.eval --buckets``, ``--long``) and its llama.cpp twin.

* Accounting: a scripted draft that is perfect on some prompts and always wrong on others gives
  known rounds (chain 4, 21 new tokens: 4 rounds of 5 tokens, or 20 rounds of 1), so each bucket's
  acceptance is known exactly; the bucket edges are half-open (a prompt of exactly an edge's length
  is in the bucket above it); an empty bucket has no figure (None), not 0.
* The CLI: the second table and the JSON rows carry the buckets; edges and the prompt limits are
  checked before anything loads (one ``error:`` line, exit 1); the note names the buckets no prompt
  can reach and why (the prompt limit, or the target's positions).
* The llama.cpp rows: per bucket the same figure from the server's counters (``summarize``).
"""

import json

import pytest
import torch

from specforge import eval as ev
from specforge.cli import run_cli
from specforge.eval import Setting, bucket_labels, bucket_rows, evaluate_settings, greedy_decode, parse_buckets
from specforge.models.target import TargetModel
from tests.helpers.models import tiny_target

V = 320
MAX_NEW, CHAIN = 21, 4  # a perfect draft: 1 token from the prefill + 4 rounds of 5


def _target():
    model = tiny_target(num_layers=4)
    model.config.eos_token_id = model.generation_config.eos_token_id = None  # every decode runs MAX_NEW tokens
    return TargetModel(model=model, tokenizer=None, aux_layer_ids=[0, 1, 2], device=torch.device("cpu"))


class ScriptedProposer:
    """The target's own greedy continuation on prompts of the lengths in ``good``; a wrong first
    draft token on every other prompt (every round then yields the target's token alone)."""

    def __init__(self, refs: dict, good: set):
        self.refs, self.good = refs, good
        self.ref, self.done, self.ok = [], 0, True

    def start(self, ids, aux):
        prompt = tuple(ids[:-1])
        self.ref, self.done, self.ok = self.refs[prompt], 1, len(prompt) in self.good

    def propose(self, k, costs=None):
        cont = self.ref[self.done : self.done + k]
        cont = cont + [0] * (k - len(cont))
        if not self.ok:
            cont[0] = (self.ref[self.done] + 1) % V
        return cont

    def accept(self, new, aux):
        self.done += len(new)


def test_each_bucket_counts_its_own_prompts_rounds():
    target = _target()
    torch.manual_seed(1)
    prompts = [torch.randint(3, V, (n,)).tolist() for n in (8, 15, 16, 11)]
    refs = {tuple(p): greedy_decode(target, p, MAX_NEW + 2 * CHAIN, eos=set())[0] for p in prompts}
    proposer = ScriptedProposer(refs, good={8, 11})
    (rep,) = evaluate_settings(target, [Setting("d", proposer)], prompts, MAX_NEW, CHAIN, progress=False,
                               buckets=(12, 16, 40))
    got = {b["bucket"]: b for b in rep.buckets}
    assert list(got) == ["<12", "12-16", "16-40", ">=40"]
    # <12: prompts 8 and 11, perfect: 2 x 20 tokens in 2 x 4 forwards
    assert (got["<12"]["prompts"], got["<12"]["tokens"], got["<12"]["verify_forwards"]) == (2, 40, 8)
    assert got["<12"]["acceptance_length"] == 5.0
    # 15 < 16: in 12-16; 16 itself opens 16-40 (half-open edges); both always wrong: 1 token a forward
    assert (got["12-16"]["prompts"], got["12-16"]["verify_forwards"], got["12-16"]["acceptance_length"]) == (1, 20, 1.0)
    assert (got["16-40"]["prompts"], got["16-40"]["verify_forwards"], got["16-40"]["acceptance_length"]) == (1, 20, 1.0)
    assert got[">=40"]["prompts"] == 0 and got[">=40"]["acceptance_length"] is None  # empty: no figure, not 0
    # the buckets add up to the overall figure (the same definition)
    assert rep.acceptance_length == pytest.approx(80 / 48)
    assert (sum(b["tokens"] for b in rep.buckets) / sum(b["verify_forwards"] for b in rep.buckets)
            == rep.acceptance_length)


def test_bucket_rows_and_labels():
    assert bucket_labels((1024, 4096, 8192)) == ["<1k", "1k-4k", "4k-8k", ">=8k"]
    assert bucket_labels((1000, 3000)) == ["<1000", "1000-3000", ">=3000"]
    rows = bucket_rows((1024, 4096, 8192), [100, 1023, 1024, 5000], [10, 20, 30, 40], [5, 10, 10, 40])
    assert [r["prompts"] for r in rows] == [2, 1, 1, 0]
    assert [r["acceptance_length"] for r in rows] == [2.0, 3.0, 1.0, None]
    assert [(r["min_tokens"], r["max_tokens"]) for r in rows] == [(0, 1024), (1024, 4096), (4096, 8192), (8192, None)]


@pytest.mark.parametrize("text", ["0,10", "10,5", "10,10", "a,b", "", "1024,,4096", "-5"])
def test_bad_bucket_edges_are_one_error_line(text, capsys):
    assert run_cli(lambda: ev.main(["--draft", "prompt-lookup", "--buckets", text])) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"error: --buckets {text}: expected strictly increasing"), err
    assert parse_buckets("1024,4096,8192") == (1024, 4096, 8192)  # the default passes


@pytest.mark.parametrize("args, needle", [
    (["--min-prompt-tokens", "1"], "--min-prompt-tokens must be >= 2, got 1"),
    (["--min-prompt-tokens", "500", "--max-prompt-tokens", "100"],
     "--min-prompt-tokens 500 exceeds --max-prompt-tokens 100"),
])
def test_bad_prompt_limits_are_one_error_line(args, needle, capsys):
    assert run_cli(lambda: ev.main(["--draft", "prompt-lookup", *args])) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def _rows(prompt_lengths):
    torch.manual_seed(2)
    return [{"input_ids": torch.randint(3, V, (n + 12,)).tolist(), "loss_mask": [0] * n + [1] * 12}
            for n in prompt_lengths]


@pytest.fixture
def cli(monkeypatch):
    """specforge.eval's main on the tiny target and held-out rows whose first replies start at 8, 14, 30."""
    import specforge.eval as ev
    from specforge.data import heldout

    target = _target()
    monkeypatch.setattr(ev, "load_target", lambda cfg, **kw: target)
    monkeypatch.setattr(heldout, "heldout_rows", lambda cfg, tokenizer: _rows([8, 14, 30]))
    return target


def test_cli_prints_and_writes_the_buckets(cli, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert ev.main(["--draft", "prompt-lookup", "--max-new-tokens", "10", "--chain", "3", "--buckets", "10,20,40",
                    "--max-prompt-tokens", "35", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| draft | setting | <10 (1) | 10-20 (1) | 20-40 (1) | >=40 (0) |" in text
    row = next(line for line in text.split("\n\n")[1].splitlines() if line.startswith("| prompt-lookup"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["prompt-lookup", "chain 3 fixed"] and cells[-1] == "" and all(cells[2:5])
    assert "buckets >=40 stay empty: prompts are at most 35 tokens (--max-prompt-tokens" in text
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert [b["bucket"] for b in row["buckets"]] == ["<10", "10-20", "20-40", ">=40"]
    assert [b["prompts"] for b in row["buckets"]] == [1, 1, 1, 0]
    assert row["buckets"][-1]["acceptance_length"] is None
    assert [float(c) for c in cells[2:5]] == pytest.approx([b["acceptance_length"] for b in row["buckets"][:3]],
                                                           abs=5e-4)
    assert report["prompt_tokens"] == [8, 14, 30] and report["bucket_edges"] == [10, 20, 40]
    assert report["unreachable_buckets"] == [">=40"] and report["max_prompt_tokens"] == 35
    total = sum(b["tokens"] for b in row["buckets"]) / sum(b["verify_forwards"] for b in row["buckets"])
    assert total == pytest.approx(row["acceptance_length"])


def test_prompts_are_capped_at_the_targets_positions(cli, capsys):
    cli.model.config.max_position_embeddings = 35  # 35 - 10 new tokens: 25 tokens of prompt at most
    assert ev.main(["--draft", "prompt-lookup", "--max-new-tokens", "10", "--chain", "3", "--buckets", "10,20,40",
                    "--max-prompt-tokens", "300"]) == 0
    text = capsys.readouterr().out
    assert "| <10 (1) | 10-20 (1) | 20-40 (0) | >=40 (0) |" in text  # the 30-token prompt does not fit
    assert "buckets >=40 stay empty: prompts are at most 25 tokens (the target has 35 positions" in text
    assert run_cli(lambda: ev.main(["--draft", "prompt-lookup", "--max-new-tokens", "34"])) == 1
    assert "leaves no room for a prompt in the target's 35 positions" in capsys.readouterr().err


def test_min_prompt_tokens_drops_short_prompts(cli, capsys):
    assert ev.main(["--draft", "prompt-lookup", "--max-new-tokens", "6", "--chain", "2", "--buckets", "10,20",
                    "--min-prompt-tokens", "10"]) == 0
    assert "| <10 (0) | 10-20 (1) | >=20 (1) |" in capsys.readouterr().out


def test_llamacpp_rows_carry_the_same_bucket_figure():
    """summarize: per bucket, tokens per target forward from the server's counters, the eval's
    definition (each forward = 1 + its accepted draft tokens; the prefill made the first token)."""
    from specforge.engines.llamacpp import Completion
    from specforge.eval.served import Setting as EngineSetting
    from specforge.eval.served import format_row, summarize

    def done(n, accepted, rounds):
        return Completion(tokens=list(range(n)), text="", prompt_n=0, predicted_n=n, predicted_ms=10.0,
                          draft_n=3 * rounds, draft_n_accepted=accepted, verify_rounds=rounds)

    runs = [done(21, 10, 8), done(21, 0, 20), done(11, 5, 4)]  # forwards: 10, 20, 5
    ref = [done(21, 0, 0), done(21, 0, 0), done(11, 0, 0)]
    row = summarize(EngineSetting("d", None, n_max=3), runs, ref, 100.0, [500, 2000, 900], (1024, 4096, 8192))
    assert [b["prompts"] for b in row.buckets] == [2, 1, 0, 0]
    assert row.buckets[0]["acceptance_length"] == pytest.approx(30 / 15)  # (20 + 10) tokens / (10 + 5) forwards
    assert row.buckets[1]["acceptance_length"] == 1.0
    assert row.buckets[2]["acceptance_length"] is None and row.buckets[3]["acceptance_length"] is None
    assert row.tokens_per_forward == pytest.approx(50 / 35)
    assert format_row(row).startswith("| d | 3 | 0 |")
    table = ev.format_buckets([row], bucket_labels((1024, 4096, 8192)))
    assert table.splitlines()[-1] == "| d | n_max 3, p_min 0 | 2.000 | 1.000 |  |  |"
