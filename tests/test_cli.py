"""The `fasterllama` command end to end, as subprocesses: generation, piped chat, and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from conftest import default_model_path

needs_model = pytest.mark.skipif(default_model_path() is None, reason="default model not installed")


def run_cli(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fasterllama", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def assert_clean_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    for fragment in fragments:
        assert fragment in last, last


@needs_model
def test_generate_streams_greedy_text(default_llm):
    from fasterllama import SamplingParams

    proc = run_cli("generate", "-q", "--temperature", "0", "--max-tokens", "16", "--ignore-eos", "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    expected = default_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].text
    assert proc.stdout == expected + "\n"
    for stdin in ("The capital of France is\n", "\ufeffThe capital of France is\r\n"):  # (echo's; a Windows file's BOM and CRLF)
        piped = run_cli("generate", "-q", "--temperature", "0", "--max-tokens", "16", "--ignore-eos", stdin=stdin)
        assert piped.returncode == 0 and piped.stdout == proc.stdout, piped.stderr


@needs_model
def test_a_reader_stopping_early_is_fine():
    """`fasterllama generate ... | head -c 5`: exit 0, not 141 (the reader's leaving is not an error)."""
    proc = subprocess.Popen([sys.executable, "-m", "fasterllama", "generate", "-q", "-t", "0", "-n", "200", "--ignore-eos", "Count: 1, 2, 3,"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert len(proc.stdout.read(5)) == 5
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and b"Traceback" not in err and b"Exception ignored" not in err, err


@needs_model
def test_text_the_terminal_cannot_show_is_replaced_not_an_error():
    proc = subprocess.run([sys.executable, "-m", "fasterllama", "generate", "-q", "-t", "0", "-n", "6", "--ignore-eos", "日本の首都は"],
                          capture_output=True, timeout=300, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0 and b"?" in proc.stdout, proc.stderr


@needs_model
def test_generate_chat_flag_uses_template(default_llm):
    from fasterllama import SamplingParams

    proc = run_cli("generate", "-q", "--chat", "--temperature", "0", "--max-tokens", "24", "What is 2+2?")
    assert proc.returncode == 0, proc.stderr
    expected = default_llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=24))[0].text
    assert proc.stdout == expected + "\n"


@needs_model
def test_chat_piped_keeps_history(default_llm):
    from fasterllama import SamplingParams

    proc = run_cli("chat", "-q", "--temperature", "0", "--max-tokens", "20", stdin="My name is Ada.\n/reset\n/help\n/resett\nWhat is 2+2?\n/exit\nnever read\n")
    assert proc.returncode == 0, proc.stderr
    assert "/resett is not a command" in proc.stderr and "/help says so" in proc.stderr  # (neither went to the model)
    lines = list(proc.stdout.split("\n"))
    params = SamplingParams(temperature=0, max_tokens=20)
    first = default_llm.chat([{"role": "user", "content": "My name is Ada."}], params)[0].text
    second = default_llm.chat([{"role": "user", "content": "What is 2+2?"}], params)[0].text  # history was reset
    assert proc.stdout == first + "\n" + second + "\n", lines


@needs_model
def test_chat_piped_multi_turn_history(default_llm):
    # Turns keep their history; the lines between two lines of three double quotes are one message
    # (a pasted text was a turn a line); -v says each reply's counts.
    from fasterllama import SamplingParams

    proc = run_cli("chat", "-q", "-v", "--temperature", "0", "--max-tokens", "12", stdin='Hi there\n"""\nThanks!\n  See you.\n"""\n')
    assert proc.returncode == 0, proc.stderr
    params = SamplingParams(temperature=0, max_tokens=12)
    h = [{"role": "user", "content": "Hi there"}]
    first = default_llm.chat(h, params)[0]
    h += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Thanks!\n  See you."}]
    second = default_llm.chat(h, params)[0]
    assert proc.stdout == first.text + "\n" + second.text + "\n"
    assert f"[{len(second.prompt_token_ids)} prompt tokens, {len(second.token_ids)} generated, finish_reason={second.finish_reason}" in proc.stderr


@needs_model
def test_chat_says_a_message_over_the_context_and_goes_on(default_llm):
    from fasterllama import SamplingParams

    long = "Tell me about this: " + "words " * 300
    proc = run_cli("chat", "-q", "-t", "0", "-n", "8", "--max-model-len", "256", stdin=f"Hi there\n{long}\nWhat is 2+2?\n")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [proc.stderr.strip().splitlines()[0]]
    assert "context is 256 tokens" in proc.stderr
    too_long = run_cli("chat", "-q", "--max-model-len", "256", "--system", long, stdin="Hi there\n")  # (said once, up front)
    assert_clean_error(too_long, "the system message alone takes", "context is 256 tokens")
    params = SamplingParams(temperature=0, max_tokens=8)
    h = [{"role": "user", "content": "Hi there"}]
    first = default_llm.chat(h, params)[0].text
    h += [{"role": "assistant", "content": first}, {"role": "user", "content": "What is 2+2?"}]  # the long one left out
    assert proc.stdout == first + "\n" + default_llm.chat(h, params)[0].text + "\n"


@pytest.mark.parametrize("args,fragment", [(["--stride", "0"], "--stride"), (["--max-tokens", "0"], "--max-tokens"), (["--context", "1"], "--context")])
def test_eval_perplexity_bad_windows(tmp_path, args, fragment):
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven")
    assert_clean_error(run_cli("eval", "perplexity", "-q", *args, str(text)), fragment)


def test_outputs_and_flags_checked_before_the_work(tmp_path):
    """Checked before any model loads: --json naming a folder (the whole evaluation ran, then
    failed with IsADirectoryError and its result was lost), quantize -o naming a file
    (NotADirectoryError), an @FILE that is not UTF-8 (a bare UnicodeDecodeError), serve --port
    past 65535 (the system took it modulo 65536: port 34463 for 99999)."""
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven")
    assert_clean_error(run_cli("eval", "perplexity", "-q", "--json", str(tmp_path), str(text)), "is a folder")
    assert_clean_error(run_cli("bench", "-q", "--json", str(tmp_path)), "is a folder")
    assert_clean_error(run_cli("quantize", "smollm2-135m-instruct", "--mode", "w8", "-o", str(text)), "is a file")
    assert_clean_error(run_cli("quantize", "smollm2-135m-instruct", "--mode", "q4_0", "-o", ""), "-o/--output is empty")
    import tiny_models as tm

    folder = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), str(tmp_path / "gqa"))
    assert_clean_error(run_cli("quantize", folder, "-q", "--mode", "w8", "-o", "/proc/fasterllama-no-such"), "cannot write /proc/fasterllama-no-such")
    (tmp_path / "s.json").write_bytes(b"\xff\xfe{}")
    assert_clean_error(run_cli("generate", "--json-schema", f"@{tmp_path / 's.json'}", "hi"), "is not UTF-8 text")
    proc = run_cli("serve", "--port", "99999")
    assert proc.returncode == 2 and "a port is 0..65535" in proc.stderr
    from fasterllama.cli import _origins

    assert _origins("HTTPS://Chat.Example.com:443/, http://a:80,http://b:8080") == ["https://chat.example.com", "http://a", "http://b:8080"]
    for origins in ("chat.example.com", "https://chat.example.com/app", "ftp://x", "http://a?b"):  # (a browser's Origin is scheme://host[:port])
        proc = run_cli("serve", "--allowed-origins", origins)
        assert proc.returncode == 2 and "not an origin" in proc.stderr, origins
    proc = run_cli("generate", "The", "capital", "of")  # (the subcommand's help, and why)
    assert proc.returncode == 2 and "quote a prompt of several words" in proc.stderr and "'fasterllama generate --help'" in proc.stderr
    assert "'fasterllama eval perplexity --help'" in run_cli("eval", "perplexity", "--bogus", str(text)).stderr


