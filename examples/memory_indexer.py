"""The FlashMemory Memory Indexer from Python: make a retriever, generate with it, read its cycles.

    python examples/memory_indexer.py [MODEL.gguf]

Without an argument it uses the embedded tiny model, whose selection geometry is scaled down
(pages of 4 chunks, a recency tail of 32 chunks, KMAX 24 pages) so that a prompt of a thousand
tokens already evicts. The retriever is untrained (initialised from the model's own indexer):
this shows the machinery — which chunks the native indexer may pick from — not its accuracy.
"""
import os
import sys
import tempfile

import numpy as np

import pocketfm
from pocketfm.memory import SelectionConfig, make_retriever, save_retriever

path = sys.argv[1] if len(sys.argv) > 1 else pocketfm.embedded_model_path()
model = pocketfm.load(path, device="cpu")
cfg = model.config

# 1. A checkpoint in the official format, for this model (the official one is V4-Flash's).
ckpt = os.path.join(tempfile.mkdtemp(), "retriever.safetensors")
ret = make_retriever(cfg, model.weights, init="native", seed=0)
save_retriever(ckpt, ret)
print(f"retriever on transformer layers {ret.layer_ids}: {ret.layers[0].heads} heads, "
      f"geometry {ret.geometry}")

# 2. Generate with it: every 16 decode steps the retriever scores every compressed chunk and
#    decides the resident set; in between, each CSA layer's native top-k picks inside it.
prompt = [int(t) for t in np.random.default_rng(0).integers(3, cfg.vocab, 1000)]
memory = model.memory_indexer(SelectionConfig(interval=16, recall_diagnostic=True), ckpt)
out = model.generate(prompt, max_tokens=48, stop_at_eos=False, memory=memory)
for c in out.extra["memory_cycles"]:
    print(f"  step {c['step']:>3}: {c['resident']} of {c['chunks']} chunks resident "
          f"({c['pages']} pages; {c['kept']} above the threshold)")
print(f"resident share {out.extra['resident_fraction']:.3f}; the native full-history top-k "
      f"fell inside it {100 * out.extra['native_topk_recall']:.1f}% of the time")

# 3. The baselines need no checkpoint; 'full' must reproduce plain generation exactly.
plain = model.generate(prompt, max_tokens=48, stop_at_eos=False)
full = model.generate(prompt, max_tokens=48, stop_at_eos=False,
                      memory=model.memory_indexer(SelectionConfig(mode="full")))
assert full.tokens == plain.tokens
recency = model.generate(prompt, max_tokens=48, stop_at_eos=False,
                         memory=model.memory_indexer(SelectionConfig(mode="recency",
                                                                     interval=16)))
same = sum(a == b for a, b in zip(recency.tokens, plain.tokens))
print(f"full == plain: ok; recency-only keeps {recency.extra['resident_fraction']:.3f} of the "
      f"chunks and agrees with plain on {same} of 48 tokens")
