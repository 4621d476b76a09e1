"""The MoE's expert choice as block-wide device functions (spec §4.11's route): what
moe._route_group_rank runs as a kernel of its own, and what a kernel that needs the experts
first runs at its start (imma_iq2_xxs's routed build of the gate+up: no routing launch).

Selection: the top k of s + bias (s = sqrt(softplus(logits)); ties to the lowest index), or on
hash layers the row tid2eid[token]; weights: s at the chosen ids, divided by their sum if
``normalise``, times ``routed_scale`` (moe.route_chunk_ref is the reference).
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32

MAX_E = 512  # experts a route block can hold in shared memory (V4: 256)
MAX_K = 16  # experts per token (V4: 6)
GROUP = 32  # experts per group in the first round of pick_experts
MAX_CAND = MAX_E // GROUP * MAX_K  # candidate slots after that round


@cuda.jit(device=True)
def score(x):
    """s = sqrt(softplus(x)), softplus = log1p(exp(x)) taken as x above 20: there the two differ
    below float32 resolution, and exp(x) would overflow from 88 on."""
    return float32(math.sqrt(x if x > 20.0 else math.log1p(math.exp(x))))


@cuda.jit(device=True)
def pick_experts(ids, s, logits, bias, tid2eid, tokens, t, use_hash, k):
    """ids[:k] (shared int32 [MAX_K]) <- token t's experts in rank order, s (shared float32
    [MAX_E]) <- its unbiased scores; top k by counting ranks in the order (score desc, index
    asc). Every thread of the block calls it; it ends with a barrier.

    An expert's rank is how many entries beat it; it is selected iff rank < k, in slot rank.
    Counting against all E entries costs E steps per thread (V4: 256), so it runs in two rounds:
    1. rank within its group of 32 experts; the group's top k fill candidate slots g·k + rank;
    2. each candidate counts only the candidates that beat it (G·k steps, V4: 48).
    Exact: whatever beats a global top-k expert is itself in the global top-k, hence in its
    group's top k, hence a candidate; a candidate outside the top k is beaten by the k
    selected, all candidates, so its count is >= k too."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    E = logits.shape[1]
    G = (E + GROUP - 1) // GROUP
    sel = cuda.shared.array(MAX_E, float32)  # biased scores: they only pick
    cand = cuda.shared.array(MAX_CAND, int32)  # [G, k] expert ids, -1: none
    cand_v = cuda.shared.array(MAX_CAND, float32)  # their sel values (no dependent loads)
    for e in range(tid, E, nt):
        v = score(logits[t, e])
        s[e] = v
        sel[e] = v + bias[e]
    if use_hash:
        for j in range(tid, k, nt):
            ids[j] = tid2eid[tokens[t], j]
    cuda.syncthreads()
    if not use_hash:
        for e in range(tid, E, nt):  # round 1: rank within the group
            v = sel[e]
            lo = e - e % GROUP
            rank = 0
            for i in range(GROUP):  # a constant trip count: the compiler unrolls it
                j = lo + i
                if j < E:
                    o = sel[j]
                    if o > v or (o == v and j < e):
                        rank += 1
            if rank < k:
                cand[lo // GROUP * k + rank] = e
                cand_v[lo // GROUP * k + rank] = v
        for c in range(tid, G * k, nt):  # slots a short last group leaves empty
            if c % k >= min(GROUP, E - c // k * GROUP):
                cand[c] = -1
        cuda.syncthreads()
        for c in range(tid, G * k, nt):  # round 2: rank among the candidates
            e = cand[c]
            if e >= 0:
                v = cand_v[c]
                rank = 0
                for i in range(G * k):
                    f = cand[i]
                    o = cand_v[i]
                    if f >= 0 and (o > v or (o == v and f < e)):
                        rank += 1
                if rank < k:
                    ids[rank] = e
    cuda.syncthreads()


@cuda.jit(device=True)
def write_weights(out_ids, out_w, ids, s, t, k, routed_scale, normalise):
    """out_ids[t, :k], out_w[t, :k] <- pick_experts' ids and their weights (threads j < k)."""
    for j in range(cuda.threadIdx.x, k, cuda.blockDim.x):
        tot = float32(0.0)
        for i in range(k):  # k <= 16: each writer sums redundantly rather than wait on one
            tot += s[ids[i]]
        wv = s[ids[j]]
        if normalise:
            wv = wv / tot
        out_ids[t, j] = ids[j]
        out_w[t, j] = wv * routed_scale