def test_bench_refuses_a_batch_the_cache_cannot_hold(tmp_path):
    """A batch the KV cache cannot hold at once ran in waves and was reported at up to 20x its
    speed (6,713 tok/s at batch 32 in a 30 MB cache)."""
    import tiny_models as tm

    folder = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), str(tmp_path / "m"))
    proc = run_cli("bench", "--model", folder, "-q", "--kv-cache-memory", "64KiB", "--batch-sizes", "1,64", "--decode-steps", "4", "--repeats", "1")
    assert_clean_error(proc, "a batch of 64 does not fit the KV cache at once")


@needs_model
def test_eval_perplexity_window_wider_than_the_context(default_llm, tmp_path):
    """--context above max_model_len: windows of max_model_len tokens, every token scored once."""
    import json

    from fasterllama.evaluate import perplexity

    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"{w} number {i}." for i, w in enumerate(["apple", "river", "stone", "cloud"] * 30)))
    out = tmp_path / "ppl.json"
    proc = run_cli("eval", "perplexity", "-q", "--context", "100000", "--max-model-len", "128", "--max-tokens", "300", "--json", str(out), str(text))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["tokens"] == 299 and result["context"] == 128 and result["stride"] == 64
    assert "warning: --context 100000 is more than the model's context" in proc.stderr
    ids = default_llm.tokenizer.encode(text.read_text())[:300]
    assert abs(result["perplexity"] - perplexity(default_llm, ids, 128, progress=False)["perplexity"]) < 1e-3 * result["perplexity"]


