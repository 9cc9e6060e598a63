"""LLMEngine: requests in, one scheduled step at a time, token updates out.

request -> Sequence -> Scheduler -> ModelRunner -> Sampler -> detokenize -> finished check.
Where the device runs queued behind the host (a GPU), plain decode steps are chained: step n+1
is launched with step n's samples as its input before the host reads them (docs/gpu.md)."""

from __future__ import annotations

import logging
import os
import random
import weakref
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..backends import Backend, get_backend
from ..config import ModelConfig
from ..errors import ContextLengthError, FasterLlamaError
from ..loading import read_config
from ..loading.model_loader import GGUF_NATIVE, LoadedModel, keeps_16bit_for, load_model
from ..loading.registry import resolve_model_path
from ..model import LlamaForCausalLM
from ..parallel import workers as tp_workers
from ..parallel.group import TPGroup, WorkerFailure
from ..parallel.sharding import ShardPlan, shard_model
from ..quant import QuantConfig, quantize_model
from ..quant.calibrate import calibration_chunks
from ..sampling_params import SamplingParams, integer_value
from ..tokenizer import Tokenizer
from . import sampler, speculative
from .block_manager import BlockManager
from .kv_cache import KVCache, memory_budget, num_blocks_for
from .model_runner import ModelRunner, decode_inputs
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Logprob, Sequence
from .stop_strings import cut_at_stop, find_stop, stop_prefix_len
from .structured import StructuredOutput

log = logging.getLogger(__name__)
NONFINITE_ERROR = "the model's logits are not finite (NaN or infinity): its weights may be damaged (a corrupt file) or overflow this dtype"

FILE_MODES = (None, *GGUF_NATIVE, "none")  # quantization values that load a checkpoint as it is (no quantize step)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise FasterLlamaError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FasterLlamaError(f"device {device!r} requested but no CUDA GPU is available")
    if dev.type not in ("cpu", "cuda"):
        raise FasterLlamaError(f"unsupported device {device!r} (use cpu or cuda)")
    return dev


def _usable_defaults(defaults: dict[str, Any]) -> dict[str, Any]:
    """The model's recommended sampling (ModelConfig.sampling_defaults) that SamplingParams takes;
    other values are left out, with a warning."""
    kept = {}
    for name, value in defaults.items():
        try:
            SamplingParams(**{name: value})
            kept[name] = value
        except FasterLlamaError as e:
            log.warning("generation_config.json's %s is not used: %s", name, e)
    return kept


def _check_limits(max_num_seqs: int, max_num_batched_tokens: int, block_size: int | None = None) -> None:
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens), ("block_size", block_size or 8)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FasterLlamaError(f"{name} must be an integer >= 1, got {value!r}")
    if block_size is not None and (block_size < 8 or block_size & (block_size - 1)):
        raise FasterLlamaError(f"block_size must be a power of two >= 8 (the kernels address blocks with shifts), got {block_size}")


def _check_model_arg(model: object) -> str | None:
    """The model argument as a str (a path, a known name) or None (the default model)."""
    if model is None or isinstance(model, str):
        return model
    if isinstance(model, os.PathLike):
        path = os.fspath(model)
        if isinstance(path, str):
            return path
    raise FasterLlamaError(f"model must be a path or a known model name (a string), or None for the default model; got {model!r}")


def check_text(text: str, what: str) -> str:
    """text, if it is valid Unicode: a lone surrogate (undecodable bytes smuggled in by Python's
    surrogateescape) would otherwise fail in the tokenizer as "TextInputSequence must be str"."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise FasterLlamaError(f"{what} is not valid Unicode text: lone surrogate {text[e.start]!r} at character {e.start} "
                                   "(decode bytes with errors='replace')") from None
    return text


def resolve_dtype(dtype: str | torch.dtype | None, backend: Backend) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise FasterLlamaError(f"unsupported dtype {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        return backend.default_dtype
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise FasterLlamaError(f"unknown dtype {dtype!r} (use float32, bfloat16 or float16)")
    return _DTYPES[dtype]


def _stop_workers(runner: ModelRunner, workers: tp_workers.Workers) -> None:
    try:
        stopping = runner.stop_workers()
    except FasterLlamaError:
        stopping = False  # a rank died already
    workers.stop(10 if stopping else 0)


@dataclass(frozen=True)
class EngineLimits:
    """The sizes the runtime is built to (a draft model's engine takes the target's)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory: float | str | None
    block_size: int
    prefix_caching: bool


@dataclass
class StepUpdate:
    """One token a sequence emitted in a step (a speculative step may emit several)."""

    seq: Sequence
    token_id: int
    text_delta: str
    logprobs: dict[int, float] | None = None  # this token's top logprobs, when asked
    finish_reason: str | None = None  # set on the token that finished the sequence


@dataclass
class _Launched:
    """A decode step launched and not yet read: its sequences, the position each computes, and the
    tokens it draws, on the device (`read` waits for them on the host)."""

    seqs: list[Sequence]
    positions: list[int]
    tokens: torch.Tensor
    read: Callable[[], list[int]]


