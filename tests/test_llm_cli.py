"""``kiln llm compile | generate | chat`` as a user runs them: subprocesses of the console
script, text compared with the same generation run in-process."""
import os
import re
import sys

import pytest

pytest.importorskip("transformers")

from kiln.runtime.scheduler import Request  # noqa: E402
from kiln.runtime.text import Tokenizer  # noqa: E402
from tests.conftest import ROOT, tiny_tokenizer  # noqa: E402
from tests import forkserver  # noqa: E402

KILN = os.path.join(os.path.dirname(sys.executable), "kiln")


def kiln(*args, stdin=None, timeout=300):
    env = dict(os.environ, KILN_QUIET="1", PYTHONPATH=ROOT, KILN_CACHE_URL="off")
    return forkserver.run([KILN, *map(str, args)], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def expected(llm, prompt, n, stops=(2,)):
    sched = llm.scheduler()
    r = sched.add(Request(prompt, n, stop_token_ids=stops))
    sched.run()
    return Tokenizer(llm.tokenizer_files).decode(r.tokens)


def test_generate_streams_the_models_text(tiny_llm):
    _, llm, path = tiny_llm
    tok = Tokenizer(llm.tokenizer_files)
    r = kiln("llm", "generate", path, "Hi", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected(llm, tok.encode("Hi"), 12) + "\n"
    assert "2 prompt tokens" in r.stderr and "tokens/s" in r.stderr
    r = kiln("llm", "generate", path, "Hey", "--chat", "--max-tokens", "9")
    assert r.stdout == expected(llm, tok.encode_chat([{"role": "user", "content": "Hey"}]), 9) + "\n"
    r = kiln("llm", "generate", path, "a prompt far too long", "--max-tokens", "3")
    assert r.returncode == 2 and "longer than the largest context bucket (8)" in r.stderr
    r = kiln("llm", "generate", os.path.join(ROOT, "pyproject.toml"), "Hi")
    assert r.returncode == 2 and "kiln: error:" in r.stderr


def test_chat_keeps_the_conversation(tiny_llm):
    _, llm, path = tiny_llm
    tok = Tokenizer(llm.tokenizer_files)
    r = kiln("llm", "chat", path, "--max-tokens", "4", stdin="A\n/reset\nB\n")
    assert r.returncode == 0, r.stderr
    first = expected(llm, tok.encode_chat([{"role": "user", "content": "A"}]), 4)
    second = expected(llm, tok.encode_chat([{"role": "user", "content": "B"}]), 4)
    # each reply on its own line (they ran together: ";8BB;8BB")
    assert r.stdout == first + "\n" + second + "\n"
    # --temperature's error names the flag's spelling (it said "use do_sample=False", not a flag)
    r = kiln("llm", "chat", path, "--temperature", "-1", stdin="A\n")
    assert r.returncode == 2 and "--temperature must be >= 0 (0, the default, decodes greedily)" in r.stderr
    assert "do_sample" not in r.stderr
    for flag, value, said in (("--top-p", "2", "--top-p must be in (0, 1]"), ("--top-k", "-1", "--top-k must be >= 0"),
                              ("--repetition-penalty", "0", "--repetition-penalty must be > 0")):
        r = kiln("llm", "chat", path, "--temperature", "1", flag, value, stdin="A\n")      # top_p (12-03)
        assert r.returncode == 2 and said in r.stderr, r.stderr
    # a conversation that outgrows the context bucket is a message, not a crash
    r = kiln("llm", "chat", path, "--max-tokens", "1", stdin="A\nB\n")
    assert r.returncode == 0 and "/reset starts a new conversation" in r.stderr


def test_compile_a_checkpoint_directory(tiny_llm, tmp_path):
    model, llm, draft = tiny_llm
    checkpoint = tmp_path / "ckpt"
    model.save_pretrained(checkpoint)
    tiny_tokenizer().save_pretrained(checkpoint)
    out = tmp_path / "m.kiln"
    r = kiln("llm", "compile", checkpoint, "-o", out, "--batch-size", "1", "--context-buckets", "8",
             "--cache-length", "32", "-O", "1", "--speculation-length", "3")
    assert r.returncode == 0, r.stderr
    assert "compiled prefill 8 (1/3)" in r.stderr and "compiled decode 1x32 (2/3)" in r.stderr
    assert "compiled verify 4 (3/3)" in r.stderr
    tok = Tokenizer(llm.tokenizer_files)
    r = kiln("llm", "generate", out, "Hi", "--max-tokens", "10")
    assert r.returncode == 0 and r.stdout == expected(llm, tok.encode("Hi"), 10) + "\n"
    # speculative decoding, the session's tiny LLM (the same weights) drafting: the same text
    r = kiln("llm", "generate", out, "Hi", "--max-tokens", "10", "--draft", draft)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected(llm, tok.encode("Hi"), 10) + "\n"
    assert re.search(r"draft tokens accepted (\d+)/\1 \(100%\)", r.stderr), r.stderr
    r = kiln("llm", "generate", draft, "Hi", "--draft", out)
    assert r.returncode == 2 and "compile it with speculation_length" in r.stderr
    r = kiln("llm", "generate", out, "Hi", "--draft", "ngram", "--temperature", "0.5", "--max-tokens", "5")
    assert r.returncode == 0 and "draft tokens accepted" in r.stderr, r.stderr     # sampling speculates too
    r = kiln("llm", "compile", tmp_path / "missing", "-o", out)
    assert r.returncode == 2 and "no such file or directory" in r.stderr


def test_compile_quantized_reports_a_failed_gate_with_its_numbers(tiny_llm, tmp_path):
    model, _, _ = tiny_llm
    checkpoint = tmp_path / "ckpt"
    model.save_pretrained(checkpoint)
    r = kiln("llm", "compile", checkpoint, "-o", tmp_path / "q.kiln", "--batch-size", "1", "--context-buckets",
             "8", "--cache-length", "32", "-O", "1", "--quantize", "int4", "--max-ppl-ratio", "1.0001",
             "--min-agreement", "1")
    assert r.returncode != 0 and not (tmp_path / "q.kiln").exists()
    assert re.search(r"int4 model fails the accuracy gate: perplexity \S+ vs \S+", r.stderr), r.stderr


def test_compile_refuses_a_bf16_prefill_for_a_float_build(tiny_llm, tmp_path):
    """``--prefill-auto-cast bf16`` reaches compile_llm: a float build (no gate to judge it)
    is refused with the reason, exit code 2, and no file written."""
    model, _, _ = tiny_llm
    checkpoint = tmp_path / "ckpt"
    model.save_pretrained(checkpoint)
    r = kiln("llm", "compile", checkpoint, "-o", tmp_path / "f.kiln", "--batch-size", "1", "--context-buckets",
             "8", "--cache-length", "32", "--prefill-auto-cast", "bf16")
    assert r.returncode == 2 and "prefill_auto_cast applies to quantized builds" in r.stderr, r.stderr
    assert not (tmp_path / "f.kiln").exists()


def test_run_and_bench_refuse_an_llm_artifact_with_what_to_use(tiny_llm):
    """``kiln run`` and ``kiln bench`` call one model of tensors; given an LLM artifact they
    used to fail with an AttributeError traceback (``kiln bench`` as a skipped row)."""
    path = tiny_llm[2]
    for command in ("run", "bench"):
        r = kiln(command, path)
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert "is an LLM artifact" in r.stderr and "kiln llm generate" in r.stderr
        assert "Traceback" not in r.stderr and "AttributeError" not in r.stdout + r.stderr
