"""The README's commands and the examples, run as a user would."""
import json
import os
import subprocess
import sys

import numpy as np
from click.testing import CliRunner

from pocketfm.cli import main
from pocketfm.generate import sample_next

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_embedded_model_streams_text_and_summary():
    res = CliRunner().invoke(main, ["run", "--prompt", "Hello", "--max-tokens", "8"])
    assert res.exit_code == 0, res.output
    last = res.stdout.strip().splitlines()[-1]
    assert "prompt tokens" in last and "tok/s" in last


def test_run_reports_prefill_progress_on_stderr():
    """A prompt longer than one chunk: a progress line per chunk (tok/s) on stderr, ending with
    every prompt token; stdout keeps the text and the JSON summary."""
    res = CliRunner().invoke(main, ["run", "--prompt", "one two three four five six seven",
                                    "--max-tokens", "2", "--prefill-chunk", "3", "--device",
                                    "cpu", "--json"])
    assert res.exit_code == 0, res.output
    n = json.loads(res.stdout.strip().splitlines()[-1])["prompt_tokens"]
    assert n > 3
    reports = [r for r in res.stderr.replace("\r", "\n").splitlines() if r.startswith("prefill:")]
    assert len(reports) == -(-n // 3) and reports[-1].startswith(f"prefill: {n}/{n} tokens, ")
    assert reports[-1].rstrip().endswith("tok/s")
    assert "prefill:" not in res.stdout


def test_run_json_is_deterministic_and_cpu_qat_switch(official_path):
    args = ["run", "--model", official_path, "--prompt", "abc", "--max-tokens", "5", "--json"]
    a = json.loads(CliRunner().invoke(main, args).stdout.strip().splitlines()[-1])
    b = json.loads(CliRunner().invoke(main, args).stdout.strip().splitlines()[-1])
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 5
    assert a["prompt_tokens"] == 3  # the fixture sets tokenizer.ggml.add_bos_token = false
    assert a["prefill_tok_s"] > 0 and "decode_tok_s" in a
    c = CliRunner().invoke(main, args + ["--no-qat"])
    assert c.exit_code == 0


def test_inspect_prints_table(official_path):
    res = CliRunner().invoke(main, ["inspect", official_path])
    assert res.exit_code == 0
    assert "blk.2.indexer.attn_q_b.weight" in res.stdout and "bytes by type" in res.stdout


def test_make_model_then_run(tmp_path):
    out = str(tmp_path / "m.gguf")
    res = CliRunner().invoke(main, ["make-model", "--preset", "tiny", "--quant", "q8_0", "-o", out])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["run", "--model", out, "--max-tokens", "3", "--chat",
                                    "--prompt", "hi", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["generated_tokens"] >= 1


def test_help_lists_commands():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    for cmd in ("run", "inspect", "make-model", "make-retriever", "bench"):
        assert cmd in res.stdout


def test_top_p_sampling():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert sample_next(logits, 0.0, 1.0, rng) == 0
    draws = {sample_next(logits, 1.0, 0.7, rng) for _ in range(200)}
    assert draws == {0, 1}  # nucleus of mass >= 0.7 is {0, 1}
    draws = {sample_next(logits, 1.0, 1.0, rng) for _ in range(400)}
    assert draws == {0, 1, 2, 3}


def test_examples_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    for script in ("api_quickstart.py", "walk_one_layer.py", "memory_indexer.py"):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script)],
                           capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
