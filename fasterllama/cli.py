"""The `fasterllama` command: generate, chat, models."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from .errors import ContextLengthError, FasterLlamaError


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Every parser, subcommands' included, takes --debug: `fasterllama generate --debug ...`
        works as well as `fasterllama --debug generate ...` (SUPPRESS: absent stays unset)."""
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")

    def error(self, message: str) -> None:  # one line, no usage dump
        print(f"error: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(2)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="GGUF file, HF folder or known name (default: smollm2-135m-instruct)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's, at most 8192)")
    p.add_argument("--quantization", default=None, help="default: a GGUF file's quantized tensors stay so (gguf: exact, the same weights as none), and on the CPU "
                   "F16/BF16 ones and bf16/fp16 safetensors stay 16-bit; "
                   "none (float weights), gguf, gguf-a8 (gguf, with int8 activations as llama.cpp's), "
                   "w8, w8-g32, w4[-g32|-g64|-g128][-noimatrix|-sym][-head4], w8a8[-nosq], "
                   "w8a8-static[-percentile[P]|-max|-mse|-entropy][-clip][-sqALPHA|-nosq]")
    p.add_argument("--calibration-file", default=None, help="text to calibrate static activation scales on (default: a built-in sample)")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size: bytes such as 2GiB or 512MB, or a fraction of free memory "
                   "such as 0.5 (default: up to 2GiB on the CPU, 0.8 of free GPU memory)")
    p.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt in full (default: reuse cached blocks of earlier prompts)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="split the model over N processes (the machine's threads "
                   "divided between them; default 1); under torchrun, over all its processes")
    p.add_argument("--speculative-config", default=None, metavar="JSON", help="speculative decoding, as vLLM's (JSON text or @FILE): "
                   "'{\"method\": \"ngram\", \"num_speculative_tokens\": 8}' drafts from the prompt; "
                   "'{\"method\": \"draft_model\", \"model\": PATH, \"num_speculative_tokens\": 4}' with a smaller model (default: off)")
    p.add_argument("--enforce-eager", action="store_true", help="on a GPU, launch decode steps kernel by kernel instead of replaying CUDA graphs")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", "-t", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min_p * p(max) (default 0.05)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="divide the logits of tokens already in the prompt or output "
                   "by this (multiply the negative ones), as HF (default 1.0: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtract this from the logits of tokens already generated, as "
                   "OpenAI (-2..2, default 0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract this times each token's count so far, as OpenAI "
                   "(-2..2, default 0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: a random one)")
    p.add_argument("--stop", action="append", default=[], type=_escapes,
                   help="stop string (repeatable; \\n, \\t and \\\\ are a newline, a tab and a backslash)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--min-tokens", type=int, default=0, help="generate at least this many tokens before EOS may end it")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="token id that ends generation (repeatable)")
    p.add_argument("--beam-width", type=int, default=1, help="beam search with this many beams (deterministic; no streaming; default 1: off)")
    p.add_argument("--length-penalty", type=float, default=None, help="beam search: score = logprob / length**penalty (default 1.0)")
    p.add_argument("--early-stopping", choices=["true", "false", "never"], default=None, help="beam search stopping rule, as HF's (default false)")
    p.add_argument("--diversity-rate", type=float, default=None, help="beam search: penalize a beam's r-th continuation by rate*r (default 0)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, help="the output follows this JSON schema (its text, or @FILE)")
    g.add_argument("--json", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", default=None, help="the output matches this regular expression")
    g.add_argument("--grammar", default=None, help="the output follows this Lark grammar (llguidance's syntax) or GBNF grammar (llama.cpp's; its text, or @FILE)")
    g.add_argument("--choice", action="append", default=None, help="the output is one of these strings (repeat the flag)")


def _port(text: str) -> int:
    """--port: 0..65535 (the system would take 99999 modulo 65536: port 34463, quietly)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {port}")
    return port


def _origins(text: str) -> list[str]:
    """--allowed-origins: '*' or origins as browsers send them (scheme://host[:port] in lower case,
    no default port, no path)."""
    origins = []
    for origin in (o.strip().rstrip("/").lower() for o in text.split(",") if o.strip()):
        scheme, sep, rest = origin.partition("://")
        if origin != "*" and (not sep or scheme not in ("http", "https") or not rest or any(c in rest for c in "/?#@")):
            raise argparse.ArgumentTypeError(f"not an origin: {origin!r} (e.g. https://chat.example.com or http://host:3000, or '*')")
        origins.append(origin.removesuffix({"http": ":80", "https": ":443"}.get(scheme, "")))
    return origins


def _json_output(path: str | None) -> None:
    """--json FILE checked before the work whose result it keeps: a folder that exists, not a folder itself."""
    if path is None:
        return
    if os.path.isdir(path):
        raise FasterLlamaError(f"--json {path} is a folder: give a file name")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise FasterLlamaError(f"--json {path}: no such folder to write it in")


def _text_or_file(value: str | None, what: str) -> str | None:
    """--json-schema / --grammar / --speculative-config: the text itself, or @FILE for a file's."""
    if value is None or not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as fh:
            return fh.read()
    except OSError as e:
        raise FasterLlamaError(f"cannot read the {what} file {value[1:]}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise FasterLlamaError(f"the {what} file {value[1:]} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _escapes(text: str) -> str:
    """--stop '\\n' as a newline (llama.cpp reads escapes in its reverse prompts): \\n, \\t, \\r and \\\\."""
    table = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in table:
            out.append(table[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


_BEAM_ONLY = {"length_penalty": (1.0, "--length-penalty"), "early_stopping": ("false", "--early-stopping"),
              "diversity_rate": (0.0, "--diversity-rate")}


def _sampling_params(args: argparse.Namespace) -> Any:
    from .sampling_params import SamplingParams

    given = [flag for key, (_, flag) in _BEAM_ONLY.items() if getattr(args, key) is not None]
    if given and args.beam_width <= 1:  # (they were ignored)
        raise FasterLlamaError(f"{given[0]} is a beam-search option: give --beam-width N (N > 1) too")
    for key, (default, _) in _BEAM_ONLY.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        stop_token_ids=args.stop_token_id,
        beam_width=args.beam_width,
        length_penalty=args.length_penalty,
        early_stopping={"true": True, "false": False, "never": "never"}[args.early_stopping],
        diversity_rate=args.diversity_rate,
        json_schema=_text_or_file(args.json_schema, "JSON schema"),
        json_object=args.json,
        regex=args.regex,
        grammar=_text_or_file(args.grammar, "grammar"),
        choice=args.choice,
    )


def _check_calibrates(spec: str | None) -> None:
    """--calibration-file with a mode that reads no text is refused (it was ignored)."""
    from .quant import QuantConfig

    file_modes = ("none", "gguf", "gguf-a8", *GGUF_MODES)  # (weights as a file has them, or llama.cpp's types: no calibration)
    try:
        calibrates = spec is not None and spec.lower() not in file_modes and QuantConfig.parse(spec).needs_calibration
    except FasterLlamaError:
        return  # (not a mode of ours: the load says what is wrong with it)
    if not calibrates:
        raise FasterLlamaError(f"--calibration-file is read only by the modes that calibrate (w8a8-static, SmoothQuant, w4's importance "
                               f"weights): {spec or 'no --quantization'} does not")


def _load(args: argparse.Namespace, max_num_seqs: int | None = None) -> Any:
    from .loading.registry import resolve_model_path

    resolve_model_path(args.model)  # (a mistyped path said at once, not after torch's import and the load's start)
    from .llm import LLM

    calibration_text = None
    if getattr(args, "calibration_file", None):
        _check_calibrates(args.quantization)
        try:
            with open(args.calibration_file, encoding="utf-8", errors="replace") as fh:
                calibration_text = fh.read()
        except OSError as e:
            raise FasterLlamaError(f"cannot read {args.calibration_file}: {e.strerror}") from None
    return LLM(
        model=args.model,
        quantization=args.quantization,
        calibration_text=calibration_text,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=16 if max_num_seqs is None else max_num_seqs,
        kv_cache_memory=getattr(args, "kv_cache_memory", None),  # (`quantize` has no cache flags)
        enable_prefix_caching=not getattr(args, "no_prefix_caching", False),
        progress=not args.quiet and sys.stderr.isatty(),  # (bars in a log or a pipe are \r frames)
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        speculative_config=_text_or_file(getattr(args, "speculative_config", None), "speculative config"),
        enforce_eager=getattr(args, "enforce_eager", False),
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", 2048),
    )


def _print_reply(llm: Any, prompt: Any, params: Any, interruptible: bool = False, verbose: bool = False) -> Any:
    """Stream the reply to stdout (beam search prints it whole); returns its RequestOutput.
    interruptible: Ctrl-C ends the reply where it is (an interactive chat goes on, as llama-cli's).
    verbose: then its token counts, finish reason and speeds on stderr."""
    start = time.perf_counter()
    first: float | None = None
    if params.beam_width > 1:
        output = llm.generate([prompt], params)[0]
        sys.stdout.write(output.text)
    else:
        stream = llm.stream(prompt, params)
        try:
            for delta in stream:
                first = first or time.perf_counter()
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            if not interruptible:
                raise
            print(" (interrupted)", file=sys.stderr, end="")
        output = stream.output
    end = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if verbose:
        n, speed = len(output.token_ids), ""
        if first is not None and n > 1 and end > first:
            speed = f", first text after {(first - start) * 1000:.0f} ms, then {(n - 1) / (end - first):.1f} tok/s"
        print(f"[{len(output.prompt_token_ids)} prompt tokens, {n} generated, finish_reason={output.finish_reason}{speed}]", file=sys.stderr)
    return output


def _warn_if_cut(llm: Any, prompt_tokens: int, max_tokens: int) -> None:
    """Say when the context leaves room for fewer tokens than -n asks (they end at "length" early)."""
    room = llm.engine.max_model_len - prompt_tokens
    if 0 < room < max_tokens:
        print(f"warning: the prompt takes {prompt_tokens} of the context's {llm.engine.max_model_len} tokens: "
              f"room for {room} of the {max_tokens} tokens asked (--max-tokens)", file=sys.stderr)


def _tolerant_stdin() -> None:
    """Decode piped stdin as UTF-8 with U+FFFD for bad bytes (a tty keeps its encoding): Python's
    default surrogateescape lets undecodable bytes through as lone surrogates, which the tokenizer
    then rejects after the model has loaded ("TextInputSequence must be str")."""
    stdin = sys.stdin
    if isinstance(stdin, io.TextIOWrapper):
        stdin.reconfigure(encoding=stdin.encoding if stdin.isatty() else "utf-8", errors="replace")


def _argv_text(text: str | None) -> str | None:
    """A command-line argument as valid text: bytes the locale could not decode become U+FFFD."""
    if text is None:
        return None
    encoding = sys.getfilesystemencoding()  # what Python decoded argv with, undecodable bytes escaped
    return text.encode(encoding, "surrogateescape").decode(encoding, "replace")


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # validate before the (slow) load
    prompt = _argv_text(args.prompt)
    args.system = _argv_text(args.system)
    if args.system is not None and not args.chat:
        raise FasterLlamaError("--system needs --chat (a system message goes through the chat template)")
    if prompt is None or prompt == "-":
        _tolerant_stdin()
        if sys.stdin.isatty():
            print("reading the prompt from stdin (end it with Ctrl-D)", file=sys.stderr)
        prompt = sys.stdin.read().removeprefix("\ufeff").replace("\r\n", "\n")  # (a Windows file's byte order mark and line ends)
        prompt = prompt[:-1] if prompt.endswith("\n") else prompt  # (echo's line end: the same prompt as the argument)
    if not prompt:
        raise FasterLlamaError("empty prompt")
    llm = _load(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
        prompt_ids = llm.chat_prompt(messages)
    else:
        prompt_ids = llm.engine.encode_prompt(prompt)  # (the context error here, before the reply starts)
    _warn_if_cut(llm, len(prompt_ids), params.max_tokens)
    _print_reply(llm, prompt_ids, params, verbose=args.verbose)
    return 0


def _system_tokens(llm: Any, system: list[dict[str, str]]) -> int:
    """The system message's tokens with the chat template (0 where there is none, or the template
    renders no conversation of a system message alone: each message's check then says it). A
    template that refuses a system message before a user's (Mistral v0.1's) is an error now,
    not at the first message."""
    if not system:
        return 0
    try:
        return len(llm.chat_prompt(system))
    except FasterLlamaError:
        pass
    user = [{"role": "user", "content": "Hello."}]
    try:
        llm.chat_prompt(system + user)
    except FasterLlamaError as e:
        llm.chat_prompt(user)  # (no template, no tokenizer: that error, as it is)
        raise FasterLlamaError(f"--system: this model's chat template refuses a system message ({e})") from None
    return 0


_CHAT_COMMANDS = '/reset clears the history, /exit (or Ctrl-D) quits, /help says so; \'"""\' starts and ends a message of several lines'


def _line_editing() -> None:
    """Arrow keys, history and lines longer than the terminal's 4095-byte line buffer in an
    interactive chat (input() reads through readline once it is imported)."""
    try:
        import readline  # noqa: F401
    except ImportError:  # (not on every platform)
        pass


def _read_message(interactive: bool) -> str | None:
    """The next message: a line, or the lines between two lines of three double quotes (a pasted text keeps its
    line breaks and is one message, as ollama's); None at the end of the input. The prompt goes to
    stderr where stdout is not the terminal (`chat > log`: it went into the log)."""

    def line(prompt: str) -> str | None:
        if not interactive:
            raw = sys.stdin.readline()
            return raw.rstrip("\n") if raw else None
        try:
            if sys.stdout.isatty():
                return input(prompt)
            print(prompt, end="", file=sys.stderr, flush=True)
            return input()
        except EOFError:
            print(file=sys.stderr)
            return None

    first = line("> ")
    if first is None or first.strip() != '"""':
        return first
    lines: list[str] = []
    while (more := line(". ")) is not None and more.strip() != '"""':
        lines.append(more)
    return "\n".join(lines)


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    args.system = _argv_text(args.system)
    _tolerant_stdin()
    llm = _load(args)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    failed = False  # a message was refused (the exit status says so)
    alone = _system_tokens(llm, system)
    if alone >= llm.engine.max_model_len:
        raise ContextLengthError(f"the system message alone takes {alone} tokens with the chat template, "
                                 f"but the context is {llm.engine.max_model_len} tokens")
    if interactive:
        _line_editing()
        print(f"Chatting with the model. {_CHAT_COMMANDS}.", file=sys.stderr)
    while (message := _read_message(interactive)) is not None:
        line = message.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history.clear()
            print("(history cleared)", file=sys.stderr)
            continue
        if line == "/help" or (line.startswith("/") and " " not in line and line[1:].isalpha()):  # (not a message: "/usr/bin ..." is one)
            print(f"({_CHAT_COMMANDS}{'' if line == '/help' else f'; {line} is not a command'})", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:
            prompt_ids = _fit_history(llm, system, history, params.max_tokens)
        except ContextLengthError as e:  # one message over the context: said, dropped, and the chat goes on
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            failed = True
            continue
        reply = _print_reply(llm, prompt_ids, params, interruptible=interactive, verbose=args.verbose)
        history.append({"role": "assistant", "content": reply.text})
    return 1 if failed else 0


def _fit_history(llm: Any, system: list[dict[str, str]], history: list[dict[str, str]], max_tokens: int) -> list[int]:
    """Chat prompt ids for the history, dropping the oldest turns when it outgrows the context;
    ContextLengthError where the last message alone does not fit."""
    limit = llm.engine.max_model_len - 1
    alone = len(llm.chat_prompt(system + history[-1:]))
    if alone > limit:  # (before any turn is dropped: the history stays for the next message)
        raise ContextLengthError(f"this message takes {alone} tokens with the chat template, but the context is {llm.engine.max_model_len} tokens")
    while True:
        ids = llm.chat_prompt(system + history)
        if len(ids) + min(max_tokens, limit // 2) <= limit or len(history) <= 1:
            return ids
        del history[: 2 if len(history) > 2 else 1]


def cmd_models(args: argparse.Namespace) -> int:
    from .loading.registry import DEFAULT_MODEL, KNOWN_MODELS

    for name, known in KNOWN_MODELS.items():
        path = known.path()
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}: {known.description}")
        print(f"  installed: {path}" if path else f"  not installed: {known.install}")
    return 0


def cmd_eval_perplexity(args: argparse.Namespace) -> int:
    import json

    from .evaluate import perplexity

    for flag, value, least in (("--context", args.context, 2), ("--stride", args.stride, 1), ("--max-tokens", args.max_tokens, 2)):
        if value is not None and value < least:
            raise FasterLlamaError(f"{flag} must be at least {least}, got {value}")
    try:
        with open(args.file, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as e:
        raise FasterLlamaError(f"cannot read {args.file}: {e.strerror}") from None
    _json_output(args.json)
    llm = _load(args)
    if args.context > llm.engine.max_model_len:  # (windows of the context's length: a result for another --context)
        print(f"warning: --context {args.context} is more than the model's context (--max-model-len): windows of "
              f"{llm.engine.max_model_len} tokens", file=sys.stderr)
    ids = llm.tokenizer.encode(text)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    result = perplexity(llm, ids, args.context, args.stride, progress=not args.quiet and sys.stderr.isatty())
    result.update(model=llm.engine.model_path, quantization=str(llm.engine.quant_config) if llm.engine.quant_config else "none", file=args.file)
    print(f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens ({result['quantization']})", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0


GGUF_MODES = ("q4_k_m", "q4_k", "q5_k", "q6_k", "q2_k", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1", "iq4_nl", "iq4_xs")  # quant/gguf_export.py


def cmd_quantize(args: argparse.Namespace) -> int:
    args.mode = args.mode.lower()  # (Q4_K_M as llama.cpp spells it)
    if not args.output.strip():
        raise FasterLlamaError("-o/--output is empty: give the folder (or, for a GGUF mode, the .gguf file) to write")
    if args.calibration_file:
        _check_calibrates(args.mode)
    if args.mode in GGUF_MODES:
        return _quantize_gguf(args)
    from .loading.registry import resolve_model_path
    from .quant import QuantConfig
    from .quant.checkpoint import save_quantized

    try:
        args.model, args.quantization = args.src, str(QuantConfig.parse(args.mode))  # validate first
    except FasterLlamaError as e:
        raise FasterLlamaError(f"{e}; or a GGUF file's mode: {', '.join(GGUF_MODES)}") from None
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise FasterLlamaError(f"{args.output} is a file: -o names the folder to write (a GGUF mode writes a file)")
    if os.path.exists(args.output) and os.listdir(args.output) and not args.force:
        raise FasterLlamaError(f"{args.output} exists and is not empty (use --force to overwrite)")
    if os.path.exists(args.output) and os.path.samefile(resolve_model_path(args.src), args.output):  # (loaded lazily from it)
        raise FasterLlamaError(f"{args.output} is the model being quantized: write to another folder")
    llm = _load(args)
    with _writing(args.output):
        save_quantized(llm.engine, args.output)
    from .quant import weight_bytes

    print(f"wrote {args.output} ({args.quantization}, {weight_bytes(llm.engine.model) / 1e6:.1f} MB of weights)")
    return 0


def _quantize_gguf(args: argparse.Namespace) -> int:
    """--mode q4_k_m and friends: a GGUF file in llama.cpp's mix, requantized from a GGUF source."""
    from .loading.registry import resolve_model_path
    from .quant.gguf_export import requantize

    src = resolve_model_path(args.src)
    with open(src, "rb") if os.path.isfile(src) else open(os.devnull, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise FasterLlamaError(f"--mode {args.mode} writes a GGUF file from a GGUF file; {src} is not one")
    if os.path.isdir(args.output):
        raise FasterLlamaError(f"{args.output} is a folder: give the GGUF file to write")
    if os.path.exists(args.output) and os.path.samefile(src, args.output):  # (it is read while the output is written)
        raise FasterLlamaError(f"{args.output} is the file being quantized: write to another path")
    if os.path.exists(args.output) and not args.force:
        raise FasterLlamaError(f"{args.output} exists (use --force to overwrite a file)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise FasterLlamaError(f"{args.output}: no such folder to write it in")
    from .loading.gguf_reader import GGUFFile

    quantized = sorted({t.tensor_type.name for t in GGUFFile(src).tensors} - {"F32", "F16", "BF16"})
    if quantized:  # (llama-quantize refuses without --allow-requantize: the result is worse than one made from float weights)
        print(f"warning: {src} is already quantized ({', '.join(quantized)}): its quantized weights are quantized again, "
              "which loses more than quantizing the float model would", file=sys.stderr)
    bar = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(desc="Quantizing", unit="tensor", file=sys.stderr, leave=False)
    t = time.perf_counter()
    try:
        with _writing(args.output):
            counts = requantize(src, args.output, args.mode, None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    mix = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(f"wrote {args.output} ({args.mode}: {mix}; {os.path.getsize(args.output) / 1e6:.1f} MB) in {time.perf_counter() - t:.1f} s")
    return 0


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    """An OS error while writing `path` (a read-only place, a full disk) as one line naming it."""
    try:
        yield
    except OSError as e:
        name = e.filename or path
        verb = "write" if os.path.abspath(name).startswith(os.path.abspath(path)) else "read"
        raise FasterLlamaError(f"cannot {verb} {name}: {e.strerror or e}") from None


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from .bench import run_bench

    if args.decode_steps < 1 or args.repeats < 1:
        raise FasterLlamaError("--decode-steps and --repeats must be >= 1")
    _json_output(args.json)
    t = time.perf_counter()
    llm = _load(args, max_num_seqs=max(args.batch_sizes))
    load_s = time.perf_counter() - t
    result = run_bench(llm, args.prompt_lens, args.batch_sizes, args.decode_steps, args.repeats)
    result.update(model=llm.engine.model_path, quantization=str(llm.engine.quant_config or "none"), load_s=load_s,
                  dtype=str(llm.engine.dtype).removeprefix("torch."), device=str(llm.engine.device))
    for n, r in result["prefill"].items():
        cut = f" (cut from {n} to fit the context)" if r["prompt_tokens"] != n else ""
        print(f"prefill {r['prompt_tokens']:>5} tokens: {r['tokens_per_s']:8.1f} tok/s   time to first token "
              f"{r['time_to_first_token_s'] * 1000:7.1f} ms{cut}")
    print(f"decode  batch 1:     {result['decode_tokens_per_s']:8.1f} tok/s ({args.decode_steps} steps)")
    for b, v in result["throughput_tokens_per_s"].items():
        print(f"throughput batch {b:>3}: {v:8.1f} tok/s")
    print(f"load {load_s:.1f} s, peak RSS {result['peak_rss_mb']:.0f} MB ({result['quantization']}, {result['dtype']}, {result['device']})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """OpenAI-compatible HTTP server over one engine; returns 0 after SIGTERM / Ctrl-C."""
    try:
        from .server.run import bind, serve
    except ImportError as e:
        raise FasterLlamaError(f"the server needs its extra ({e.name} is missing): pip install -e '.[serve]' in fasterllama's "
                               "checkout (an installed package: pip install 'fasterllama[serve]')") from None
    from .engine.async_engine import EngineLoop
    from .loading.registry import DEFAULT_MODEL

    api_key = args.api_key or os.environ.get("FASTERLLAMA_API_KEY") or None
    sock = bind(args.host, args.port)  # a busy port fails before the model loads
    try:
        llm = _load(args, max_num_seqs=args.max_num_seqs)
        name = args.served_model_name or args.model or DEFAULT_MODEL
        serve(EngineLoop(llm.engine), name, args.host, args.port, api_key, "warning" if args.quiet else "info", sock=sock,
              trust_request_chat_template=args.trust_request_chat_template, allowed_origins=args.allowed_origins)
    finally:
        sock.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="fasterllama", description="Fast, hackable inference for LLaMA-family models.")  # --debug: see _Parser
    parser.add_argument("--version", action="version", version=f"fasterllama {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate a continuation of PROMPT (streamed to stdout)")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message with the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    g.add_argument("--verbose", "-v", action="store_true", help="after the reply: token counts, finish reason and speed on stderr")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt ('-' or omitted: read stdin)")
    g.set_defaults(func=cmd_generate)

    chat_help = "interactive multi-turn chat (also reads piped input, one message a line)"
    c = sub.add_parser("chat", help=chat_help, description=f"{chat_help[0].upper()}{chat_help[1:]}. In the chat: {_CHAT_COMMANDS}; "
                       "Ctrl-C stops a reply. Old turns are dropped when the history outgrows the context.")
    _add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    c.add_argument("--verbose", "-v", action="store_true", help="after each reply: token counts, finish reason and speed on stderr")
    c.set_defaults(func=cmd_chat)

    e = sub.add_parser("eval", help="evaluate a model")
    esub = e.add_subparsers(dest="eval_command", required=True, parser_class=_Parser)
    pp = esub.add_parser("perplexity", help="perplexity of a text file (sliding window)")
    _add_model_args(pp)
    pp.add_argument("file", help="a UTF-8 text file")
    pp.add_argument("--context", type=int, default=512, help="window length in tokens (default 512)")
    pp.add_argument("--stride", type=int, default=None, help="window step (default context/2)")
    pp.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the file")
    pp.add_argument("--json", default=None, help="also write the result as JSON to this file")
    pp.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    pp.set_defaults(func=cmd_eval_perplexity)

    qz = sub.add_parser("quantize", help="quantize a model once and save it (safetensors + config + tokenizer, or a GGUF file)")
    qz.add_argument("src", help="GGUF file, HF folder or known name")
    qz.add_argument("--mode", required=True, help="a checkpoint folder in w8, w8-g32, w4[-g32|-g64|-g128][-noimatrix|-sym][-head4], w8a8[-nosq], "
                   "w8a8-static[-percentile[P]|-max|-mse|-entropy][-clip][-sqALPHA|-nosq]; "
                   "or a GGUF file in llama.cpp's mixes from a GGUF source: " + ", ".join(GGUF_MODES))
    qz.add_argument("--output", "-o", required=True, help="output folder (a .gguf file for the GGUF modes)")
    qz.add_argument("--calibration-file", default=None, help="text to calibrate on (static w8a8 / SmoothQuant; default: a built-in sample)")
    qz.add_argument("--dtype", default=None, help="dtype the model is loaded in to be quantized: float32 (CPU default), bfloat16 or float16")
    qz.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    qz.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    qz.set_defaults(func=cmd_quantize, device="cpu", max_model_len=None)

    b = sub.add_parser("bench", help="prefill/decode speed, batch throughput, time to first token, peak memory")
    _add_model_args(b)
    b.add_argument("--batch-sizes", type=_int_list, default=[1, 4, 8, 16], help="decode batch sizes (default 1,4,8,16)")
    b.add_argument("--prompt-lens", type=_int_list, default=[128, 512], help="prefill prompt lengths (default 128,512)")
    b.add_argument("--decode-steps", type=int, default=128, help="decode steps per measurement (default 128)")
    b.add_argument("--repeats", type=int, default=3, help="medians of this many runs (default 3)")
    b.add_argument("--json", default=None, help="also write the results as JSON")
    b.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /metrics")
    _add_model_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free one)")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /tokenizer_info "
                    "(/health, /metrics and /version stay open; default: $FASTERLLAMA_API_KEY, else none)")
    sv.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model, or the default model's name)")
    sv.add_argument("--max-num-seqs", type=int, default=16, help="most sequences decoded together (default 16)")
    sv.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="most tokens a step computes: prompt chunks and decodes together (default 2048)")
    sv.add_argument("--trust-request-chat-template", action="store_true",
                    help="let requests bring their own chat_template (a template is a program: only for trusted clients)")
    sv.add_argument("--allowed-origins", type=_origins, default=[], metavar="ORIGINS",
                    help="web pages at these origins may call the API from a browser (CORS), comma-separated, e.g. "
                    "https://chat.example.com; '*': any. Pages on localhost always may")
    sv.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no access log")
    sv.set_defaults(func=cmd_serve)

    m = sub.add_parser("models", help="list known model names, which are installed, and where")
    m.set_defaults(func=cmd_models)
    return parser


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser the arguments chose: `fasterllama eval perplexity` -> its own."""
    while parser._subparsers is not None:
        action = next(a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction))
        chosen = action.choices.get(getattr(args, action.dest, None) or "")
        if chosen is None:
            break
        parser = chosen
    return parser


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll's POLLERR on the write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # (said by the subcommand's parser: its --help is the one to read)
        hint = " (quote a prompt of several words)" if getattr(args, "prompt", None) and not any(e.startswith("-") for e in extra) else ""
        before = argv[: argv.index(args.command)] if args.command in argv else []
        if any(e in before for e in extra):  # (`fasterllama -q generate ...`)
            hint = f" (options go after the command: fasterllama {args.command} {' '.join(extra)} ...)"
        _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if sys.stdout is None or sys.stderr is None:  # (`>&-`: print() would fail on None, the error with it)
        os.write(2, b"error: stdout or stderr is closed\n")
        return 1
    debug = getattr(args, "debug", False) or os.environ.get("FASTERLLAMA_DEBUG") == "1"
    if isinstance(sys.stdout, io.TextIOWrapper):  # text a terminal's encoding lacks (PYTHONIOENCODING=ascii, a C locale) shows as "?"
        sys.stdout.reconfigure(errors="replace")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # a reader that stopped early (| head): fine, unless stdout still works (stderr broke: the output was cut)
        if not _stdout_reader_gone():
            return 141
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush of what is left would fail again)
        return 0
    except Exception as e:
        if debug:
            raise
        if isinstance(e, FasterLlamaError):
            print(f"error: {e}", file=sys.stderr)
        else:
            print(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
