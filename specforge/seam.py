"""The draft-algorithm seam, at the ground of the package (imports no torch and nothing of specforge):
the roles an algorithm plays, each a small protocol its callers take, and the run facts its hooks are
bound to. The registry (``specforge/registry.py``) turns a name or a saved folder into an algorithm.

An algorithm is one package under ``specforge/algorithms/`` exposing ``ALGORITHM``, an object that
plays every role below. Unbound (as the registry hands it out) it reads configs and saved drafts:
``Configured``, ``Format`` and ``Drafting``. ``bind(cfg)`` reads what its hooks need of one run, once
(``RunFacts``: its ``draft.*`` options and the few run keys that change its math), and returns the
object the run trains with, which also plays ``Training`` and ``MemoryTerms``; their hooks take no
config. Each caller names the one role it uses in its signature.

Why these roles: each is what one part of the project asks, and no caller asks two of them apart
from the runtime that builds the run. The config layer checks keys before anything loads
(``Configured``); the trainer, the workers and the planner build and train a draft (``Training``);
the memory model and the dry run count a step (``MemoryTerms``); checkpoints, ``draft.init_from``,
``python -m specforge.export`` and llama.cpp read and write a saved draft (``Format``); the eval
drafts with a loaded one (``Drafting``).

Legend of the hooks: B batch, T tokens, K aux layers, H the target's hidden size. ``batch`` is a
``TrainBatch`` (or an ``SPTrainBatch``): the target features of the layers ``feature_layers`` chose
(``aux_hidden_BTKH``: K layer outputs concatenated, K*H wide), the last hidden state, the target
argmax, the input ids and the loss mask, whatever the feature source.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:  # annotations only: the seam imports no torch
    import torch

__all__ = ["RunFacts", "ExportRequest", "Configured", "Training", "MemoryTerms", "Format", "Drafting",
           "DraftAlgorithm", "BoundAlgorithm", "Binds", "ROLES", "BINDING", "role_members", "missing_members"]


@dataclass(frozen=True)
class RunFacts:
    """What an algorithm's bound hooks read of one run: its own options and the run keys that change
    what its step computes or counts. Read once, by ``bind``."""

    draft: Any  # the run's ``draft.*`` options (an instance of the algorithm's ``options`` class)
    seed: int  # train.seed: a fresh draft's init and random anchors are functions of it
    aux_layer_ids: Optional[tuple[int, ...]]  # model.aux_layer_ids (None: the algorithm's default)
    sp_ulysses: int = 1  # parallel.sp_ulysses
    sp_ring: int = 1  # parallel.sp_ring
    samples_per_row: int = 1  # samples one train row may hold: batch_size x grad_accum when packed, else 1
    loss: str = "kl_div"  # train.loss: the row loss against the target's distribution (kernels/losses.py)

    @classmethod
    def of(cls, cfg) -> RunFacts:
        """The facts of a run config (``specforge.config.Config``)."""
        ids = cfg.model.aux_layer_ids
        tr = cfg.train
        return cls(draft=cfg.draft, seed=tr.seed, aux_layer_ids=None if ids is None else tuple(ids),
                   sp_ulysses=cfg.parallel.sp_ulysses, sp_ring=cfg.parallel.sp_ring,
                   samples_per_row=1 if tr.pack_tokens is None else tr.batch_size * tr.grad_accum,
                   loss=tr.loss)


@dataclass
class ExportRequest:
    """What ``python -m specforge.export`` hands an algorithm's ``export`` hook."""

    out: Path  # the final folder (the hook writes into a temporary one, renamed into place)
    target: Optional[str]  # the target's HF folder or hub id (None: not given and not needed)
    target_config: Any = None  # its transformers config
    num_speculative_tokens: Optional[int] = None  # vllm: the proposal length asked for


# ---------------------------------------------------------------- unbound roles


class Configured(Protocol):
    """What the config layer asks before anything loads, and the binding to one run."""

    name: str
    options: type  # a ``config.DraftConfig`` subclass: the ``draft.*`` keys this algorithm reads
    reads_last_layer: bool  # its feature layer may be the target's last (L-1: MTP), past EAGLE-3's L-2

    def config_errors(self, cfg) -> list[str]:
        """Checks of the config alone: one message per problem, naming the key."""

    def bind(self, cfg) -> BoundAlgorithm:
        """This algorithm with ``RunFacts.of(cfg)``: the object a run trains, counts and saves with."""