class LLMEngine:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: float | str | None = None,
        block_size: int | None = None,
        enable_prefix_caching: bool = True,
        progress: bool = True,
        quantization: str | QuantConfig | None = None,
        calibration_text: str | None = None,
        calibration_tokens: int = 2048,
        tensor_parallel_size: int = 1,
        speculative_config: speculative.SpeculativeConfig | dict | str | None = None,
        enforce_eager: bool = False,
        tp_group: TPGroup | None = None,
    ) -> None:
        """tensor_parallel_size N > 1: the model split over N processes (N-1 workers spawned here,
        the machine's threads divided between them), or over every process of a torchrun launch.
        speculative_config: speculative decoding (engine/speculative.py), off by default.
        enforce_eager: no CUDA graphs (vLLM's flag; the CPU's one-call decode step is no graph and stays).
        tp_group: a spawned worker's group (parallel/workers.py): it loads its part as rank 0 does."""
        _check_limits(max_num_seqs, max_num_batched_tokens, block_size)
        enable_prefix_caching = True if enable_prefix_caching is None else enable_prefix_caching  # (None: vLLM's default, on)
        for name, flag in (("enable_prefix_caching", enable_prefix_caching), ("progress", progress), ("enforce_eager", enforce_eager)):
            if not isinstance(flag, bool):  # ("false" would be true)
                raise FasterLlamaError(f"{name} must be True or False, got {flag!r}")
        spec = speculative.SpeculativeConfig.parse(speculative_config)
        if spec is not None and spec.model is not None:
            resolve_model_path(spec.model)  # a missing draft model fails before the model loads
        if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
            raise FasterLlamaError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
        model = _check_model_arg(model)
        if quantization is not None and not isinstance(quantization, (str, QuantConfig)):
            raise FasterLlamaError(f"quantization must be a string such as 'w8' or 'none', got {type(quantization).__name__}")
        if calibration_text is not None and not isinstance(calibration_text, str):
            raise FasterLlamaError(f"calibration_text must be a string, got {type(calibration_text).__name__}")
        if quantization not in FILE_MODES:
            try:
                QuantConfig.parse(quantization)  # a bad spec fails before the model loads
            except FasterLlamaError as e:
                raise FasterLlamaError(f"{e}; or none (float weights), gguf (a GGUF file's quantized tensors as they are) "
                                       "or gguf-a8 (and int8 activations)") from None
        dev = resolve_device(device)
        if kv_cache_memory is not None:
            memory_budget(kv_cache_memory, dev)  # a size that cannot fit (or is no size) fails now, not after the load
        group, workers = tp_group, None
        if group is not None:
            dev = group.device
        elif tensor_parallel_size > 1 or tp_workers.torchrun_env() is not None:
            if tp_workers.torchrun_env() is None:  # a size that cannot split this model fails before any worker starts
                ShardPlan.build(read_config(model), 0, tensor_parallel_size)
            same = dict(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        kv_cache_memory=kv_cache_memory, block_size=block_size, enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
                        quantization=quantization, calibration_text=calibration_text, calibration_tokens=calibration_tokens)
            group, workers = tp_workers.start(tensor_parallel_size, dev, same)
            dev = group.device
        try:
            backend = get_backend(dev)
            backend.register_ops()
            dtype = resolve_dtype(dtype, backend)
            loaded = load_model(model, dtype, backend.device, quantization if quantization in (None, *GGUF_NATIVE) else "none",
                                backend.keeps_gguf_quantized(dtype), progress,
                                # in parts as it loads, unless a quantization mode needs the whole model first (calibration)
                                (group.rank, group.size) if group is not None and quantization in FILE_MODES else None,
                                backend.keeps_16bit_weights(dtype) and keeps_16bit_for(quantization))
            self._start(loaded, backend, dtype, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory, block_size,
                        enable_prefix_caching, tensor_parallel=group is not None, enforce_eager=enforce_eager)
            if quantization not in FILE_MODES:
                self.quantize(quantization, calibration_text, calibration_tokens, progress)
            if group is not None:
                self.join_tensor_parallel(group, workers)
            if spec is not None and (group is None or group.is_first):
                self.speculator = speculative.make_speculator(spec, self, progress)
        except BaseException:
            if workers is not None:
                workers.stop(0)
            raise
        if group is not None and not group.is_first and tp_group is None:  # a torchrun rank other than the first: a worker until rank 0 stops
            self.runner.run_worker()
            raise SystemExit(0)

    @classmethod
    def from_model(cls, model: LlamaForCausalLM, tokenizer: Tokenizer | None = None, *, max_model_len: int | None = None,
                   max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, kv_cache_memory: float | str | None = None,
                   block_size: int | None = None, enable_prefix_caching: bool = True,
                   speculative_config: speculative.SpeculativeConfig | dict | str | None = None) -> LLMEngine:
        """An engine over a model built in memory (random weights for benchmarks, a model changed
        by research code), on the device and dtype of its weights; without a tokenizer, prompts
        are token ids and outputs have no text."""
        _check_limits(max_num_seqs, max_num_batched_tokens, block_size)
        weight = model.norm.weight  # float in every mode: the model's dtype and device
        backend = get_backend(weight.device)
        backend.register_ops()
        engine = cls.__new__(cls)
        loaded = LoadedModel(model, model.config, tokenizer, None, getattr(model, "quant_config", None))
        engine._start(loaded, backend, weight.dtype, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory, block_size,
                      enable_prefix_caching)
        spec = speculative.SpeculativeConfig.parse(speculative_config)
        if spec is not None:
            engine.speculator = speculative.make_speculator(spec, engine, False)
        return engine

    def _start(self, loaded: LoadedModel, backend: Backend, dtype: torch.dtype, max_model_len: int | None, max_num_seqs: int,
               max_num_batched_tokens: int, kv_cache_memory: float | str | None, block_size: int | None, prefix_caching: bool,
               tensor_parallel: bool = False, enforce_eager: bool = False) -> None:
        """Size the KV cache and set up the scheduler and the model runner around a loaded model
        (tensor_parallel: one that join_tensor_parallel will cut, or whose modules loading cut:
        no whole-step decode, which runs a whole model; enforce_eager: none that is a CUDA graph)."""
        self.backend, self.device, self.dtype = backend, backend.device, dtype
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_path = loaded.path
        self.quant_config: QuantConfig | str | None = loaded.quant_config
        cfg = self.config
        if max_model_len is None:
            max_model_len = min(cfg.max_position_embeddings, 8192)
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 2:
            raise FasterLlamaError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if max_model_len > cfg.max_position_embeddings:  # past it the positions are untrained (and tables too short)
            why = ("its sliding window, within which full attention is exact" if cfg.sliding_window is not None
                   else "max_position_embeddings")
            raise FasterLlamaError(f"max_model_len {max_model_len} exceeds the model's context of {cfg.max_position_embeddings} tokens "
                                   f"({why}); use at most that")
        self.max_model_len = max_model_len
        self.context_set_by_cache = False  # max_model_len lowered to what the KV cache holds (_build_runtime)
        self.rng = random.Random()  # the seeds of requests without one (LLM(seed=...) fixes it: runs repeat)
        self.eos_token_ids = set(cfg.eos_token_ids)
        self.sampling_defaults = _usable_defaults(cfg.sampling_defaults)  # (what a request leaves out, in the server too)
        self.default_params = SamplingParams(**self.sampling_defaults)
        self.structured = StructuredOutput(self.tokenizer, cfg.vocab_size, sorted(self.eos_token_ids))
        self.limits = EngineLimits(max_num_seqs, max_num_batched_tokens, kv_cache_memory, block_size or backend.kv_block_size, prefix_caching)
        self.tp_group: TPGroup | None = None
        self._workers: tp_workers.Workers | None = None
        self.failure: str | None = None  # why the engine cannot run steps any more (a tensor-parallel rank died)
        self._whole_step_decode = not tensor_parallel and not (enforce_eager and backend.decode_plan_is_graph)
        # Chained decode steps (where the backend's kernels queue behind the host): step n+1 is
        # launched with step n's sampled ids as its input, on the device, before the host reads
        # them, so the device never idles while the host reads, detokenizes and schedules
        self.chain_steps = backend.chains_steps and not tensor_parallel
        self.launched: _Launched | None = None
        self.speculator: speculative.Speculator | None = None
        self._build_runtime(cfg)

    def _build_runtime(self, cache_cfg: ModelConfig) -> None:
        """The KV cache (of cache_cfg's heads), block manager, scheduler and model runner; under
        tensor parallelism every rank's cache has as many blocks as rank 0's."""
        limits, group = self.limits, self.tp_group
        block_size = limits.block_size
        num_blocks = num_blocks_for(cache_cfg, self.dtype, self.device, limits.kv_cache_memory, block_size, limits.max_num_seqs,
                                    self.max_model_len)
        if group is not None:
            num_blocks = group.send(num_blocks) if group.is_first else group.receive()
        self.kv_cache = self.runner = None  # the old cache goes before the new one comes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # and its memory counts as free when the new one is sized
        if num_blocks * block_size < self.max_model_len:  # (a kv_cache_memory too small for one full-length sequence)
            log.warning("the KV cache holds %d tokens: the context (max_model_len) is %d, not %d; raise kv_cache_memory for more",
                        num_blocks * block_size, num_blocks * block_size, self.max_model_len)
            self.max_model_len, self.context_set_by_cache = num_blocks * block_size, True
        try:
            self.kv_cache = KVCache(cache_cfg, num_blocks, block_size, self.dtype, self.device)
        except (RuntimeError, MemoryError) as e:  # (torch's allocators: "can't allocate memory", CUDA out of memory)
            raise FasterLlamaError(f"cannot allocate the KV cache ({num_blocks * KVCache.bytes_per_block(cache_cfg, block_size, self.dtype) / 2**30:.1f} GiB"
                                   f" for {num_blocks * block_size} tokens): lower kv_cache_memory ({str(e).splitlines()[0]})") from None
        self.runner = ModelRunner(self.model, self.kv_cache, self.backend, limits.max_num_seqs, self.max_model_len, group, self._whole_step_decode)
        self.blocks = BlockManager(num_blocks, block_size, self.runner.copy_blocks, limits.prefix_caching)
        self.scheduler = Scheduler(self.blocks, limits.max_num_seqs, limits.max_num_batched_tokens)

    def use_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Take another tokenizer than the checkpoint's (LLM(tokenizer=...)): its ids must be the model's."""
        if tokenizer.vocab_size > self.config.vocab_size:
            raise FasterLlamaError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's {self.config.vocab_size}")
        self.tokenizer = tokenizer
        if tokenizer.eos_token_id is not None:  # (its end-of-text ends sequences too, as in vLLM)
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.structured = StructuredOutput(tokenizer, self.config.vocab_size, sorted(self.eos_token_ids))

    def join_tensor_parallel(self, group: TPGroup, workers: tp_workers.Workers | None = None) -> None:
        """Keep this rank's shard of the (loaded, quantized) model and a KV cache of its heads."""
        self.runner.decode_plan = None
        plan = shard_model(self.model, group)
        self.tp_group, self._workers = group, workers
        self._build_runtime(plan.local_config())
        if workers is not None:
            self._stop = weakref.finalize(self, _stop_workers, self.runner, workers)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (also done when the engine is collected or at exit)."""
        if self._workers is not None:
            self._stop()  # once: a finalizer that has run is dead

    def quantize(self, spec: str | QuantConfig, calibration_text: str | None = None, calibration_tokens: int = 2048, progress: bool = False) -> None:
        """Quantize the loaded float model in place (calibrating on a text when the mode needs it)."""
        qcfg = QuantConfig.parse(spec)
        if self.tp_group is not None:
            raise FasterLlamaError("a tensor-parallel engine quantizes while it loads: pass quantization= to LLM / LLMEngine")
        if self.quant_config is not None:
            raise FasterLlamaError(f"the model is quantized already ({self.quant_config}); load it with quantization='none' to quantize it another way")
        self.runner.decode_plan = None  # (it holds every weight: each float linear goes as it is quantized; refreshed below)
        if qcfg.mode == "w8a8":  # 16-bit matrices as loaded: it smooths whole layers and keeps floats in the model's dtype
            self.model.widen_weights()  # (the weight-only modes widen one linear at a time as they quantize it)
        chunks = None
        if qcfg.needs_calibration:
            chunks = calibration_chunks(self.tokenizer, calibration_text, calibration_tokens, min(512, self.max_model_len))
        quantize_model(self.model, qcfg, self.run_prompt, chunks, progress=progress)
        self.blocks.reset_prefix_cache()  # the calibration passes' K/V came from the float weights
        self.runner.refresh_decode_plan()
        self.quant_config = qcfg

    # -- requests -------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Seq[int], keep_last: int | None = None) -> list[int]:
        """Token ids of a prompt (a string, or token ids checked against the vocabulary); only
        its last keep_last tokens where given (truncate_prompt_tokens; -1: the most that leaves a
        token to generate), before the context check."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(check_text(prompt, "the prompt"))
        elif isinstance(prompt, (bytes, bytearray)):
            raise FasterLlamaError("a prompt must be a string or a list of token ids, got bytes (decode them to a string first)")
        else:
            ids = self.check_token_ids(prompt, "prompt")
        if keep_last:
            ids = ids[-(self.max_model_len - 1 if keep_last == -1 else keep_last):]
        if not ids:
            raise FasterLlamaError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens, but the context is {self.max_model_len} tokens{self._context_origin()} "
                "(it must leave room for at least one generated token)"
            )
        return ids

    def check_token_ids(self, token_ids: object, what: str = "token_ids") -> list[int]:
        """token_ids as a list of ints in the vocabulary: a list/tuple of ints (numpy or 0-d torch
        integers too) or a 1-D integer array; floats and bools are refused rather than truncated."""
        if isinstance(token_ids, (torch.Tensor, np.ndarray)) and token_ids.ndim == 1:
            token_ids = token_ids.tolist()  # float/bool arrays become floats/bools, refused below
        if not isinstance(token_ids, (list, tuple, range)):
            allowed = "a string or a list of token ids" if what == "prompt" else "a list of token ids"
            raise FasterLlamaError(f"{what} must be {allowed}, got {type(token_ids).__name__}")
        vocab = self.config.vocab_size
        if all(type(t) is int for t in token_ids) and (not token_ids or 0 <= min(token_ids) and max(token_ids) < vocab):
            return list(token_ids)  # (plain ints in range, the usual case: ~30x faster than the checks below, 6 ms for 2,048 ids)
        ids = []
        for pos, value in enumerate(token_ids):
            tok = integer_value(value)
            if tok is None:
                raise FasterLlamaError(f"{what} must hold integer token ids (not floats, bools or strings), "
                                       f"got {value!r} ({type(value).__name__}) at position {pos}")
            if not 0 <= tok < vocab:
                raise FasterLlamaError(f"token id {tok} (position {pos} of {what}) is outside the vocabulary (0..{vocab - 1})")
            ids.append(tok)
        return ids

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, sample_index: int = 0) -> Sequence:
        """Queue one sequence; sample_index picks an independent random stream for each of n samples."""
        seq = self.new_sequence(prompt, params, sample_index)
        self.scheduler.add(seq)
        return seq

    def new_sequence(self, prompt: str | Seq[int], params: SamplingParams | None = None, sample_index: int = 0) -> Sequence:
        """One sequence, its prompt and params checked, not queued yet (add_request queues it)."""
        return self._sequences(prompt, self.check_params(params), [sample_index])[0]

    def add_group(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> list[Sequence]:
        """Queue a request's params.n samples: the first prefills the prompt, the others then fork
        from it (sharing its blocks) and draw their own first tokens from the same logits. A group
        starts only where it has all its seats, so more samples than max_num_seqs go in groups of
        at most max_num_seqs, each group's first prefilling (from the prefix cache, where it is on)."""
        params = self.check_params(params)
        seqs = self._sequences(prompt, params, range(params.n))
        size = self.scheduler.max_num_seqs
        for first in range(0, len(seqs), size):
            seqs[first].forks = seqs[first + 1 : first + size]
            self.scheduler.add(seqs[first])
        return seqs

    def _sequences(self, prompt: str | Seq[int], params: SamplingParams, sample_indices: Iterable[int]) -> list[Sequence]:
        """A prompt's sequences (encoded once), each with its sample's seed, the bad words' ids and
        its own constraint matcher."""
        ids = self.encode_prompt(prompt, params.truncate_prompt_tokens)
        bad = self._bad_words_ids(params)
        seqs = []
        for k in sample_indices:
            seq = Sequence(ids, params, self.tokenizer if params.detokenize else None, self._seed(params, k))
            seq.bad_words_ids, seq.matcher = bad, self.structured.matcher(params)
            seqs.append(seq)
        return seqs

    def _bad_words_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token ids as vLLM spells it: without its leading spaces, and after one
        space where that spelling has as many tokens and another first token (a word that starts
        a text, and one inside it)."""
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise FasterLlamaError("bad_words need the model's tokenizer")
        out: list[list[int]] = []
        for word in params.bad_words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out += [ids for ids in (bare, spaced if bare and len(spaced) == len(bare) and spaced[0] != bare[0] else []) if ids and ids not in out]
        return out

    def check_params(self, params: object) -> SamplingParams:
        """params (None: the defaults) checked against this model (token ids in its vocabulary): a
        copy checked again, as a SamplingParams made anew (fields set after it was made, as vLLM
        scripts set them: `params.max_tokens = None`, `params.structured_outputs = ...`, apply)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise FasterLlamaError(f"params must be a SamplingParams (or None for the defaults), got {type(params).__name__}")
        params = replace(params if params is not None else self.default_params)
        vocab = self.config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise FasterLlamaError(f"{name} has token id {outside[0]}, outside the vocabulary (0..{vocab - 1})")
        ends = {*self.eos_token_ids, *params.stop_token_ids}
        if params.min_tokens and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= ends:
            raise FasterLlamaError(f"min_tokens ({params.min_tokens}) bans the end tokens that allowed_token_ids "
                                   f"{sorted(set(params.allowed_token_ids))} is made of: no token could be drawn")
        return params

    def _context_origin(self) -> str:
        if self.context_set_by_cache:
            return ", all the KV cache holds (raise kv_cache_memory for more)"
        if self.config.sliding_window == self.max_model_len:
            return ", the model's sliding window (longer contexts would need windowed attention)"
        return ""

    def _seed(self, params: SamplingParams, sample_index: int) -> int:
        """Sample k's seed: seed + k, wrapped into int64 (the sampler's seeds are int64s)."""
        if params.seed is None:
            return self.rng.getrandbits(62)
        return (params.seed + sample_index + 2**63) % 2**64 - 2**63

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.speculator is not None:
            self.speculator.release(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[StepUpdate]:
        """Schedule, run and sample one step; the updates of the sequences that drew tokens."""
        if self.launched is not None:  # a chained step is under way: launch the one after, then read it
            return self._read_chained(self.launched)
        if self.speculator is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        rows, sample_rows, prompt_rows = self._logit_rows(batch)
        starts = {id(item): item.seq.num_cached for item in batch}
        seqs = [item.seq for item in batch if item.samples]  # before advance moves num_cached
        drafts = [item.drafts for item in batch if item.samples]
        every_row = rows == list(range(sum(item.num_tokens for item in batch)))  # a decode step: no row gather needed
        all_logits = self._execute(batch, None if every_row else rows)
        self.scheduler.advance(batch)
        for item, first in prompt_rows:
            self._keep_prompt_rows(item, starts[id(item)], all_logits[first : first + item.num_tokens - len(item.drafts)])
        if not seqs:
            return []
        if len(seqs) == len(batch) and self._chains(batch):
            tokens = sampler.token_tensor(all_logits, seqs, self.eos_token_ids)
            return self._read_chained(_Launched(seqs, [starts[id(item)] for item in batch], tokens, self.backend.tokens_later(tokens)))
        self._start_forks(seqs, drafts, sample_rows)
        # one logits row per token drawn: a sequence's next token, then one after each of its drafts
        gather = [r + j for r, d in zip(sample_rows, drafts) for j in range(len(d) + 1)]
        return self._sample(seqs, drafts, all_logits if gather == list(range(len(rows))) else all_logits[gather])

    @staticmethod
    def _logit_rows(batch: list[ScheduledSeq]) -> tuple[list[int], list[int], list[tuple[ScheduledSeq, int]]]:
        """The packed rows whose logits the step needs (each sampling sequence's last token and its
        drafts', every prompt row of sequences that asked for prompt logprobs or logits); per
        sampling sequence its first row among them; per such prompt, its first row."""
        rows: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[ScheduledSeq, int]] = []
        offset = 0
        for item in batch:
            n = item.num_tokens
            if item.seq.needs_prompt_rows and item.seq.num_cached < len(item.seq.prompt_token_ids):
                prompt_rows.append((item, len(rows)))  # (a last prompt token may come with drafts after it)
                rows.extend(range(offset, offset + n))
                if item.samples:
                    sample_rows.append(len(rows) - 1 - len(item.drafts))
            elif item.samples:
                sample_rows.append(len(rows))
                rows.extend(range(offset + n - 1 - len(item.drafts), offset + n))
            offset += n
        return rows, sample_rows, prompt_rows

    def _execute(self, batch: list[ScheduledSeq], rows: list[int] | None) -> torch.Tensor:
        """The runner's logits of `rows`; a tensor-parallel worker's failure shuts the engine down
        and is raised again by every later step."""
        if self.failure is not None:
            raise WorkerFailure(self.failure)
        try:
            return self.runner.execute(batch, rows)
        except WorkerFailure as e:
            detail = self._workers.describe_failures() if self._workers else ""
            self.failure = f"{e}; {detail}" if detail else str(e)
            self.shutdown()
            raise WorkerFailure(self.failure) from None

    def _keep_prompt_rows(self, item: ScheduledSeq, start: int, rows_logits: torch.Tensor) -> None:
        """A prompt chunk's logits (compute_logits) and prompt logprobs, from position `start`."""
        if item.seq.prompt_logits is not None:
            if start == 0:  # (computed again from the start: preempted meanwhile)
                item.seq.prompt_logits.clear()
            item.seq.prompt_logits.append(rows_logits.clone())
        if item.seq.params.prompt_logprobs is not None:
            self._add_prompt_logprobs(item.seq, start, rows_logits)

    def _start_forks(self, seqs: list[Sequence], drafts: list[list[int]], sample_rows: list[int]) -> None:
        """A request's other samples start once its prompt is in the cache: each joins the step's
        sampling sequences (no drafts), drawing from its parent's logits row."""
        for i in range(len(seqs)):
            parent = seqs[i]
            for child in parent.forks:
                if child.is_finished:  # aborted before it started
                    continue
                self.scheduler.fork(parent, child)
                child.prompt_logprobs = None if parent.prompt_logprobs is None else list(parent.prompt_logprobs)
                child.num_prefix_cached, child.admitted = parent.num_prefix_cached, True
                seqs.append(child)
                drafts.append([])
                sample_rows.append(sample_rows[i])
            parent.forks = []

    def _sample(self, seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor) -> list[StepUpdate]:
        """Draw each sequence's tokens from its logits rows (one, then one after each draft),
        verify its drafts, and append what it keeps."""
        row_seqs = [(seq, d[:j]) for seq, d in zip(seqs, drafts) for j in range(len(d) + 1)]
        broken = self._nonfinite_first_rows(row_seqs, logits)
        need_logprobs = any(s.params.logprobs is not None for s in seqs)
        logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None  # the model's, before any constraint (vLLM's raw logprobs)
        if any(s.matcher is not None for s in seqs):  # structured output: only the tokens its constraint allows
            self.structured.mask(logits, [(s.matcher, extra, s.params.ignore_eos) for s, extra in row_seqs])
        token_ids = sampler.next_tokens(logits, row_seqs, self.eos_token_ids)
        for i in broken:  # (the plain argmax does not look: a first token's row is checked here, once a sequence)
            token_ids[i] = sampler.NOT_FINITE
        updates = []
        row = 0
        for seq, d in zip(seqs, drafts):
            emitted = speculative.verify(d, token_ids[row : row + len(d) + 1])
            shown = 0  # tokens appended before one ended the sequence
            for j, tok in enumerate(emitted):
                if tok == sampler.NO_TOKEN:  # (this sequence's own failure: the step goes on for the others)
                    updates.append(self._fail(seq, f"no token is allowed at output token {len(seq.output_token_ids) + 1}: its "
                                              "allowed_token_ids, bad_words, min_tokens (no end token before it) and "
                                              "structured output leave none"))
                    break
                if tok == sampler.NOT_FINITE:
                    updates.append(self._fail(seq, NONFINITE_ERROR, request_error=False))
                    break
                top = None
                if logprobs is not None and seq.params.logprobs is not None:
                    top = self._top_logprobs(logprobs[row + j], tok, seq.params.logprobs, seq.params.detokenize)
                    seq.logprobs.append(top)
                    seq.cumulative_logprob += top[tok]
                updates.append(self._append_token(seq, tok, top))
                shown += 1
                if seq.is_finished:
                    break
            if d:  # (drafts past a token that ended the sequence were never shown: not counted as accepted)
                self.scheduler.accept(seq, len(emitted) - 1)
                self.speculator.record(seq, len(d), min(len(emitted) - 1, shown))
            row += len(d) + 1
        return updates

    @staticmethod
    def _nonfinite_first_rows(row_seqs: list[tuple[Sequence, list[int]]], logits: torch.Tensor) -> list[int]:
        """The rows drawing a sequence's first token whose logits are not all finite (damaged
        weights: their argmax is token 0 every step)."""
        first = [i for i, (seq, extra) in enumerate(row_seqs) if not seq.output_token_ids and not extra]
        if not first:
            return []
        bad = (~logits[first].isfinite().all(dim=-1)).tolist()
        return [i for i, b in zip(first, bad) if b]

    # -- chained decode steps --------------------------------------------------------------
    def _chains(self, batch: list[ScheduledSeq]) -> bool:
        """Whether this step's successors may be launched before its tokens are read: a plain
        decode step (a token a sequence, every one sampling; no drafts, no forks to start) of
        sequences whose next tokens need nothing but the logits (no logprobs, penalties,
        constraint or prompt rows)."""
        if not self.chain_steps or self.speculator is not None:
            return False
        for item in batch:
            seq, p = item.seq, item.seq.params
            if item.num_tokens != 1 or item.drafts or seq.forks or seq.needs_prompt_rows or seq.matcher is not None:
                return False
            if p.logprobs is not None or sampler.penalizes(p) or seq.bad_words_ids:  # (bad words read the tokens drawn before)
                return False
        return True

    def _read_chained(self, step: _Launched) -> list[StepUpdate]:
        """Launch the step after `step` (chained), then read step's tokens: the device computes
        one step while the host reads, detokenizes and checks the other."""
        self.launched = self._launch_after(step)
        if all(seq.is_finished for seq in step.seqs):  # (ended or aborted since it was launched)
            return []
        updates = []
        for seq, position, tok in zip(step.seqs, step.positions, step.read()):
            if seq.is_finished:  # its row was wasted: it ended at the step before
                continue
            seq.num_cached = position + 1
            self.blocks.commit(seq)
            updates.append(self._append_token(seq, tok))
        return updates

    def _launch_after(self, step: _Launched) -> _Launched | None:
        """The next decode step of step's sequences, its ids step's samples (never read by the
        host first); None where the scheduler must choose the next step instead: requests waiting
        to start, a running sequence outside `step`, too few free blocks. A sequence whose token in
        `step` surely ends it (its length limits) has no row; one that ends otherwise (an end
        token, a stop string) wastes its row, which is then skipped when read."""
        if self.scheduler.waiting:
            return None
        rows = [i for i, seq in enumerate(step.seqs) if not seq.is_finished]
        if {id(seq) for seq in self.scheduler.running} - {id(step.seqs[i]) for i in rows}:
            return None
        # (step's token is the sequence's output token number len + 1, at position + 1 of the context)
        rows = [i for i in rows if len(step.seqs[i].output_token_ids) + 1 < step.seqs[i].params.max_tokens
                and step.positions[i] + 2 < self.max_model_len]
        seqs, positions = [step.seqs[i] for i in rows], [step.positions[i] + 1 for i in rows]
        if not rows or not all(self.blocks.reserve(seq, p + 1) for seq, p in zip(seqs, positions)):
            return None
        logits = self.runner.execute_chained(decode_inputs(seqs, positions, self.kv_cache.block_size), step.tokens, rows)
        tokens = sampler.token_tensor(logits, seqs, self.eos_token_ids, ahead=1)
        return _Launched(seqs, positions, tokens, self.backend.tokens_later(tokens))

    def _propose(self) -> None:
        """Drafts for the running sequences that decode next step: as many as the proposer's k,
        the tokens the request may still emit and the context allow, cut after an end token (if it
        holds, the sequence stops there), and under structured output at the first token its
        constraint refuses (that row would emit the model's own token anyway)."""
        seqs, limits = [], []
        for seq in self.scheduler.running:
            if seq.num_cached + 1 != seq.num_tokens:
                continue
            seqs.append(seq)
            limits.append(min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1)
        self.speculator.propose(seqs, limits)
        for seq in seqs:
            drafts = seq.draft_token_ids
            if not drafts:
                continue
            if not seq.params.ignore_eos or seq.params.stop_token_ids:  # nothing follows an accepted end: no rows after it
                ends = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_token_ids)
                cut = next((i + 1 for i, t in enumerate(drafts) if t in ends), len(drafts))
                del drafts[cut:]
            if seq.matcher is not None:
                del drafts[self.structured.valid_drafts(seq.matcher, drafts) :]

    def _add_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Logprob of each prompt token given the ones before it (None for the first)."""
        if start == 0:
            seq.prompt_logprobs = [None]
        lp = torch.log_softmax(logits, dim=-1)
        prompt = seq.prompt_token_ids
        for i in range(logits.shape[0]):
            nxt = start + i + 1
            if nxt < len(prompt):
                seq.prompt_logprobs.append(self._top_logprobs(lp[i], prompt[nxt], seq.params.prompt_logprobs, seq.params.detokenize))

    def _append_token(self, seq: Sequence, tok: int, logprobs: dict[int, float] | None = None) -> StepUpdate:
        seq.output_token_ids.append(tok)
        p = seq.params
        text_before = seq.text
        if seq.detokenizer:
            seq.text += seq.detokenizer.add(tok)
        reason = None
        if seq.matcher is not None:
            try:
                if self.structured.advance(seq.matcher, tok):
                    reason = "stop"  # the constraint is complete
            except FasterLlamaError as e:  # (this sequence's own failure: the step goes on for the others)
                return self._fail(seq, f"structured output failed at output token {len(seq.output_token_ids)}: {e}", tok, logprobs)
        if p.stop and seq.text:  # (also on the token that completes a constraint: the text still ends before a stop string)
            if len(seq.output_token_ids) >= p.min_tokens:
                reason = self._truncate_at_stop(seq) or reason
            else:  # no stop string before min_tokens (as vLLM): the text so far is not searched again
                seq.num_checked = len(seq.text)
        text_final = reason is not None and isinstance(seq.stop_reason, str)  # (cut before a stop string)
        if not text_final:  # (an ending token that completes a constraint ends the output as one: its text dropped)
            if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                reason = "stop"
                seq.stop_reason = tok if tok in p.stop_token_ids else None  # (vLLM's: the stop token id; None for EOS)
                if not p.include_stop_str_in_output:  # the ending token's text is not the output's (vLLM)
                    seq.text = text_before
                    if seq.detokenizer:  # (what the tokens before it held back: the text ends as decode ends it)
                        seq.detokenizer.drop_last()
                        seq.text += seq.detokenizer.flush()
                    text_final = True
            elif reason is None and (len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len):
                reason = "length"
        if reason is not None and seq.detokenizer and not text_final:
            seq.text += seq.detokenizer.flush()  # a last token inside a character: as decode shows it
        if reason is not None:
            self._finish(seq, reason)
            safe_end = len(seq.text)
        else:  # hold back a tail that may still grow into a stop string
            safe_end = len(seq.text) - stop_prefix_len(seq.text, p.stop)
        delta = seq.text[seq.num_emitted : safe_end]
        seq.num_emitted = max(seq.num_emitted, safe_end)
        return StepUpdate(seq, tok, delta, logprobs, reason)

    def _fail(self, seq: Sequence, error: str, tok: int = sampler.NO_TOKEN, logprobs: dict[int, Logprob] | None = None,
              request_error: bool = True) -> StepUpdate:
        """End a sequence with an error (the others in the step go on): its request's own, or the model's."""
        seq.error, seq.error_is_request = error, request_error
        self._finish(seq, "error")
        return StepUpdate(seq, tok, "", logprobs, "error")

    @staticmethod
    def _truncate_at_stop(seq: Sequence) -> str | None:
        """Cut seq.text before the first stop string (which may span tokens; after it with
        include_stop_str_in_output); "stop" if found, the string in seq.stop_reason."""
        longest = max(len(s) for s in seq.params.stop)
        found = find_stop(seq.text, seq.params.stop, max(0, seq.num_checked - longest + 1))
        seq.num_checked = len(seq.text)
        if found is None:
            return None
        seq.text = cut_at_stop(seq.text, *found, seq.params.include_stop_str_in_output)
        seq.stop_reason = found[1]
        return "stop"

    def _top_logprobs(self, row: torch.Tensor, tok: int, n: int, detokenize: bool = True) -> dict[int, Logprob]:
        """The token's log-probability and the top n's, each with its rank in the vocabulary and
        its text (vLLM's Logprob; no text under detokenize=False, as in vLLM)."""
        text = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None and detokenize else (lambda t: None)
        out = {tok: Logprob(float(row[tok]), int((row > row[tok]).sum()) + 1, text(tok))}
        if n:
            values, idx = row.topk(n)
            for rank, (v, i) in enumerate(zip(values.tolist(), idx.tolist()), start=1):
                if i != tok:
                    out[i] = Logprob(v, rank, text(i))
        return out

    # -- research / tests -------------------------------------------------------------------
    def compute_logits(self, token_ids: Seq[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] of every position of one sequence (no sampling)."""
        seq = self._run_alone(token_ids, keep_logits=True)
        return torch.cat(seq.prompt_logits)

    def run_prompt(self, token_ids: Seq[int]) -> None:
        """Run one sequence's tokens through the model, every position computed (nothing from the
        prefix cache), with the lm_head on the last row only: calibration's passes, whose hooks
        read what enters each linear (all rows' logits were ~20% of a pass of the default model)."""
        self._run_alone(token_ids, keep_logits=False)

    def _run_alone(self, token_ids: Seq[int], keep_logits: bool) -> Sequence:
        ids = self.check_token_ids(token_ids)
        if not ids:
            raise FasterLlamaError("a sequence needs at least one token")
        if len(ids) > self.max_model_len:
            raise ContextLengthError(f"{len(ids)} tokens exceed the context of {self.max_model_len}{self._context_origin()}")
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        seq = Sequence(ids, params, self.tokenizer, 0)
        seq.uncached_prompt = True
        if keep_logits:
            seq.prompt_logits = []  # the steps keep every prompt row's logits
        self.scheduler.add(seq)
        try:
            while not seq.is_finished:  # a request like any other: chunked, scheduled beside running ones
                self.step()
        finally:
            self.abort(seq)
        return seq
