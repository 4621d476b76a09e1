"""FlashMemory for pocketfm: the Memory Indexer (retriever) and what it keeps resident.

    checkpoint.py       the official safetensors format, checked against a model; make-retriever
    safetensors_io.py   the file format on NumPy (bf16 included)
    scorer.py           query encoder + logits, the NumPy reference (flashmemory.md §3-§4)
    selection.py        ensembles, threshold / top-k, recency tail, sink, page recall, baselines
    runtime.py          cadence, n -> n+1 commit, two-level selection inside the forward, stats
"""
from .checkpoint import (Retriever, RetrieverGeometry, RetrieverLayer, load_retriever,
                         make_retriever, save_retriever)
from .runtime import MemoryIndexer
from .selection import SelectionConfig

__all__ = ["MemoryIndexer", "Retriever", "RetrieverGeometry", "RetrieverLayer", "SelectionConfig",
           "load_retriever", "make_retriever", "save_retriever"]
