"""The algorithm seam, at the ground of the package (imports no torch and nothing of specforge):
the hooks' protocol, the registry, the name -> algorithm lookup and the draft-config reader.

Draft algorithms behind one seam: the runtime trains, checkpoints, evaluates and exports any of them.

An algorithm is one package (``eagle3/``, ``dflash/``) exposing ``ALGORITHM``, an object with the
hooks of :class:`DraftAlgorithm` (below): its config keys, which target layers
it reads, how its draft is built, its loss and metrics, what sequence parallelism wraps, its memory
terms, how its checkpoint is checked and loaded, its proposer for the eval, its engine exports.
A name becomes an algorithm here, by ``get_algorithm`` (which imports its package only then): the
entry points, config validation and the runtime ask it; below the runtime (models, data, parallel,
memory terms, the trainer) a function is handed the algorithm object and never looks one up, and no
code outside ``specforge/algorithms/`` compares a name (``tests/test_layering.py``). A new
algorithm is its package plus one line in ``NAMES``.

Legend of the hooks: B batch, T tokens, K aux layers, H the target's hidden size. ``batch`` is a
``TrainBatch`` (or an ``SPTrainBatch``): the target features of the layers ``feature_layers`` chose
(``aux_hidden_BTKH``: K layer outputs concatenated, K*H wide), the last hidden state, the target
argmax, the input ids and the loss mask, whatever the feature source.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:  # annotations only: the seam imports no torch
    import torch

__all__ = ["NAMES", "DraftAlgorithm", "ExportRequest", "get_algorithm", "algorithm_of", "algorithm_name",
           "feature_layers", "load_draft", "by_gguf", "published_algorithm_name", "read_draft_config"]

# the registry: each name is a package specforge/algorithms/<name>/ exposing ALGORITHM
NAMES = ("eagle3", "dflash", "dspark", "eagle31", "peagle")


def get_algorithm(name: str) -> DraftAlgorithm:
    if name not in NAMES:
        raise ValueError(f"config key 'draft.algorithm'={name!r}: one of {', '.join(NAMES)}")
    return importlib.import_module(f"specforge.algorithms.{name}").ALGORITHM


def algorithm_name(hf_config: dict, where: str = "draft") -> str:
    """The algorithm of a saved draft, from its config.json: the last registered algorithm that owns
    it (``owns_checkpoint``; a later algorithm may refine an earlier one's format, so it asks first)."""
    for name in reversed(NAMES):
        if get_algorithm(name).owns_checkpoint(hf_config):
            return name
    known = sorted({get_algorithm(n).architecture for n in NAMES})
    raise ValueError(f"{where}: config.json architectures {hf_config.get('architectures') or []} is none of "
                     f"{', '.join(known)}; not a draft checkpoint this project wrote")


def published_algorithm_name(hf_config: dict, where: str) -> str:
    """The algorithm of a published draft folder (``draft.init_from``): ours or an engine's format
    (``owns_published``, asked last registered first); a ValueError naming ``where`` if none reads it."""
    for name in reversed(NAMES):
        if get_algorithm(name).owns_published(hf_config):
            return name
    kind = hf_config.get("speculators_model_type") or hf_config.get("architectures") or []
    raise ValueError(f"{where}: config.json ({kind}) is not a draft folder any algorithm here reads ({', '.join(NAMES)}: "
                     "ours, SGLang's EAGLE-3, a speculators/vLLM EAGLE-3 export or z-lab's DFlash)")


def algorithm_of(hf_config: dict, where: str = "draft") -> DraftAlgorithm:
    """The algorithm of a saved draft, from its config.json ``architectures``."""
    return get_algorithm(algorithm_name(hf_config, where))


def by_gguf(arch: str, tensor_names) -> Optional[DraftAlgorithm]:
    """The algorithm whose draft GGUF has ``general.architecture`` ``arch`` and these tensors (the last
    registered that owns it, ``owns_gguf``); None: none of ours."""
    return next((a for a in map(get_algorithm, reversed(NAMES)) if a.owns_gguf(arch, set(tensor_names))), None)


def feature_layers(cfg, num_layers: int) -> list[int]:
    """The target layer outputs the run's draft algorithm reads (``model.aux_layer_ids`` checked
    against a target of ``num_layers`` layers, else the algorithm's default)."""
    return get_algorithm(cfg.draft.algorithm).feature_layers(cfg, num_layers)


def read_draft_config(path: str | Path) -> dict:
    """config.json of a draft folder (no weights), with the error the checkpoint loader gives."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"{str(path)!r} is not a draft checkpoint (needs config.json and model.safetensors)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(f)!r} is not valid JSON ({e}): a truncated or hand-edited draft checkpoint") from None


def load_draft(path, target):
    """A saved draft folder of any algorithm (its config.json says which), frozen parts from ``target``."""
    return algorithm_of(read_draft_config(path), repr(str(path))).load(path, target)


# ---------------------------------------------------------------- the hooks (a Protocol: duck-typed, for readers and type checkers)

@dataclass
class ExportRequest:
    """What ``python -m specforge.export`` hands an algorithm's ``export`` hook."""

    out: Path  # the final folder (the hook writes into a temporary one, renamed into place)
    target: Optional[str]  # the target's HF folder or hub id (None: not given and not needed)
    target_config: Any = None  # its transformers config
    num_speculative_tokens: Optional[int] = None  # vllm: the proposal length asked for


class DraftAlgorithm(Protocol):
    name: str
    options: type  # a ``config.DraftConfig`` subclass: the ``draft.*`` keys this algorithm reads
    architecture: str  # config.json ``architectures`` entry of its saved folder
    dynamic_drafting: bool  # whether the eval also runs it with cost-based early stops (a chain, not a block)
    packs: bool  # whether its loss keeps the samples of a packed row apart (``train.pack_tokens``; else refused)
    packs_sp: bool  # whether it does so with sequence parallelism too (its SP cores take the rows' sample ids)
    llamacpp_spec_type: Optional[str]  # ``llama-server --spec-type`` (None: llama.cpp cannot serve it)
    gguf_architecture: Optional[str]  # ``general.architecture`` of its draft GGUF
    engines: tuple[str, ...]  # the engines whose export it writes (``specforge.export.ENGINES``)

    # ---------------------------------------------------------------- configuration

    def config_errors(self, cfg) -> list[str]:
        """Checks of the config alone (before anything loads): one message per problem, naming the key."""

    def feature_layers(self, cfg, num_layers: int) -> list[int]:
        """The target layer outputs the draft reads (``model.aux_layer_ids`` or the default)."""

    def check(self, cfg, target_config) -> None:
        """What the config cannot say alone (against the target's config.json): a ValueError naming the key."""

    def draft_vocab_size(self, cfg, target_vocab_size: int) -> int:
        """Entries of the run's draft-vocab file."""

    def identity(self, cfg) -> dict[str, Any]:
        """The config values a checkpoint must share with the run resuming it (what changes the math)."""

    def sp_halo(self, cfg) -> int:
        """Rows past its own slice a sequence-parallel rank reads (0: the algorithm refuses SP)."""

    def sp_cores(self, draft) -> list[tuple[torch.nn.Module, str]]:
        """``(module, attribute)`` of each attention core sequence parallelism wraps."""

    # ---------------------------------------------------------------- training

    def build_draft(self, cfg, target, vocab) -> torch.nn.Module:
        """A fresh draft shaped for ``target`` (a ``TargetModel``), its init a function of the seed alone."""

    def train_state(self, cfg, target, vocab) -> Any:
        """Frozen tensors the loss needs besides the draft (EAGLE-3: the teacher rows), or None."""

    def normalizer(self, draft, batch, cfg, step: int) -> float:
        """This micro-batch's share of the loss denominator (summed over micro-batches and ranks)."""

    def loss(self, draft, batch, state, cfg, step: int, normalizer: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, counts)`` of one micro-batch: the loss is its share of the global mean when
        ``normalizer`` (the global sum) is given; counts are raw float64 sums, reduced once."""

    def counts_shape(self, cfg) -> tuple[int, int]:
        """The shape of the summed counters."""

    def metrics(self, counts: torch.Tensor, cfg) -> dict[str, float]:
        """Rates from the summed counters (loss, per-position accuracy, simulated acceptance tau)."""

    def memory_step(self, cfg, draft, shape, precision, gpu: bool) -> dict[str, list]:
        """The memory model's terms of one micro-batch's step (``specforge.memory``), by phase."""

    def memory_keys(self, cfg) -> list[str]:
        """Config keys that shrink a train device's step, for the memory refusal's message."""

    # ---------------------------------------------------------------- a saved draft

    def hf_config(self, draft) -> dict:
        """The checkpoint's config.json (the format its servers load)."""

    def owns_checkpoint(self, hf_config: dict) -> bool:
        """Whether a saved folder's config.json is this algorithm's (the registry asks the last
        registered first, so a refinement of an earlier format claims its own folders)."""

    def owns_gguf(self, arch: str, tensor_names: set[str]) -> bool:
        """Whether a draft GGUF (its ``general.architecture`` and tensor names) is this algorithm's."""

    def check_checkpoint(self, path) -> tuple[dict, Any]:
        """``(config.json, weights or None)`` of a valid saved folder; a ValueError naming every problem."""

    def load(self, path, target) -> torch.nn.Module:
        """A saved draft folder, with the frozen parts taken from ``target``."""

    def owns_published(self, hf_config: dict) -> bool:
        """Whether a published draft folder's config.json (ours, or an engine's format this algorithm
        reads: SGLang, speculators/vLLM, z-lab's DFlash) is this algorithm's (``draft.init_from``;
        asked last registered first, as ``owns_checkpoint``)."""

    def read_published(self, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
        """``(config.json in our saved format, weights named as the draft's export_state_dict)`` of a
        published folder this algorithm owns; only the names are mapped, nothing is checked against a
        run (``specforge/training/init_from.py`` loads them strictly into a fresh draft)."""

    def proposer(self, draft, dtype: Optional[torch.dtype]):
        """The eval's proposer: ``start(ids, aux_TH)``, ``propose(k, costs=None)``, ``accept(new, aux_TH)``."""

    def tokens_per_round(self, hf_config: dict) -> int:
        """Draft tokens a round an engine is told to ask for by default."""

    def max_tokens_per_round(self, hf_config: dict) -> Optional[int]:
        """The most draft tokens one round can propose (None: no bound)."""

    def export(self, engine: str, draft_dir: Path, out_dir: Path, req: ExportRequest) -> str:
        """Write ``engine``'s format (sglang, vllm) into ``out_dir``; returns the serve command."""

    def llamacpp_config(self, draft_config: dict, target_config: dict, layer_ids=None) -> dict:
        """The config.json llama.cpp's converter reads for this draft (a staged copy's)."""
