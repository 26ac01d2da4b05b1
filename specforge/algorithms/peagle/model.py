"""The P-EAGLE draft: EAGLE-3's draft (``algorithms/eagle3/model.py``) plus two trained vectors.

P-EAGLE (parallel EAGLE; speculators' ``PEagleDraftModel``, vLLM's ``parallel_drafting``) drafts K
tokens in ONE forward: the last real row (target features + the next token, exactly EAGLE-3's
step 0) followed by K - 1 "mask" rows at the next positions. A mask row reads constant inputs:

    mask_embed    H         the embedding of ``mask_token_id`` (served as that row of the exported
                            ``embed_tokens``; every other row is the target's, frozen)
    mask_hidden   3*H       a learned vector in the raw aux-feature space, projected by ``fc`` like
                            a row of target features (speculators: ``mask_hidden`` [1, 1, 3H])

Training layout (:meth:`PEagleDraft.forward`, the signature of ``Eagle3Draft.forward``, so EAGLE-3's
TTT loss ``algorithms/eagle3/loss.py`` runs it unchanged, "TTT step" = depth): depth 0 is EAGLE-3's
step 0; depth ``d >= 1`` row ``t`` is anchor ``t``'s d-th mask row: ``embed(mask)``, ``fc(mask_hidden)``
(which is also its residual), RoPE position ``pos[t] + d``, attending to depth-0 keys ``<= t`` and to
its own anchor's depths ``1..d``: EAGLE-3's TTT mask. It predicts x_{t+2+d} against the teacher at
t+1+d, as TTT step d does. Nothing feeds back between depths (a depth reads no earlier depth's
output), so all depths are one pass of the same layer. This dense layout computes every (anchor,
depth) row; speculators subsamples rows per depth (COD), which picks a subset of these rows with the
same values (checked against speculators' model in tests/test_peagle.py).

The draft hidden size must equal the target's (speculators' loader refuses anything else), so the
embedding is always the target's, frozen; only its mask row is trained (``mask_embed``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge.algorithms.eagle3.model import Eagle3Draft, Eagle3DraftConfig
from specforge.models.layers import cast_once

__all__ = ["ARCHITECTURE", "PEagleDraftConfig", "PEagleDraft"]

ARCHITECTURE = "LlamaForCausalLMPEagle"  # config.json ``architectures`` of our saved folder (ours alone)


@dataclass
class PEagleDraftConfig(Eagle3DraftConfig):
    mask_token_id: int = 0  # the target id whose embedding row is the trained mask embedding
    parallel_tokens: int = 8  # K: depths trained, tokens one forward drafts

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(f"a P-EAGLE draft's hidden size ({self.hidden_size}) must equal the target's "
                             f"({self.target_hidden_size}): speculators' and vLLM's loaders refuse anything else")
        if not 0 <= int(self.mask_token_id) < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a target token (0..{self.vocab_size - 1})")
        if int(self.parallel_tokens) < 1:
            raise ValueError(f"parallel_tokens {self.parallel_tokens}: expected at least 1")

    @classmethod
    def of(cls, base: Eagle3DraftConfig, mask_token_id: int, parallel_tokens: int) -> "PEagleDraftConfig":
        """An EAGLE-3 draft config with the P-EAGLE fields."""
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Eagle3DraftConfig)},
                   mask_token_id=int(mask_token_id), parallel_tokens=int(parallel_tokens))

    def to_hf_config(self) -> dict:
        """EAGLE-3's config.json with our architecture and ``peagle_config`` (what no EAGLE-3 folder has)."""
        d = super().to_hf_config()
        d["architectures"] = [ARCHITECTURE]
        d["peagle_config"] = {"mask_token_id": int(self.mask_token_id), "parallel_tokens": int(self.parallel_tokens)}
        return d

    @classmethod
    def from_hf_config(cls, d: Mapping) -> "PEagleDraftConfig":
        extra = d.get("peagle_config") or {}
        return cls.of(Eagle3DraftConfig.from_hf_config(d), int(extra["mask_token_id"]), int(extra["parallel_tokens"]))


