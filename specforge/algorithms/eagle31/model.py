"""The EAGLE-3.1 draft: the EAGLE-3 draft (``algorithms/eagle3/model.py``) plus four switches, each a
top-level boolean of config.json as speculators, vLLM, SGLang and llama.cpp read it. Legend: ``h`` the
draft hidden a step reads (step 0: ``fc(A)``, later: what the previous step fed back), ``A`` the K
target features concatenated (``K x H_t`` wide), ``N_w`` an RMSNorm with weight ``w``.

=======================  ====================================================  =====================
flag                     math                                                  tensors
=======================  ====================================================  =====================
``norm_before_fc``       ``h0 = fc(N_input_norm(A))``: one norm over the       ``input_norm.weight``
                         whole concatenation                                   ``[K * H_t]``
``fc_norm``              ``h0 = fc(cat(N_fc_norm.k(A_k)))``: one norm per      ``fc_norm.{k}.weight``
                         feature (excludes ``norm_before_fc``)                 ``[H_t]`` each
``norm_before_residual`` the layer's residual is ``N_hidden_norm(h)``, not     (reuses hidden_norm)
                         ``h`` (q/k/v read the same ``N_hidden_norm(h)``)
``norm_output``          every step ends with ``y <- N_norm(y)``: the normed   (reuses norm)
                         ``y`` is fed back (the next step's ``h``) and the
                         logits are ``lm_head(y)``, no second norm
=======================  ====================================================  =====================

With every flag false the math is EAGLE-3's. The draft reuses EAGLE-3's pieces (``project_aux``,
``layer_finish``, ``logits``) with the switches inside them, so the TTT unroll (``forward``), the cached
forward (``forward_cached``) and the loss's reference run the same math; the two EAGLE-3 paths that
call ``fc`` directly (``_as_hidden`` and ``ChainDrafter.prefill``) go through the fc-side norms here.

``norm_output`` and the loss head: EAGLE-3's ``ttt_loss`` applies ``draft.norm`` to what the forward
hands its head; with ``norm_output`` that hidden is already normed, so the loss runs on a view of the
draft whose ``norm`` is the identity (``algorithms/eagle31/loss.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specforge.algorithms.eagle3.model import ChainDrafter, Eagle3Draft, Eagle3DraftConfig
from specforge.models.layers import RMSNorm, rotate_half

__all__ = ["FLAGS", "Eagle31DraftConfig", "Eagle31Draft", "Eagle31ChainDrafter", "flag_conflict"]

# config.json's top-level booleans (speculators' Eagle3SpeculatorConfig names), in the table's order
FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


def flag_conflict(flags: Mapping[str, object], key: str = "{}") -> Optional[str]:
    """The one message when both fc-side norms are set (speculators refuses the pair too), else None;
    ``key`` formats a flag's name (``"'draft.{}'"``: the config key)."""
    if flags.get("norm_before_fc") and flags.get("fc_norm"):
        return (f"{key.format('norm_before_fc')} and {key.format('fc_norm')} are both true: they are exclusive (one "
                "RMSNorm over the concatenated target features before fc, or one per feature); set one of them false")
    return None


@dataclass
class Eagle31DraftConfig(Eagle3DraftConfig):
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False

    def __post_init__(self):
        super().__post_init__()
        if (msg := flag_conflict(self.flags)) is not None:
            raise ValueError(msg)

    @property
    def flags(self) -> dict[str, bool]:
        return {f: bool(getattr(self, f)) for f in FLAGS}

    def to_hf_config(self) -> dict:
        """EAGLE-3's config.json plus the four flags at the top level (where every engine reads them),
        always written, false ones too (vLLM defaults an absent norm_before_residual to true)."""
        return {**super().to_hf_config(), **self.flags}

    @classmethod
    def from_hf_config(cls, d: Mapping) -> "Eagle31DraftConfig":
        return dataclasses.replace(super().from_hf_config(d), **{f: bool(d.get(f, False)) for f in FLAGS})

    @classmethod
    def of(cls, base: Eagle3DraftConfig, **flags: bool) -> "Eagle31DraftConfig":
        """``base`` (an EAGLE-3 draft config) with these flags."""
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Eagle3DraftConfig)}, **flags)


