"""``draft.attention``: one list of values (``attention.CHOICES``), each running the core it names.

* every value the config accepts builds a draft whose TTT core runs that core (``auto``: ``fast``
  on a CPU, ``sdpa`` on a GPU);
* a value outside the list (``flash`` among them: no flash-attn TTT core exists) is one error
  naming the key and every accepted value, at the config and at the core alike (negative control).
"""

import pytest
import torch

from specforge.algorithms.eagle3 import attention
from specforge.algorithms.eagle3.attention import CHOICES, IMPLS, TTTAttentionCore, pick_impl
from specforge.algorithms.eagle3.model import Eagle3Draft, draft_config_from_target
from specforge.config import load_config

TARGET = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 80, "num_hidden_layers": 6, "rms_norm_eps": 1e-6, "max_position_embeddings": 256}


def test_the_config_accepts_exactly_the_cores_and_auto():
    assert set(CHOICES) == {"auto", *IMPLS} and "auto" not in IMPLS
    for value in CHOICES:
        assert load_config(None, [f"draft.attention={value}"]).draft.attention == value


def test_auto_picks_fast_on_a_cpu_flex_on_cuda_and_a_name_picks_itself():
    assert pick_impl("auto", "cpu") == "fast" and pick_impl("auto", "cuda") == "flex"  # measured on an H200
    assert pick_impl("auto", "cuda", packed=True) == "sdpa" and pick_impl("auto", "xpu") == "sdpa"
    for name in IMPLS:
        assert pick_impl(name, "cpu") == name and pick_impl(name, "cuda") == name


@pytest.mark.parametrize("value", CHOICES)
def test_each_value_runs_the_core_it_names(value, monkeypatch):
    cfg = load_config(None, [f"draft.attention={value}", "draft.vocab_size=40"])
    draft = Eagle3Draft(draft_config_from_target(TARGET, cfg.draft, [1, 2, 3]))
    core = draft.midlayer.self_attn.core
    assert core.impl == value
    ran = []
    for name, fn in IMPLS.items():
        monkeypatch.setitem(attention.IMPLS, name, lambda *a, _n=name, _f=fn, **k: ran.append(_n) or _f(*a, **k))
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    out = core(q, [k, torch.randn(1, 2, 6, 8)], [v, torch.randn(1, 2, 6, 8)])
    assert ran == [pick_impl(value, "cpu")] and out.shape == q.shape


@pytest.mark.parametrize("value", ["flash", "Fast", "flash_attention_2"])
def test_a_value_outside_the_list_is_one_error_naming_the_key_and_the_values(value):
    listed = ", ".join(map(repr, CHOICES))
    with pytest.raises(ValueError, match="config key 'draft.attention'") as e:
        load_config(None, [f"draft.attention={value}"])
    assert "\n" not in str(e.value) and listed in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="config key 'draft.attention'") as e:
        TTTAttentionCore(value)
    assert "\n" not in str(e.value) and listed in str(e.value), str(e.value)
