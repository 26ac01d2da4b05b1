"""DFlash (arXiv 2602.06036): a block-diffusion draft; one forward drafts a block of tokens.

``model`` (the draft, training and inference forwards), ``loss`` (anchors, blocks, decayed block
cross-entropy, metrics), ``propose`` (block proposal + a greedy reference loop), ``export``
(the public ``DFlashDraftModel`` checkpoint format), ``sp`` (ring sequence parallelism), ``memory``
(its memory terms), ``algorithm`` (the seam's hooks), ``blocks`` (what the block family, DSpark,
DFlash2 and XPress, shares: the shifted layout and targets, the chunked loss, the counters, the hooks).
"""

from .algorithm import ALGORITHM
from .export import from_hf_config, load_dflash, save_dflash, to_hf_config
from .loss import dflash_loss, metrics_from_counts, next_token_labels, sample_anchors
from .model import ContextCache, DFlashConfig, DFlashDraft, build_block_mask
from .propose import propose_block, spec_decode_greedy

__all__ = ["ALGORITHM", "ContextCache", "DFlashConfig", "DFlashDraft", "build_block_mask", "dflash_loss",
           "from_hf_config", "load_dflash", "metrics_from_counts", "next_token_labels", "propose_block",
           "sample_anchors", "save_dflash", "spec_decode_greedy", "to_hf_config"]