class Eagle31Draft(Eagle3Draft):
    """``Eagle3Draft`` with the EAGLE-3.1 switches (the module docstring): ``input_norm`` /
    ``fc_norm`` exist only when their flag is set (None otherwise), initialised to 1."""

    config: Eagle31DraftConfig

    def __init__(self, cfg: Eagle31DraftConfig):
        super().__init__(cfg)
        self._add_fc_norms()

    @classmethod
    def adopt(cls, draft: Eagle3Draft, cfg: Eagle31DraftConfig) -> "Eagle31Draft":
        """An initialised ``Eagle3Draft`` made this class in place (its parameters kept, nothing copied,
        no random numbers drawn) with the flags of ``cfg`` (otherwise equal to its config) and the
        fc-side norms they ask for, at 1: how ``build_draft`` reuses EAGLE-3's initialisation."""
        if not isinstance(draft, Eagle3Draft) or type(draft) not in (Eagle3Draft, cls):
            raise TypeError(f"adopt takes an Eagle3Draft, got {type(draft).__name__}")
        if Eagle31DraftConfig.of(cfg) != Eagle31DraftConfig.of(draft.config):
            raise ValueError("adopt: the EAGLE-3.1 config differs from the draft's beyond the flags")
        draft.__class__ = cls
        draft.config = cfg
        draft._add_fc_norms()
        return draft

    def _add_fc_norms(self) -> None:
        c = self.config
        Ht, eps = c.target_hidden_size, c.rms_norm_eps
        K = self.fc.in_features // Ht
        w = self.fc.weight

        def make(width: int) -> RMSNorm:
            return RMSNorm(width, eps).to(w.device, w.dtype)

        self.input_norm = make(K * Ht) if c.norm_before_fc else None
        self.fc_norm = nn.ModuleList([make(Ht) for _ in range(K)]) if c.fc_norm else None

    # ---------------------------------------------------------------- the switches

    def norm_aux(self, aux_hidden_BTKH: torch.Tensor) -> torch.Tensor:
        """The target features as ``fc`` reads them (``norm_before_fc`` / ``fc_norm``)."""
        if self.input_norm is not None:
            return self.input_norm(aux_hidden_BTKH)
        if self.fc_norm is not None:
            chunks = aux_hidden_BTKH.chunk(len(self.fc_norm), dim=-1)
            return torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks)], dim=-1)
        return aux_hidden_BTKH

    def project_aux(self, aux_hidden_BTKH: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm_aux(aux_hidden_BTKH))

    def _as_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] != self.config.hidden_size and hidden.shape[-1] == self.fc.in_features:
            return self.project_aux(hidden)  # EAGLE-3's calls fc directly: the fc-side norms would be skipped
        return super()._as_hidden(hidden)

    def layer_finish(self, attn_BHTD: torch.Tensor, hidden_BTH: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's, with ``hidden_norm(hidden)`` as the residual (``norm_before_residual``) and the
        final norm applied to the output (``norm_output``: what the next step reads)."""
        residual = self.midlayer.hidden_norm(hidden_BTH) if self.config.norm_before_residual else hidden_BTH
        out = super().layer_finish(attn_BHTD, residual)
        return self.norm(out) if self.config.norm_output else out

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """``lm_head(hidden)`` when ``norm_output`` normed it already, else EAGLE-3's ``lm_head(norm(hidden))``."""
        return self.lm_head(hidden_out) if self.config.norm_output else super().logits(hidden_out)


class Eagle31ChainDrafter(ChainDrafter):
    """EAGLE-3's fast chain drafter with the switches: the fc-side norms before ``fc`` in
    :meth:`prefill`, and :meth:`_layer` (EAGLE-3's, with the normed residual and the normed output
    when the flags ask; the flags-off case is EAGLE-3's own ``_layer``)."""

    def __init__(self, draft: Eagle31Draft, dtype: Optional[torch.dtype] = None, capacity: int = 1024):
        super().__init__(draft, dtype, capacity)
        c = draft.config
        self.residual_normed, self.output_normed = c.norm_before_residual, c.norm_output
        norms = [draft.input_norm] if draft.input_norm is not None else list(draft.fc_norm or [])
        self.aux_norms = [(n.weight.detach().to(self.dtype), n.eps) for n in norms]

    def prefill(self, ids_T: torch.Tensor, hidden_TX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.aux_norms and hidden_TX.shape[-1] == self.w_fc.shape[1]:  # raw target features
            chunks = hidden_TX.to(self.dtype).chunk(len(self.aux_norms), dim=-1)
            hidden_TX = torch.cat([F.rms_norm(x, w.shape, w, eps) for (w, eps), x in zip(self.aux_norms, chunks)], -1)
        return super().prefill(ids_T, hidden_TX)

    def _layer(self, e_TH: torch.Tensor, h_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.residual_normed or self.output_normed):
            return super()._layer(e_TH, h_TH)
        Hq, Hk, D = self.heads
        T, start = e_TH.shape[0], len(self.cache)
        if start + T > self.cos.shape[0]:
            self._rope_table(2 * (start + T))
        h_normed = self._norm(1, h_TH)
        qkv = F.linear(torch.cat([self._norm(0, e_TH), h_normed], dim=-1), self.w_qkv)
        qk, v = qkv.view(T, Hq + 2 * Hk, D).transpose(0, 1).split([Hq + Hk, Hk])
        cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        q, k = (qk * cos + rotate_half(qk) * sin).split([Hq, Hk])
        attn = self._attend(q, k, v, start)
        h = (h_normed if self.residual_normed else h_TH) + F.linear(attn.transpose(0, 1).reshape(T, Hq * D), self.w_o)
        gate, up = F.linear(self._norm(2, h), self.w_gate_up).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, self.w_down)
        if self.output_normed:
            h = self._norm(3, h)
            return h, F.linear(h, self.w_lm)
        return h, F.linear(self._norm(3, h), self.w_lm)
