"""CUDA kernels for the V4 forward, one module per op family.

Each module holds, for every op: the NumPy reference (``*_ref``, the spec), the Numba kernel(s)
(naive kept beside the fast ones, named by technique), and a launcher with the reference's
signature (output first, preallocated device arrays). ``PTX_SIGNATURES`` lists every kernel with
the argument types it is compiled for in CI lane B (see device.py). ``bench_cases()`` builds the
kernel's V4-Flash-shaped benchmark for ``bin/bench-kernels``.
"""
FAMILIES = ("kvpack", "gemv", "gemv_lowbit", "norm_rope", "hc", "embed_sample", "qat",
            "compressor", "indexer", "attention", "attention_prefill", "moe", "retriever",
            "kvgather", "mma", "indexer_mma", "indexer_warp", "hmma", "imma_iq2_xxs",
            "imma_q2_k", "gemv_pipelined", "l2_prefetch", "indexer_query")