class Format(Protocol):
    """A saved draft: its checkpoint, the published folders it reads, its engine exports."""

    architecture: str  # config.json ``architectures`` entry of its saved folder
    refines: Optional[str]  # the algorithm whose saved format this one's extends (EAGLE-3.1: EAGLE-3's flags
    # set): where both own a folder, this one does (``registry.owner``); None for a format of its own
    engines: tuple[str, ...]  # the engines whose export it writes (``specforge.export.ENGINES``)
    llamacpp_spec_type: Optional[str]  # ``llama-server --spec-type`` (None: llama.cpp cannot serve it)
    gguf_architecture: Optional[str]  # ``general.architecture`` of its draft GGUF

    def hf_config(self, draft) -> dict:
        """The checkpoint's config.json (the format its servers load; what a run's checkpoint saves)."""

    def owns_checkpoint(self, hf_config: dict) -> bool:
        """Whether a saved folder's config.json is this algorithm's (where two claim it, the one that
        ``refines`` the other's format owns it, whatever the order of the registry's names)."""

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        """Whether a draft GGUF (its ``general.architecture`` and tensor names) is this algorithm's."""

    def check_checkpoint(self, path) -> tuple[dict, Any]:
        """``(config.json, weights or None)`` of a valid saved folder; a ValueError naming every problem."""

    def load(self, path, target) -> torch.nn.Module:
        """A saved draft folder, with the frozen parts taken from ``target``."""

    def owns_published(self, hf_config: dict) -> bool:
        """Whether a published draft folder's config.json (ours, or an engine's format this algorithm
        reads: SGLang, speculators/vLLM, z-lab's DFlash) is this algorithm's (``draft.init_from``; two
        claims resolved as ``owns_checkpoint``'s)."""

    def read_published(self, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
        """``(config.json in our saved format, weights named as the draft's export_state_dict)`` of a
        published folder this algorithm owns; only the names are mapped, nothing is checked against a
        run (``specforge/training/init_from.py`` loads them strictly into a fresh draft)."""

    def tokens_per_round(self, hf_config: dict) -> int:
        """Draft tokens a round an engine is told to ask for by default."""

    def recorded_layers(self, hf_config: dict) -> Optional[list[int]]:
        """The target layer outputs a saved draft reads, as its config.json records them (our numbering;
        None if it records none). ``Binds`` reads EAGLE-3's and DFlash's keys (``recorded_layers``)."""

    def refusal(self, engine: str) -> Optional[str]:
        """Why ``engine`` (one not in ``engines``) cannot serve this algorithm's drafts, for the export's
        one-line refusal (None: no reason beyond that; ``Binds``' default)."""

    def max_tokens_per_round(self, hf_config: dict) -> Optional[int]:
        """The most draft tokens one round can propose (None: no bound)."""

    def export(self, engine: str, draft_dir: Path, out_dir: Path, req: ExportRequest) -> str:
        """Write ``engine``'s format (sglang, vllm) into ``out_dir``; returns the serve command."""

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        """The config.json llama.cpp's converter reads for this draft (a staged copy's)."""


class Drafting(Protocol):
    """What the eval drafts with, given a loaded draft."""

    dynamic_drafting: bool  # whether the eval also runs it with cost-based early stops (a chain, not a block)

    def proposer(self, draft, dtype: Optional[torch.dtype], as_served: bool = False):
        """The eval's proposer: ``start(ids, aux_TH)``, ``propose(k, costs=None)``, ``accept(new, aux_TH)``.
        A block draft proposes from its whole trained block; ``as_served``: from a block as long as the
        drafts asked for, as vLLM and llama.cpp run it (``dflash.propose.block_rows``). Drafts with no
        block (a chain, P-EAGLE's parallel rows, XPress's always-whole block) propose the same either way."""


# ---------------------------------------------------------------- bound roles (hooks take no config)


class Training(Protocol):
    """What the planner, the workers and the trainer ask of a bound algorithm."""

    packs: bool  # whether its loss keeps the samples of a packed row apart (``train.pack_tokens``; else refused)
    packs_sp: bool  # whether it does so with sequence parallelism too (its SP cores take the rows' sample ids)

    def feature_layers(self, num_layers: int) -> list[int]:
        """The target layer outputs the draft reads (``model.aux_layer_ids`` or the default)."""

    def check(self, target_config) -> None:
        """What the config cannot say alone (against the target's config.json): a ValueError naming the key."""

    def draft_vocab_size(self, target_vocab_size: int) -> int:
        """Entries of the run's draft-vocab file."""

    def identity(self) -> dict[str, Any]:
        """The config values a checkpoint must share with the run resuming it (what changes the math)."""

    def sp_halo(self) -> int:
        """Rows past its own slice a sequence-parallel rank reads (0: the algorithm refuses SP)."""

    def sp_cores(self, draft) -> list[tuple[torch.nn.Module, str]]:
        """``(module, attribute)`` of each attention core sequence parallelism wraps."""

    def build_draft(self, target, vocab) -> torch.nn.Module:
        """A fresh draft shaped for ``target`` (a ``TargetModel``), its init a function of the seed alone."""

    def train_state(self, target, vocab) -> Any:
        """Frozen tensors the loss needs besides the draft (EAGLE-3: the teacher rows), or None."""

    def normalizer(self, draft, batch, step: int, *, training: bool) -> torch.Tensor:
        """This micro-batch's share of the loss denominator (summed over micro-batches and ranks): a
        0-dim tensor on the batch's device, or a vector where the loss averages several terms apart
        (summed entry by entry); never read to the host (a read is a GPU sync). ``training``: a train
        step's (else held-out metrics'), said by the trainer: a hook never reads it off grad mode, so
        a caller may run the normalizer under ``no_grad`` and still draw a train step's anchors."""

    def loss(self, draft, batch, state, step: int, normalizer: Optional[torch.Tensor], *,
             training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, counts)`` of one micro-batch: the loss is its share of the global mean when
        ``normalizer`` (the global sum, a float64 tensor on the device, the normalizer's shape) is given;
        counts are raw float64 sums, reduced once. ``training`` as the normalizer's."""

    def counts_shape(self) -> tuple[int, int]:
        """The shape of the summed counters."""

    def metrics(self, counts: torch.Tensor) -> dict[str, float]:
        """Rates from the summed counters (loss, per-position accuracy, simulated acceptance tau)."""


class MemoryTerms(Protocol):
    """What the memory model and the dry run count of a bound algorithm's step (with ``Training.sp_halo``:
    a sequence-parallel step's rows grow by it)."""

    def memory_step(self, draft, shape, precision, gpu: bool) -> dict[str, list]:
        """The memory model's terms of one micro-batch's step (``specforge.memory``), by phase."""

    def memory_keys(self) -> list[str]:
        """Config keys that shrink a train device's step, for the memory refusal's message."""


class DraftAlgorithm(Configured, Format, Drafting, Protocol):
    """A registry entry: every unbound role."""


class BoundAlgorithm(DraftAlgorithm, Training, MemoryTerms, Protocol):
    """An algorithm bound to one run (``bind``): every role."""

    facts: RunFacts


ROLES = (Configured, Format, Drafting, Training, MemoryTerms)
BINDING = ("facts", "run", "opt")  # what ``Binds`` adds to every algorithm besides the roles' members


def role_members(role) -> list[str]:
    """The members a role declares: its annotated attributes and its methods, in order (a role's
    Protocol bases' too)."""
    names: dict[str, None] = {}
    for cls in reversed(role.__mro__):
        if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
            continue
        names.update(dict.fromkeys(n for n in vars(cls).get("__annotations__", {}) if not n.startswith("_")))
        names.update(dict.fromkeys(n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")))
    return list(names)


def missing_members(algorithm) -> list[str]:
    """``Role.member`` for each member of a role that ``algorithm`` (a registry entry: unbound, so
    looked up without calling a property) lacks; empty when it plays every role."""
    missing = []
    for role in ROLES:
        for name in role_members(role):
            try:
                inspect.getattr_static(algorithm, name)
            except AttributeError:
                missing.append(f"{role.__name__}.{name}")
    return missing


def recorded_layers(hf_config: dict) -> Optional[list[int]]:
    """The layer ids a draft's config.json records under EAGLE-3's key (``eagle_config``
    ``eagle_aux_hidden_state_layer_ids``, SGLang's) or DFlash's (``dflash_config`` ``target_layer_ids``:
    the same numbering); None if neither is there."""
    ids = (hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (hf_config.get("dflash_config") or {}).get("target_layer_ids")
    return None if ids is None else [int(i) for i in ids]


class Binds:
    """The binding every algorithm shares: the registry's object is unbound (``facts`` None); ``bind``
    returns a copy of it holding one run's facts, which its bound hooks read (``run``; ``opt``: the
    options). Also the default of a hook or two every algorithm but one shares (``recorded_layers``)."""

    facts: Optional[RunFacts] = None
    refines: Optional[str] = None  # Format.refines: a format of its own
    reads_last_layer = False  # Configured.reads_last_layer: only MTP's may be the target's last layer

    def recorded_layers(self, hf_config: dict) -> Optional[list[int]]:
        return recorded_layers(hf_config)

    def refusal(self, engine: str) -> Optional[str]:
        return None

    def bind(self, cfg) -> BoundAlgorithm:
        bound = copy.copy(self)
        bound.facts = RunFacts.of(cfg)
        return bound

    @property
    def run(self) -> RunFacts:
        """The bound run's facts; a RuntimeError on the registry's unbound object."""
        if self.facts is None:
            raise RuntimeError(f"{type(self).__name__}: a run's hook was called on the registry's unbound "
                               "algorithm; bind it to the run first (registry.bound_algorithm(cfg))")
        return self.facts

    @property
    def opt(self):
        """The bound run's ``draft.*`` options."""
        return self.run.draft
