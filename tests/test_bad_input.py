"""Bad input: one line naming the file/tensor/key/flag and what was expected, exit 2, no traceback."""
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType, GGUFValueType

from gguf_edit import rewrite_gguf
from pocketfm.cli import main
from pocketfm.errors import InputError
from pocketfm.weights import load_gguf


def cli(*args):
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.stdout, res.stderr


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def broken(tmp_path, official_path, **edit):
    dst = str(tmp_path / "broken.gguf")
    rewrite_gguf(official_path, dst, **edit)
    return dst


def test_missing_file(tmp_path):
    code, _, err = cli("inspect", str(tmp_path / "nope.gguf"))
    assert_one_line_error(code, err, "nope.gguf", "no such file")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 definitely a zip")
    code, _, err = cli("run", "--model", str(p))
    assert_one_line_error(code, err, "x.gguf", "not a GGUF")


@pytest.mark.parametrize("keep", [100, 4000, -1000])
def test_truncated_gguf(tmp_path, official_path, keep):
    data = open(official_path, "rb").read()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:keep] if keep > 0 else data[:keep])
    code, _, err = cli("inspect", str(p))
    assert_one_line_error(code, err, "cut.gguf")
    assert "truncated" in err or "corrupted" in err


def test_corrupted_header(tmp_path, official_path):
    data = bytearray(open(official_path, "rb").read())
    data[8:16] = (2**40).to_bytes(8, "little")  # absurd tensor count
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    code, _, err = cli("inspect", str(p))
    assert_one_line_error(code, err, "bad.gguf")


def test_wrong_architecture(tmp_path, official_path):
    p = broken(tmp_path, official_path, set_keys={"general.architecture": ("llama", None)})
    with pytest.raises(InputError, match="general.architecture is 'llama', expected 'deepseek4'"):
        load_gguf(p)
    code, _, err = cli("run", "--model", p)
    assert_one_line_error(code, err, "general.architecture")


def test_missing_metadata_key(tmp_path, official_path):
    p = broken(tmp_path, official_path, drop_keys=("deepseek4.attention.sliding_window",))
    code, _, err = cli("inspect", p)
    assert_one_line_error(code, err, "deepseek4.attention.sliding_window", "missing")


def test_invalid_metadata_value(tmp_path, official_path):
    p = broken(tmp_path, official_path,
               set_keys={"deepseek4.attention.head_count_kv": (2, GGUFValueType.UINT32)})
    code, _, err = cli("inspect", p)
    assert_one_line_error(code, err, "deepseek4.attention.head_count_kv", "expected 1")


def test_missing_tensor(tmp_path, official_path):
    p = broken(tmp_path, official_path, drop_tensors=("blk.3.attn_compressor_ape.weight",))
    code, _, err = cli("run", "--model", p)
    assert_one_line_error(code, err, "missing tensor blk.3.attn_compressor_ape.weight")


def test_wrong_shape(tmp_path, official_path):
    p = broken(tmp_path, official_path,
               replace_tensors={"blk.2.attn_kv.weight": (np.zeros((100, 64), np.float32), None)})
    code, _, err = cli("inspect", p)
    assert_one_line_error(code, err, "blk.2.attn_kv.weight", "expected [64, 144]")


def test_wrong_type(tmp_path, official_path):
    tid = np.zeros((256, 2), np.float32)
    p = broken(tmp_path, official_path,
               replace_tensors={"blk.0.ffn_gate_tid2eid.weight": (tid, None)})
    code, _, err = cli("inspect", p)
    assert_one_line_error(code, err, "blk.0.ffn_gate_tid2eid.weight", "expected I32")


def test_unsupported_quant_type(tmp_path, official_path):
    raw = np.zeros((256, 36), np.uint8)  # Q4_0 rows of 64 elements (2 blocks of 32 / 18 B)
    p = broken(tmp_path, official_path, replace_tensors={
        "output.weight": (raw, GGMLQuantizationType.Q4_0)})
    code, _, err = cli("inspect", p)
    assert_one_line_error(code, err, "output.weight", "type Q4_0, expected one of")


