"""Beam search above the model runner: HF `generate(num_beams=W, do_sample=False)` semantics
(length_penalty, early_stopping True/False/"never") plus FasterTransformer's diversity_rate. A
beam ends as a sampled sequence does: at EOS (unless ignore_eos), a stop token id or a stop
string (its text cut before it), none of them before min_tokens' ending tokens.

Each beam is a sequence with a block table. The prompt is prefilled once, in beam 0, and the other
beams share its blocks; after every step a beam continued from another takes that beam's blocks
(`BlockManager.share`), so beams share everything they have in common and only a last, partial
block is copied, when a beam first writes into it. The beams of all prompts run as one packed
batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..sampling_params import SamplingParams
from .scheduler import ScheduledSeq
from .sequence import Sequence
from .stop_strings import cut_at_stop, find_stop

NEG = -1.0e9


@dataclass
class BeamHypothesis:
    token_ids: list[int]
    text: str
    stop_reason: int | str | None  # the stop string or stop token id that ended it
    cumulative_logprob: float  # sum of the tokens' log-probabilities
    score: float  # what beams are ranked by (cumulative logprob / length ** length_penalty)
    finish_reason: str


@dataclass
class _BeamState:
    prompt: list[int]
    seqs: list[Sequence]  # one per beam, each with its own slot
    max_length: int
    tokens: list[list[int]] = field(default_factory=list)  # running beams' generated tokens
    scores: torch.Tensor | None = None  # running beams' ranking scores [W]
    logprobs: list[float] = field(default_factory=list)  # running beams' true cumulative logprobs
    real: list[bool] = field(default_factory=list)  # running beams that continue the prompt (not the first step's padding)
    finished: list[tuple[float, float, list[int], str]] = field(default_factory=list)  # (score, cum lp, tokens, finish reason)
    improvable: bool = True
    done: bool = False


class BeamSearch:
    def __init__(self, engine) -> None:
        self.engine = engine

    def run(self, prompts: list[list[int]], params: SamplingParams) -> list[list[BeamHypothesis]]:
        """The best hypotheses of each prompt; as many prompts at a time as the free blocks hold
        at their longest: the prompt's full blocks once, each beam's own blocks W times (its copy
        of the prompt's partial last block among them: the last of the W beams to write it keeps
        the original)."""
        blocks, W = self.engine.blocks, params.beam_width
        results: list[list[BeamHypothesis]] = []
        group: list[list[int]] = []
        budget = blocks.num_free
        for prompt in prompts:
            max_length = min(len(prompt) + params.max_tokens, self.engine.max_model_len)
            full = len(prompt) // blocks.block_size
            need = full + W * (blocks.blocks_for(max_length) - full)
            if need > blocks.num_free:
                from ..errors import FasterLlamaError

                raise FasterLlamaError(f"beam search of width {W} may need {need} KV cache blocks for this prompt; {blocks.num_free} are free "
                                       "(raise kv_cache_memory, or lower max_tokens or beam_width)")
            if need > budget:
                results += self._run_group(group, params)
                group, budget = [], blocks.num_free
            group.append(prompt)
            budget -= need
        if group:
            results += self._run_group(group, params)
        return results

    def _run_group(self, prompts: list[list[int]], params: SamplingParams) -> list[list[BeamHypothesis]]:
        engine, blocks, W = self.engine, self.engine.blocks, params.beam_width
        states = []
        for prompt in prompts:
            seqs = [Sequence(prompt, params, None, 0) for _ in range(W)]
            max_length = min(len(prompt) + params.max_tokens, engine.max_model_len)
            states.append(_BeamState(prompt, seqs, max_length, tokens=[[] for _ in range(W)],
                                     scores=torch.tensor([0.0] + [-math.inf] * (W - 1)), logprobs=[0.0] * W,
                                     real=[True] + [False] * (W - 1)))  # (beam 0 alone: -inf never outranks it, whatever diversity_rate takes off)
        try:
            first = True
            while True:
                active = [st for st in states if not st.done]
                if not active:
                    break
                if first:  # prefill each prompt once, in beam 0
                    batch = [ScheduledSeq(st.seqs[0], len(st.prompt)) for st in active]
                else:
                    batch = [ScheduledSeq(s, 1) for st in active for s in st.seqs]
                rows, offset = [], 0
                for item in batch:
                    if not blocks.reserve(item.seq, item.seq.num_cached + item.num_tokens):  # run() sized the groups to fit
                        raise RuntimeError("beam search ran out of KV cache blocks")
                    offset += item.num_tokens
                    rows.append(offset - 1)
                logits = engine.runner.execute(batch, rows)
                engine.scheduler.advance(batch)
                row = 0
                for st in active:
                    n = 1 if first else W
                    if first:  # the other beams share the prompt's blocks
                        blocks.share(st.seqs[1:], [st.seqs[0]] * (W - 1))
                    self._advance(st, logits[row : row + n].expand(W, -1), params)
                    row += n
                first = False
        finally:
            for st in states:
                for s in st.seqs:
                    blocks.free(s)
        out = []
        for st in states:
            ranked = sorted(st.finished, key=lambda f: -f[0])[: params.n]
            out.append([BeamHypothesis(t, *self._final_text(t, reason, params, st.prompt), cumulative_logprob=lp, score=sc, finish_reason=reason)
                        for sc, lp, t, reason in ranked])
        return out

    def _stop_at(self, tokens: list[int], p: SamplingParams, prompt: list[int]) -> tuple[str, int | None, str | None]:
        """A beam's text (as it follows the prompt), where its first stop string starts (None:
        nowhere) and which string, of those ending past min_tokens' first tokens, as a sampled
        sequence searches them."""
        text = self.engine.tokenizer.decode_continuation(tokens, prompt, p.skip_special_tokens)
        if not p.stop:
            return text, None, None
        start = 0
        if p.min_tokens > 1:
            head = self.engine.tokenizer.decode_continuation(tokens[: p.min_tokens - 1], prompt, p.skip_special_tokens)
            start = max(0, len(head) - max(map(len, p.stop)) + 1)
        at, stop = find_stop(text, p.stop, start) or (None, None)
        return text, at, stop

    def _final_text(self, tokens: list[int], reason: str, p: SamplingParams, prompt: list[int]) -> tuple[str, int | str | None]:
        """A hypothesis' text and stop_reason by a sampled sequence's rules (LLMEngine._append_token):
        cut before its stop string (after it with include_stop_str_in_output), its ending stop
        token's text left out (kept with include_stop_str_in_output); "" without detokenize."""
        if not p.detokenize:
            return "", tokens[-1] if reason == "stop" and tokens and tokens[-1] in p.stop_token_ids else None
        text, at, stop = self._stop_at(tokens, p, prompt)
        if reason == "stop" and at is not None:
            return cut_at_stop(text, at, stop, p.include_stop_str_in_output), stop
        last = tokens[-1] if tokens else None
        if reason == "stop" and (last in p.stop_token_ids or (not p.ignore_eos and last in self.engine.eos_token_ids)):
            if not p.include_stop_str_in_output:
                text = self.engine.tokenizer.decode_continuation(tokens[:-1], prompt, p.skip_special_tokens)
            return text, last if last in p.stop_token_ids else None
        return text, None

    def _advance(self, st: _BeamState, logits: torch.Tensor, p: SamplingParams) -> None:
        """One beam step for one prompt (HF's top-k continuations / running / finished update)."""
        W, V = logits.shape
        ends = (set() if p.ignore_eos else set(self.engine.eos_token_ids)) | set(p.stop_token_ids)
        K = max(2, 1 + len(ends)) * W
        prompt_len = len(st.prompt)
        cur_len = prompt_len + len(st.tokens[0])
        lp = torch.log_softmax(logits.float(), dim=-1)
        if cur_len - prompt_len < p.min_tokens:  # no ending token before min_tokens, as the sampler bans them
            lp[:, [t for t in ends if t < V]] = NEG
        if p.diversity_rate:  # penalize each beam's r-th best continuation by rate * r
            top_lp, top_tok = lp.topk(min(K, V), dim=-1)
            ranked = top_lp - p.diversity_rate * torch.arange(top_lp.shape[1], dtype=lp.dtype)
            cand_scores, flat = (ranked + st.scores[:, None]).reshape(-1).topk(K)
            beam = flat // top_lp.shape[1]
            token = top_tok.reshape(-1)[flat]
            true_lp = top_lp.reshape(-1)[flat]
        else:
            cand_scores, flat = (lp + st.scores[:, None]).reshape(-1).topk(K)
            beam, token = flat // V, flat % V
            true_lp = lp.reshape(-1)[flat]
        beam_l, token_l, true_l = beam.tolist(), token.tolist(), true_lp.tolist()
        new_len = cur_len + 1
        strings = p.stop and new_len - prompt_len >= p.min_tokens  # (stop strings count from min_tokens on, as in sampling)
        reasons = [("stop" if t in ends or (strings and self._stop_at(st.tokens[b] + [t], p, st.prompt)[2] is not None) else "length" if new_len >= st.max_length else None)
                   for b, t in zip(beam_l, token_l)]
        hits = torch.tensor([r is not None for r in reasons])

        # finished hypotheses: only among the top W candidates, none continuing a padding beam (the
        # first step's, still running after it where W exceeds the candidates, or one that ended)
        real = [st.real[b] for b in beam_l]
        if st.improvable and not (p.early_stopping is True and len(st.finished) >= W):
            norm = (new_len - prompt_len) ** p.length_penalty
            for j in range(W):
                if hits[j] and real[j]:
                    b = beam_l[j]
                    st.finished.append((float(cand_scores[j]) / norm, st.logprobs[b] + true_l[j], st.tokens[b] + [token_l[j]], reasons[j]))
            st.finished = sorted(st.finished, key=lambda f: -f[0])[:W]

        # running beams for the next step: best W candidates that did not finish
        running = (cand_scores + hits.float() * NEG).topk(W)
        pick = running.indices.tolist()
        src_beams = [beam_l[j] for j in pick]
        new_tokens = [st.tokens[beam_l[j]] + [token_l[j]] for j in pick]
        new_logprobs = [st.logprobs[beam_l[j]] + true_l[j] for j in pick]
        if src_beams != list(range(W)):  # beams continued from others take their blocks
            self.engine.blocks.share(st.seqs, [st.seqs[b] for b in src_beams])
        st.tokens, st.logprobs, st.scores, st.real = new_tokens, new_logprobs, running.values, [real[j] and not hits[j] for j in pick]
        for s, t in zip(st.seqs, new_tokens):
            s.output_token_ids = t

        # stopping: can running beams still beat the worst kept hypothesis?
        if p.early_stopping == "never" and p.length_penalty > 0:
            best_len = st.max_length - prompt_len
        else:
            best_len = new_len - prompt_len
        best_possible = float(st.scores[0]) / (best_len**p.length_penalty)
        all_finished = len(st.finished) >= W
        worst = min(f[0] for f in st.finished) if all_finished else NEG
        st.improvable = st.improvable and (not all_finished or best_possible > worst)
        open_beam = not (all_finished and p.early_stopping is True)
        st.done = not (st.improvable and open_beam and not bool(hits.all())) or new_len >= st.max_length