def test_models_lists_default():
    proc = run_cli("models")
    assert proc.returncode == 0
    assert "smollm2-135m-instruct (default)" in proc.stdout


def test_error_missing_path(tmp_path):
    assert_clean_error(run_cli("generate", "--model", str(tmp_path / "nope.gguf"), "hi"), "no such model")
    assert_clean_error(run_cli("generate", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "hi"), "models are not downloaded")


def test_mistakes_said_before_the_load():
    """Said at once, in words: an option before the command (`fasterllama -q generate`: "-q" was
    unrecognized while generate's help lists it), a beam-search option without beams (ignored),
    a closed stdout (an AttributeError)."""
    assert_clean_error(run_cli("-q", "generate", "hi"), "options go after the command: fasterllama generate -q")
    assert_clean_error(run_cli("generate", "--diversity-rate", "1", "hi"), "--diversity-rate is a beam-search option")
    proc = subprocess.run([sys.executable, "-m", "fasterllama", "generate", "-q", "hi"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=60, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 1 and proc.stderr == "error: stdout or stderr is closed\n"


def test_stop_strings_read_escapes():
    """--stop '\\n' is a newline (as llama.cpp reads its reverse prompts); it never matched."""
    from fasterllama.cli import build_parser

    args = build_parser().parse_args(["generate", "--stop", "\\n", "--stop", "a\\tb\\\\n\\q", "hi"])
    assert args.stop == ["\n", "a\tb\\n\\q"]


def test_error_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("definitely not a model")
    assert_clean_error(run_cli("generate", "--model", str(bad), "hi"), "not a GGUF")
    for head, message in ((b"GGUF\x01\x00\x00\x00", "GGUF version 1 is not supported"), (b"GGUF\x00\x00\x00\x03", "a big-endian GGUF file")):
        bad.write_bytes(head + bytes(64))
        assert_clean_error(run_cli("generate", "--model", str(bad), "hi"), message)


@needs_model
def test_error_truncated_gguf(tmp_path):
    data = open(default_model_path(), "rb").read()
    for size in (2_000, len(data) // 2):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        assert_clean_error(run_cli("generate", "--model", str(cut), "hi"), "truncated")


def _write_gguf(path, arch: str, tensor_type=gguf.GGMLQuantizationType.F32) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    if tensor_type == gguf.GGMLQuantizationType.F32:
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:  # raw bytes of a type we do not run
        block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        w.add_tensor("token_embd.weight", np.zeros((4, 256 // block * type_size), dtype=np.uint8), raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_error_a_zero_head_count(tmp_path):
    path = tmp_path / "zero_heads.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_clean_error(run_cli("generate", "--model", str(path), "hi"), "num_heads must be a positive integer, got 0")


def test_error_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2")
    assert_clean_error(run_cli("generate", "--model", str(path), "hi"), "unsupported architecture", "gpt2")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    assert_clean_error(run_cli("generate", "--model", str(folder), "hi"), "unsupported architecture", "GPT2LMHeadModel")


def test_error_unsupported_tensor_type(tmp_path):
    path = tmp_path / "iq.gguf"
    _write_gguf(path, "llama", gguf.GGMLQuantizationType.IQ2_XXS)
    assert_clean_error(run_cli("generate", "--model", str(path), "hi"), "unsupported GGUF tensor type", "IQ2_XXS")


@pytest.mark.real_model
@needs_model
def test_error_prompt_longer_than_context():
    proc = run_cli("generate", "-q", "--max-model-len", "64", "word " * 100)
    assert_clean_error(proc, "context")
    cut = run_cli("generate", "-q", "--max-model-len", "64", "-n", "100", "--ignore-eos", "word " * 50)  # (51 tokens: fits, with room for 13)
    assert cut.returncode == 0 and "warning: the prompt takes 51 of the context's 64 tokens: room for 13 of the 100" in cut.stderr, cut.stderr


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--max-tokens", "abc"], "max-tokens"),
        (["--top-k", "-3"], "top_k"),
        (["--dtype", "float8"], "dtype"),
        (["--system", "Be brief."], "--system needs --chat"),
        (["--kv-cache-memory", "1.5"], "fraction of free memory must be in (0, 1]"),
        (["--quantization", "w8", "--calibration-file", "notes.txt"], "w8 does not"),
        (["--quantization", "none", "--calibration-file", "notes.txt"], "none does not"),
    ],
)
def test_error_invalid_parameters(args, fragment):
    assert_clean_error(run_cli("generate", *args, "hi"), fragment)


def test_debug_shows_traceback(tmp_path):
    proc = run_cli("--debug", "generate", "--model", str(tmp_path / "nope"), "hi")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


@needs_model
def test_generate_sampling_and_beam_flags(default_llm):
    from fasterllama import SamplingParams

    args = ("generate", "-q", "--seed", "11", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.0",
            "--repetition-penalty", "1.1", "--max-tokens", "12", "--ignore-eos", "Once upon a time")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    params = SamplingParams(seed=11, temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1, max_tokens=12, ignore_eos=True)
    assert first.stdout == second.stdout == default_llm.generate(["Once upon a time"], params)[0].text + "\n"
    beam = run_cli("generate", "-q", "--beam-width", "3", "--max-tokens", "10", "The capital of France is")
    assert beam.returncode == 0, beam.stderr
    expected = default_llm.generate(["The capital of France is"], SamplingParams(beam_width=3, max_tokens=10))[0].text
    assert beam.stdout == expected + "\n"


@pytest.mark.real_model
@needs_model
def test_bench_reports_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "-q", "--batch-sizes", "1,2", "--prompt-lens", "16,32", "--decode-steps", "4", "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert set(result["prefill"]) == {"16", "32"} and all(r["tokens_per_s"] > 0 and r["time_to_first_token_s"] > 0 for r in result["prefill"].values())
    assert set(result["throughput_tokens_per_s"]) == {"1", "2"} and result["decode_tokens_per_s"] > 0
    assert result["peak_rss_mb"] > 100 and result["quantization"] == "gguf"  # the default: the file's 4-bit tensors kept
    assert "prefill" in proc.stdout and "throughput batch" in proc.stdout


@pytest.mark.real_model
@needs_model
def test_bench_cuts_prompts_to_the_context_and_says_so(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli("bench", "-q", "--max-model-len", "64", "--batch-sizes", "1", "--prompt-lens", "16,500", "--decode-steps", "4",
                   "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    prefill = json.loads(out.read_text())["prefill"]
    assert prefill["16"]["prompt_tokens"] == 16 and prefill["500"]["prompt_tokens"] == 64 - 4 - 2
    assert "prefill    58 tokens" in proc.stdout and "cut from 500" in proc.stdout
    assert_clean_error(run_cli("bench", "-q", "--max-model-len", "64", "--decode-steps", "100"), "no room for a prompt")
    assert_clean_error(run_cli("bench", "-q", "--json", str(tmp_path / "no" / "such.json")), "no such folder")


def test_bench_fixed_prompt_ids_are_deterministic():
    from fasterllama.bench import fixed_prompt_ids

    a = fixed_prompt_ids(64, 49152)
    assert a == fixed_prompt_ids(64, 49152) and a != fixed_prompt_ids(64, 49152, seed=1)
    assert all(100 <= t < 49152 for t in a) and len(set(a)) > 50


def test_version() -> None:
    from fasterllama import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"fasterllama {__version__}"


def test_help_does_not_import_torch() -> None:
    """`fasterllama --help` (and each subcommand's), and `fasterllama models`, answer without loading torch."""
    code = (
        "import sys\nfrom fasterllama import cli\n"
        "for argv in (['--help'], ['serve', '--help'], ['generate', '--help'], ['models']):\n"
        "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "serve" in out.stdout


def test_chat_system_refused_by_the_template_is_an_error_up_front(tmp_path):
    """A template that refuses a system message (Mistral v0.1's: roles must alternate from the
    user's) says so when the chat starts, not at the first message."""
    import tiny_models as tm

    folder = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), str(tmp_path / "hf"))
    tm.add_chat_template(folder, "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                                 "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
                                 "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    proc = run_cli("chat", "-q", "--model", folder, "--system", "Be brief.", "-n", "2", stdin="")  # (no message at all)
    assert_clean_error(proc, "--system", "refuses a system message", "roles must alternate")
    ok = run_cli("chat", "-q", "--model", folder, "-n", "2", "-t", "0", stdin="Hi\n")
    assert ok.returncode == 0, ok.stderr
    bare = tm.save_hf_checkpoint(tm.build_hf_model(tm.SPECS["gqa"]), str(tmp_path / "bare"))  # (no chat template at all: said as such)
    proc = run_cli("chat", "-q", "--model", bare, "--system", "Be brief.", stdin="")
    assert_clean_error(proc, "no chat template")
    assert "refuses" not in proc.stderr
