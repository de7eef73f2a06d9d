"""An lm-eval `LM` over the native model: every lm-eval task runs on what training wrote.

`NativeLM` scores and generates the way lm-eval's Hugging Face backend (`hf`) does, so the two give
the same numbers on a checkpoint and on its export: the same tokenization (a string that starts
with BOS is not given a second one), the same left truncation to the context length, the same
rolling windows for perplexity, and generation (greedy unless the task samples) cut at the task's stop strings and EOS
(`nemotron_recipe.generation.generate`, with its cache of Mamba and attention state).
Scoring runs in batches of `batch_size` sequences, right-padded: the model is causal, so padding
after a sequence never changes its log-probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from nemotron_recipe.generation import GenerationConfig, generate

Scored = tuple[tuple[str, str] | None, list[int], list[int]]  # (request strings, context ids, continuation ids)


class NativeLM(TemplateLM):
    """lm-eval's view of a `NemotronHForCausalLM` (full, LoRA or loaded from a Hugging Face directory)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 8, max_length: int = 4096,
                 max_gen_toks: int = 256) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1. Fix: e.g. --batch-size 8.")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size, self.max_length, self.max_gen_toks = batch_size, max_length, max_gen_toks
        self._device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False  # the text brings its own BOS
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        ids = self.tokenizer.encode(string, **kwargs)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Scored], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request."""
        # Longest first, so each batch's width is its first row's and memory peaks at once.
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood")
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            # The last token is only ever predicted; inputs past the context length lose their start.
            inputs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in batch]
            logprobs = self._logprobs(inputs)
            for i, row, ids in zip(batch, logprobs, inputs, strict=True):
                cont = requests[i][2]
                scored = row[len(ids) - len(cont):len(ids)]
                target = torch.tensor(cont, device=scored.device)
                results[i] = (float(scored.gather(-1, target[:, None]).sum()), bool((scored.argmax(-1) == target).all()))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            bar.update(len(batch))
        bar.close()
        return results  # type: ignore[return-value]

    def _logprobs(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Log-softmax of the model's logits over a right-padded batch of token lists [b, width, vocab]."""
        width = max(len(ids) for ids in inputs)
        batch = torch.full((len(inputs), width), self.pad_id, dtype=torch.long)
        for row, ids in enumerate(inputs):
            batch[row, : len(ids)] = torch.tensor(ids)
        return F.log_softmax(self.model(batch.to(self._device)).logits.float(), dim=-1)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each string's whole log-likelihood, in disjoint windows of the context length (lm-eval's own
        windowing: every token is predicted once, with as much context as fits)."""
        windows: list[Scored] = []
        counts = []
        for (string,) in (r.args for r in requests):
            made = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows += [(None, *w) for w in made]
            counts.append(len(made))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, at = [], 0
        for request, n in zip(requests, counts, strict=True):
            total = sum(s for s, _ in scores[at:at + n])
            at += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return out

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations (greedy unless the task samples), each cut before the first of its stop strings (EOS
        among them)."""
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):  # one batch only holds requests with the same settings
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            config = _generation_config(kwargs, until, self.eot_token_id, self.batch_size)
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                texts = self._generate([requests[i].args[0] for i in batch], until, config)
                for i, text in zip(batch, texts, strict=True):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return results  # type: ignore[return-value]

    def _generate(self, contexts: list[str], until: list[str], config: GenerationConfig) -> list[str]:
        room = self.max_length - config.max_new_tokens
        if room <= 0:
            raise ValueError(f"max_gen_toks={config.max_new_tokens} leaves no room for a prompt in the context length "
                             f"{self.max_length}. Fix: lower max_gen_toks or raise --max-length.")
        prompts = [self.tok_encode(c, left_truncate_len=room) for c in contexts]
        # Texts decoded without special tokens and cut before the first stop string, as lm-eval's hf backend does.
        return [postprocess_generated_text(r.text, until, None)
                for r in generate(self.model, prompts, config, tokenizer=self.tokenizer)]


def _generation_config(kwargs: dict[str, Any], until: list[str], eos: int, batch_size: int) -> GenerationConfig:
    """lm-eval's normalized generation settings as `generate`'s: greedy unless `do_sample`, then its
    temperature, top_k and top_p (seeded, so a run repeats)."""
    sample = bool(kwargs.get("do_sample"))
    return GenerationConfig(
        max_new_tokens=int(kwargs["max_gen_toks"]), greedy=not sample, eos_token_ids=(eos,),
        stop_strings=tuple(s for s in until if s), batch_size=batch_size,
        temperature=float(kwargs.get("temperature") or 1.0) if sample else 1.0,
        top_k=int(kwargs.get("top_k") or 0) if sample else 0, top_p=float(kwargs.get("top_p") or 1.0) if sample else 1.0,
    )
