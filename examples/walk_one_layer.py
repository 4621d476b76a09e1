"""Walk one DeepSeek-V4 layer by hand and print what each stage produces.

    python examples/walk_one_layer.py [MODEL.gguf] [LAYER]

Runs a short prompt through the model with tracing on, then prints the shapes and norms of the
intermediates of one layer: attention input, attention output, router choice, FFN output, and
the hyper-connection streams after the block. The names match DeepSeek's reference debug dumps.
"""
import sys

import numpy as np

import pocketfm

path = sys.argv[1] if len(sys.argv) > 1 else pocketfm.embedded_model_path()
layer = int(sys.argv[2]) if len(sys.argv) > 2 else 1
model = pocketfm.load(path)
cfg = model.config
kind = {0: "window-only", 4: "CSA (compressed, indexer top-k)"}.get(cfg.ratio(layer),
                                                                      f"HCA ratio {cfg.ratio(layer)}")
print(f"layer {layer}: {kind}, hash-routed: {cfg.is_hash_layer(layer)}")

ids = model.tokenizer.encode("The cat sat on the mat. " * 4, bos=True)
trace = {}
model.forward.forward(ids, model.new_state(len(ids)), trace=trace)
for name, values in trace.items():
    if name.startswith(f"block{layer}."):
        v = values[0]
        print(f"  {name:<28} shape {str(v.shape):<14} |x| {np.linalg.norm(v.astype(float)):10.3f}")
print("first token's experts:", trace[f"block{layer}.route_experts"][0][0].tolist())