class PEagleDraft(Eagle3Draft):
    """EAGLE-3's draft with ``mask_embed`` and ``mask_hidden`` (both trained, both in
    ``export_state_dict``: EAGLE-3's holds every parameter but the frozen embedding); its forward
    is the parallel layout."""

    config: PEagleDraftConfig

    def __init__(self, cfg: PEagleDraftConfig):
        super().__init__(cfg)
        self.mask_embed = nn.Parameter(torch.empty(cfg.hidden_size))  # device: module init
        self.mask_hidden = nn.Parameter(torch.empty(3 * cfg.target_hidden_size))  # device: module init
        self.reset_mask()

    @torch.no_grad()
    def reset_mask(self, std: float = 0.02) -> None:
        """``mask_embed`` ~ N(0, std) (the target's mask row replaces it when there is a target);
        ``mask_hidden`` ~ N(0, 1), as speculators initialises it."""
        nn.init.normal_(self.mask_embed, std=std)
        nn.init.normal_(self.mask_hidden)

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        if hasattr(self, "mask_hidden"):  # Eagle3Draft.__init__ calls this before the mask exists
            self.reset_mask(std)

    @classmethod
    def from_eagle3(cls, base: Eagle3Draft, mask_token_id: int, parallel_tokens: int) -> "PEagleDraft":
        """A P-EAGLE draft holding ``base``'s tensors themselves (no copy: EAGLE-3's init is reused as
        it is), with the mask initialised by :meth:`reset_mask` (under the caller's RNG)."""
        cfg = PEagleDraftConfig.of(base.config, mask_token_id, parallel_tokens)
        with torch.device("meta"):
            draft = cls(cfg)
        missing, unexpected = draft.load_state_dict(base.state_dict(), strict=False, assign=True)
        assert sorted(missing) == ["mask_embed", "mask_hidden"] and not unexpected, (missing, unexpected)
        draft.register_buffer("inv_freq", base.inv_freq, persistent=False)
        device, dtype = base.fc.weight.device, base.fc.weight.dtype
        draft.mask_embed = nn.Parameter(torch.empty(cfg.hidden_size, device=device, dtype=dtype))
        draft.mask_hidden = nn.Parameter(torch.empty(3 * cfg.target_hidden_size, device=device, dtype=dtype))
        draft.reset_mask()
        draft.embed_tokens.weight.requires_grad_(draft.embedding_trainable)
        return draft

    @torch.no_grad()
    def init_mask_from_target(self, target_embed_VH: torch.Tensor) -> None:
        """The mask embedding starts as the target's row of ``mask_token_id``."""
        self.mask_embed.copy_(target_embed_VH[self.config.mask_token_id].to(self.mask_embed))

    # ---------------------------------------------------------------- the embedding with its mask row

    def embed(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """The target's embedding, with ``mask_embed`` for ``mask_token_id`` wherever it appears (a real
        occurrence too: the exported table has one row for it, so training reads what a server reads)."""
        e = self.embed_tokens(input_ids_BT)
        is_mask = (input_ids_BT == self.config.mask_token_id).unsqueeze(-1)
        return torch.where(is_mask, self.mask_embed.to(e.dtype), e)

    @torch.no_grad()
    def embedding_table(self) -> torch.Tensor:
        """``V x H``: the embedding a server reads (the target's, row ``mask_token_id`` = ``mask_embed``)."""
        table = self.embed_tokens.weight.detach().clone()
        table[self.config.mask_token_id] = self.mask_embed.detach().to(table.dtype)
        return table

    # ---------------------------------------------------------------- training: all depths at once

    def forward(self, input_ids_BT: torch.Tensor, aux_hidden_BTKH: torch.Tensor, position_ids_BT: torch.Tensor,
                t_len: Sequence[int], head: Optional[Callable[[int, torch.Tensor], Any]] = None,
                doc_ids_BT: Optional[torch.Tensor] = None) -> list:
        """``[head(d, hidden_out_B_Td_H) for depths d]`` (see the module docstring); the arguments of
        ``Eagle3Draft.forward``: depth ``d`` computes rows ``t < t_len[d]`` (non-increasing).
        ``doc_ids_BT``: packed rows (``data/packing.py``): a row of any depth attends only to its own
        sample's depth-0 keys (its own anchor's mask rows are of its sample already)."""
        core = self.midlayer.self_attn.core
        w_emb, w_hid = self.qkv_weights()
        w_hid = cast_once(w_hid)  # read by every depth: cast to the autocast dtype once (bit-identical)
        B = input_ids_BT.shape[0]
        e_in = self.embed(input_ids_BT)
        e_full = self.embed_part(e_in, w_emb)  # x_0..x_{T-1}, projected once
        h_real = self.project_aux(aux_hidden_BTKH)
        # the mask row's inputs, one row each, in the dtypes of the real rows' inputs
        e_mask = self.embed_part(self.mask_embed.view(1, 1, -1).to(e_in.dtype), w_emb)
        h_mask = self.project_aux(self.mask_hidden.view(1, 1, -1).to(aux_hidden_BTKH.dtype))  # fc(mask_hidden)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out = []
        # one tensor for every depth (as EAGLE-3's)
        kw = {} if doc_ids_BT is None else {"doc_ids_BT": doc_ids_BT[:, : t_len[0]]}
        for d, Td in enumerate(t_len):
            if d == 0:  # EAGLE-3's step 0: target features of row t, the embedding of x_{t+1}
                e, hidden = e_full[:, 1 : 1 + Td], h_real[:, :Td]
                if e.shape[1] < Td:
                    e = F.pad(e, (0, 0, 0, Td - e.shape[1]))
            else:  # the d-th mask row after anchor t: constant inputs
                e, hidden = e_mask.expand(B, Td, -1), h_mask.expand(B, Td, -1)
            q, k, v = self.layer_qkv(e, hidden, position_ids_BT[:, :Td] + d, w_hid())
            keys.append(k)
            values.append(v)
            # as Eagle3Draft.forward: depth-0 keys whole, diagonal keys cut to Td (the same objects when not cut)
            diag_k = [kk if kk.shape[2] == Td else kk[:, :, :Td] for kk in keys[1:]]
            diag_v = [vv if vv.shape[2] == Td else vv[:, :, :Td] for vv in values[1:]]
            attn = core(q, [keys[0], *diag_k], [values[0], *diag_v], **kw)
            h_out = self.layer_finish(attn, hidden)  # residual: the row's own input (fc(mask_hidden) at d >= 1)
            out.append(h_out if head is None else head(d, h_out))
        return out
