"""lm-eval's ``LM`` for a causal LM held in memory (the optional ``eval`` extra: importing this module needs
lm-evaluation-harness; ``quantdyn.evaluate.lm_eval_tasks.make_lm`` gives a one-line error without it).

:class:`QuantdynLM` evaluates quantdyn's GPT, a fake-quantized copy or any HF causal LM without saving it:
``loglikelihood`` scores continuations in batches (contexts truncated from the left to the model's maximum
length), ``loglikelihood_rolling`` follows lm-eval's disjoint rolling windows, ``generate_until`` decodes
greedily in batches until a stop string or ``max_gen_toks``. Its per-request log-likelihoods equal lm-eval's
own HFLM's (tests/test_crosscheck_lmeval.py).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from quantdyn.errors import QuantdynError
from quantdyn.evaluate.loss import model_device
from quantdyn.models.gpt import GPT, logits_of


def max_length_of(model: nn.Module, tokenizer=None, default: int = 2048) -> int:
    """Longest sequence the model takes: quantdyn max_seq_len, else HF position limits, else ``default``."""
    if isinstance(model, GPT):
        return int(model.config.max_seq_len)
    cfg = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    v = getattr(tokenizer, "model_max_length", None)
    if isinstance(v, int) and 0 < v < 1_000_000:
        return v
    return default


class QuantdynLM(TemplateLM):
    """lm-eval ``LM`` for a causal LM held in memory (quantdyn GPT, fake-quantized copy or HF model).

    Token ids come from ``tokenizer`` without special tokens; an empty
    context is conditioned on the EOS token (quantdyn's document separator).
    Requests are sorted by length and run ``batch_size`` at a time, padded
    on the right (causal attention: padding after a position never
    changes it).  Contexts longer than ``max_length`` lose tokens on the left.
    """

    def __init__(self, model: nn.Module, tokenizer, *, batch_size: int = 16, max_length: int | None = None,
                 max_gen_toks: int = 256, progress: bool = False):
        super().__init__()
        if tokenizer is None:
            raise QuantdynError("QuantdynLM needs the model's tokenizer (pass tokenizer=...)")
        eos = tokenizer.eos_token_id
        if eos is None:
            raise QuantdynError("the tokenizer has no EOS token; lm-eval needs one to condition empty contexts")
        if batch_size < 1:
            raise QuantdynError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        self._max_length = int(max_length or max_length_of(model, tokenizer))
        self.max_gen_toks = int(max_gen_toks)
        self.progress = progress
        self._eos = int(eos)
        self._device = model_device(model)
        # a multiple-choice context is encoded once per choice: cache recent strings
        self._encode = functools.lru_cache(maxsize=8192)(self._encode_uncached)

    # -- what TemplateLM asks for
    @property
    def eot_token_id(self) -> int:
        return self._eos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "quantdyn").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens:
            return self.tokenizer(string, add_special_tokens=True)["input_ids"]
        return list(self._encode(string))

    def _encode_uncached(self, string: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(string, add_special_tokens=False)["input_ids"])

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # -- scoring
    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Log-softmax (len_i - 1, V) of each token row, in one right-padded forward."""
        T = max(len(r) for r in rows) - 1  # the last token of a row is only a target
        x = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, : len(r) - 1] = torch.tensor(r[:-1], dtype=torch.long)
        logits = logits_of(self.model, x.to(self._device)).float()  # (B, T, V)
        return [F.log_softmax(logits[i, : len(r) - 1], dim=-1) for i, r in enumerate(rows)]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) | None, context_ids, continuation_ids) -> (logprob, is_greedy)."""
        from tqdm import tqdm

        L = self.max_length
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        bar = tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm or not self.progress)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            rows, n_cont = [], []
            for i in idx:
                _, ctx, cont = requests[i]
                if not cont:
                    raise QuantdynError("lm-eval asked for the likelihood of an empty continuation")
                if len(cont) > L:
                    raise QuantdynError(
                        f"a task continuation of {len(cont)} tokens does not fit the model's {L}-token context; "
                        "evaluate a model with a longer max_seq_len or pick tasks with shorter answers")
                rows.append((list(ctx) + list(cont))[-(L + 1):])  # left-truncate to L inputs + 1 target
                n_cont.append(len(cont))
            for i, row, k, lp in zip(idx, rows, n_cont, self._logprobs(rows)):
                # inputs row[:-1] predict row[1:]; the continuation is the last k targets
                target = torch.tensor(row[-k:], dtype=torch.long, device=lp.device)
                lp_cont = lp[-k:]
                ll = float(lp_cont.gather(1, target[:, None]).sum())
                greedy = bool((lp_cont.argmax(dim=-1) == target).all())
                out[i] = (ll, greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], (ll, greedy))
            bar.update(len(idx))
        bar.close()
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each text, in lm-eval's disjoint rolling windows of max_length."""
        windows, owner = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[k] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # -- generation
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy decoding, batched; stops at any ``until`` string (cut there), EOS or ``max_gen_toks``."""
        out: list[str | None] = [None] * len(requests)
        jobs = []
        for i, req in enumerate(requests):
            context, kw = req.args
            kw = dict(kw or {})
            if kw.pop("do_sample", False) and float(kw.get("temperature", 1.0) or 0.0) > 0.0:
                raise QuantdynError("the quantdyn lm-eval adapter decodes greedily; the task asks for sampling "
                                    "(do_sample=True) — run it with --backend hf")
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tok_decode([self._eos])
            if eos_text and eos_text not in until:
                until.append(eos_text)
            max_new = int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", self.max_gen_toks)))
            max_new = max(1, min(max_new, self.max_length - 1))
            ctx = self.tok_encode(context) or [self.prefix_token_id]
            ctx = ctx[-(self.max_length - max_new):]  # left-truncate so context + generation fit
            jobs.append((i, ctx, until, max_new))
        jobs.sort(key=lambda j: -len(j[1]))
        for start in range(0, len(jobs), self.batch_size):
            for i, text in self._greedy_batch(jobs[start : start + self.batch_size]):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]

    def _greedy_batch(self, jobs) -> list[tuple[int, str]]:
        B = len(jobs)
        lengths = [len(c) for _, c, _, _ in jobs]
        budget = max(len(c) + m for _, c, _, m in jobs)
        buf = torch.zeros(B, budget, dtype=torch.long)
        for b, (_, ctx, _, _) in enumerate(jobs):
            buf[b, : len(ctx)] = torch.tensor(ctx, dtype=torch.long)
        generated: list[list[int]] = [[] for _ in jobs]
        texts = [""] * B
        active = set(range(B))
        while active:
            T = max(lengths[b] for b in active)
            rows = sorted(active)
            logits = logits_of(self.model, buf[rows, :T].to(self._device))  # (b, T, V), right-padded
            for r, b in enumerate(rows):
                tok = int(logits[r, lengths[b] - 1].argmax())
                buf[b, lengths[b]] = tok
                lengths[b] += 1
                generated[b].append(tok)
                texts[b] = self.tok_decode(generated[b])
                _, _, until, max_new = jobs[b]
                if any(s in texts[b] for s in until) or len(generated[b]) >= max_new:
                    active.discard(b)
        results = []
        for b, (i, _, until, _) in enumerate(jobs):
            text = texts[b]
            for s in until:
                if s:
                    text = text.split(s)[0]
            results.append((i, text))
        return results