def test_quantised_norm_rejected(tmp_path, official_path):
    from pocketfm.quants import quantize_q8_0
    w = quantize_q8_0(np.ones((1, 64), np.float32)).reshape(-1)
    p = broken(tmp_path, official_path, replace_tensors={
        "blk.1.attn_norm.weight": (w, GGMLQuantizationType.Q8_0)})
    code, _, err = cli("inspect", p)
    assert_one_line_error(code, err, "blk.1.attn_norm.weight", "expected F32, F16 or BF16")


def test_prompt_longer_than_ctx(official_path):
    code, _, err = cli("run", "--model", official_path, "--prompt", "a" * 40, "--ctx", "16")
    assert_one_line_error(code, err, "--ctx 16", "40 tokens")


def test_ctx_beyond_model(official_path):
    code, _, err = cli("run", "--model", official_path, "--ctx", "100000")
    assert_one_line_error(code, err, "--ctx 100000", "context_length 512")


@pytest.mark.parametrize("args,needle", [
    (["--max-tokens", "-1"], "--max-tokens"),
    (["--ctx", "0"], "--ctx"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--device", "tpu"], "--device"),
    (["--seed", "abc"], "--seed"),
    (["--bogus"], "--bogus"),
])
def test_invalid_flags(official_path, args, needle):
    code, _, err = cli("run", "--model", official_path, *args)
    assert_one_line_error(code, err, needle)


def test_prompt_and_prompt_file_conflict(official_path, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("hi")
    code, _, err = cli("run", "--model", official_path, "--prompt", "x", "--prompt-file", str(f))
    assert_one_line_error(code, err, "--prompt-file")


def test_prompt_file_missing_or_not_utf8(official_path, tmp_path):
    code, _, err = cli("run", "--model", official_path, "--prompt-file", str(tmp_path / "no"))
    assert_one_line_error(code, err, "--prompt-file", "cannot read")
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9")
    code, _, err = cli("run", "--model", official_path, "--prompt-file", str(f))
    assert_one_line_error(code, err, "--prompt-file", "not UTF-8")


def test_chat_without_chat_tokens(official_path):
    """The golden fixture's 256-byte vocab has no <｜User｜> token: --chat says so."""
    code, _, err = cli("run", "--model", official_path, "--chat", "--prompt", "hi")
    assert_one_line_error(code, err, "<｜User｜>")


def test_cuda_without_a_gpu(official_path, monkeypatch):
    from numba import cuda

    import pocketfm.kernels.device as device
    monkeypatch.setattr(device, "SIMULATOR", False)
    monkeypatch.setattr(cuda, "is_available", lambda: False)
    code, _, err = cli("run", "--model", official_path, "--device", "cuda")
    assert_one_line_error(code, err, "--device cuda", "no CUDA GPU")


def test_cuda_needs_qat(official_path):
    code, _, err = cli("run", "--model", official_path, "--device", "cuda", "--no-qat")
    assert_one_line_error(code, err, "--no-qat", "--device cpu")


def test_make_model_bad_preset_and_unwritable(tmp_path):
    code, _, err = cli("make-model", "--preset", "huge", "-o", str(tmp_path / "m.gguf"))
    assert_one_line_error(code, err, "--preset")
    code, _, err = cli("make-model", "--preset", "tiny", "-o", str(tmp_path / "no" / "m.gguf"))
    assert_one_line_error(code, err, "m.gguf")
    assert not os.path.exists(tmp_path / "no")


def test_real_entry_point_exit_status(tmp_path):
    """The installed-style entry (python -m pocketfm) exits 2 with one stderr line."""
    p = subprocess.run([sys.executable, "-m", "pocketfm", "inspect", str(tmp_path / "none.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert_one_line_error(p.returncode, p.stderr, "none.gguf")
