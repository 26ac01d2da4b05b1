"""Data pipeline: ShareGPT reading, chat-template tokenization with exact loss masks, caching, draft vocab."""

from specforge.data.prepare import DataStats, PreparedData, prepare_dataset
from specforge.data.sharegpt import Conversation, MalformedRow, iter_conversations, load_conversations, normalize_record
from specforge.data.template import tokenize_conversation
from specforge.data.vocab import DraftVocab, build_draft_vocab, load_draft_vocab, save_draft_vocab

__all__ = [
    "Conversation", "DataStats", "DraftVocab", "MalformedRow", "PreparedData", "build_draft_vocab",
    "iter_conversations", "load_conversations", "load_draft_vocab", "normalize_record", "prepare_dataset",
    "save_draft_vocab", "tokenize_conversation",
]
