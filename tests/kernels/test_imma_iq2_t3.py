"""IQ2_XXS transcoded to 3-bit planes (imma_iq2_t3.py): the layout holds the same weights, and
its tensor-core GEMV gives imma_iq2_xxs's output bit for bit (the same MMAs on the same codes in
the same order), within the x rounding's bound of the reference (test_imma_iq2_xxs's shapes)."""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import fresh_rng, poisoned
from kernels.test_imma_iq2_xxs import SHAPES, _case
from pocketfm import quants
from pocketfm.kernels import gemv_lowbit as gl
from pocketfm.kernels import imma_iq2_t3 as t3
from pocketfm.kernels import imma_iq2_xxs as imma
from pocketfm.quants import GGMLType


def test_transcoded_weights_are_the_iq2_xxs_weights():
    rng = fresh_rng()
    E, N, K = 3, 7, 1024
    raw = quants.random_blocks(GGMLType.IQ2_XXS, (E, N, K), rng, std=0.05)
    w = t3.transcode(gl.pack_iq2_xxs(raw, N, K))
    assert t3.is_t3(w) and not t3.is_t3(gl.pack_iq2_xxs(raw, N, K))
    want = quants.dequantize(raw, GGMLType.IQ2_XXS).reshape(E, N, K).astype(np.float32)
    assert np.array_equal(t3.dequantize_t3(w), want)
    assert w.nbytes * 66 == gl.pack_iq2_xxs(raw, N, K).nbytes * 102  # 102 bytes a block


CASES = [(s, None) for s in SHAPES] + [(SHAPES[0], b) for b in t3.CANDIDATES]


@pytest.mark.parametrize("shape,build", CASES,
                         ids=lambda v: f"N{v[1]}-K{v[2]}-T{v[3]}" if isinstance(v, tuple)
                         else str(v))
def test_the_transcoded_gemv_is_the_iq2_xxs_gemv_bit_for_bit(shape, build):
    w, x, ids, ref, bound = _case(*shape)
    d_ids = None if ids is None else cuda.to_device(ids)
    got = []
    for weight in (t3.transcode(w), w):
        out = poisoned(ref.shape)
        xp = imma.prepare_x(cuda.to_device(x))
        if t3.is_t3(weight):
            t3.gemv_prepared(out, weight.to_device(), xp, d_ids, build=build)
        else:
            imma.gemv_prepared(out, weight.to_device(), xp, d_ids)
        got.append(out.copy_to_host())
    assert np.array_equal(got[0].view(np.int32), got[1].view(np.int32))
    assert np.all(np.abs(got[0] - ref) <= bound + 1e-6 * np.abs(ref) + 1e-7)
