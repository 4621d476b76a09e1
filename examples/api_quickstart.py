"""Use pocketfm from Python: load a model, read logits, generate.

    python examples/api_quickstart.py [MODEL.gguf]

Without an argument it uses the embedded tiny model (random weights: the text is noise, the
pipeline is real).
"""
import sys

import numpy as np

import pocketfm

path = sys.argv[1] if len(sys.argv) > 1 else pocketfm.embedded_model_path()
model = pocketfm.load(path)  # device="cpu", qat=True (the FP8/FP4 round-trips of the model)
cfg = model.config
print(f"{path}: {cfg.n_layers} layers, hidden {cfg.dim}, ratios {list(cfg.compress_ratios)}")

ids = model.tokenizer.encode("pocketfm reads DeepSeek-V4", bos=True)
logits = model.logits(ids)  # [T, vocab]: teacher-forced from position 0
print("logits", logits.shape, "next-token argmax per position:", logits.argmax(axis=1).tolist())

out = model.generate("Once upon a time", max_tokens=16, temperature=0.7, top_p=0.9, seed=1)
print(repr(out.text))
print({k: v for k, v in out.summary().items() if k != "tokens"})

# The same forward is a plain function of (tokens, state): feed it chunk by chunk yourself.
state = model.new_state(capacity=64)
first = model.forward.forward(ids[:4], state)  # a 4-token prefill chunk
rest = [model.forward.forward([t], state) for t in ids[4:]]  # then one token at a time
assert np.allclose(np.concatenate([first, *rest]), logits, atol=1e-3)
print("chunked == one-shot: ok")
