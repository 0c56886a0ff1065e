"""The data pipeline: corpus -> token shards (corpus.py) -> rows (dataset.py) -> batches on the device (prefetch.py)."""
from .corpus import DataError, default_corpus_files, prepare, token_dtype, write_token_shards
from .dataset import StreamingDataset, TokenDataset, cu_seqlens_of, load_meta, unigram_val_loss
from .prefetch import Prefetcher

__all__ = ["DataError", "default_corpus_files", "prepare", "token_dtype", "write_token_shards",
           "TokenDataset", "StreamingDataset", "cu_seqlens_of", "load_meta", "unigram_val_loss", "Prefetcher"]
