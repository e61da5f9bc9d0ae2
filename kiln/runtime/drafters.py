"""Where speculative decoding's proposals come from (:mod:`kiln.runtime.spec_step`).

* :class:`NgramDrafter` (prompt lookup): the last ``n`` tokens of a request's prompt and
  output, for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min`` (vLLM's
  settings of those names), are looked up among its earlier tokens, and what followed
  their latest earlier occurrence is proposed. No second model: it pays off where the
  output quotes its input (summaries, code edits, extraction) and costs a dictionary
  lookup per row otherwise.
* :class:`ModelDrafter`: a small compiled LLM with the same vocabulary, with a KV cache of
  its own whose rows are the target's slots. Each step it catches up on the tokens a row
  gained since it last ran (normally the target's own token after the proposals it
  kept), then proposes greedily, one batched decode call per token for all rows.

Proposals only decide how many tokens a verify call yields, never which: the output is
the target's whatever a drafter proposes.
"""
from __future__ import annotations

import logging
import weakref

import torch

from kiln.errors import InputError
from kiln.runtime.kv import KVCache
from kiln.runtime.sampling import greedy


class NgramDrafter:
    """Prompt-lookup proposals (module doc); an index per request, extended as it grows."""

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 2):
        if not 1 <= int(prompt_lookup_min) <= int(prompt_lookup_max):
            raise InputError(f"n-gram drafting needs 1 <= prompt_lookup_min <= prompt_lookup_max; got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.max_n, self.min_n = int(prompt_lookup_max), int(prompt_lookup_min)
        self._index = weakref.WeakKeyDictionary()    # request -> (ends indexed, {ngram: latest end})

    def __repr__(self) -> str:
        return f"NgramDrafter(prompt_lookup_max={self.max_n}, prompt_lookup_min={self.min_n})"

    def propose(self, running, budgets) -> dict:
        return {slot: self.lookup(r.prompt + r.tokens, budgets[slot], r) for slot, r in running if budgets[slot]}

    def lookup(self, context: list, budget: int, key=None) -> list:
        """Up to ``budget`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``context`` (``max_n`` down to ``min_n`` tokens) found; [] when none is.
        ``key`` (the request) keeps the index between calls."""
        done, table = self._index.get(key, (0, {})) if key is not None else (0, {})
        end = len(context)
        for e in range(max(done, 1), end):          # every n-gram ending before the suffix's end
            for n in range(self.min_n, min(self.max_n, e) + 1):
                table[tuple(context[e - n:e])] = e
        if key is not None:
            self._index[key] = (max(done, end), table)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            at = table.get(tuple(context[end - n:]))
            if at is not None:
                return context[at:at + budget]
        return []

    def warm(self) -> int:
        return 0


class ModelDrafter:
    """A draft LLM's greedy proposals (module doc). ``rows``: the target's cache rows
    (slots); the draft needs at least as many (its ``batch_size``)."""

    def __init__(self, draft, target_meta: dict):
        meta = draft.meta
        if meta["vocab_size"] != target_meta["vocab_size"]:
            raise InputError(f"the draft's vocabulary ({meta['vocab_size']} ids) is not the target's "
                             f"({target_meta['vocab_size']}): a draft must share the target's tokenizer")
        rows = target_meta["cache_shape"][1]
        if meta["cache_shape"][1] < rows:
            raise InputError(f"the draft's KV cache has {meta['cache_shape'][1]} rows and the target runs {rows} "
                             f"requests at once: compile the draft with --batch-size {rows}")
        self.draft = draft
        self.decode = dict(sorted(draft.decode.items()))
        self.cache = KVCache(tuple(meta["cache_shape"]))
        self.owner: list = [None] * meta["cache_shape"][1]   # the request each draft row holds
        self.calls = 0
        self._told = False              # warned that a context was too long for the draft

    def __repr__(self) -> str:
        return f"ModelDrafter({self.draft!r})"

    def propose(self, running, budgets) -> dict:
        self._follow(running)
        room = self.cache.capacity
        feed, out = {}, {}
        for slot, r in running:
            context = r.prompt + r.tokens
            budget = min(budgets[slot], room - len(context) + 1)
            if budget < 1 or self.owner[slot] is not r:
                continue
            have = self._common(slot, context)
            feed[slot], out[slot] = (context[have:], budget), []
        while feed:
            self._call(feed, out)
        return out

    def _follow(self, running):
        """Keep the draft's rows on the target's: a request moved to a lower slot moves in
        the draft's cache too; one the draft has not seen is prefilled (its context but the
        last token) when a draft context bucket holds it."""
        where = {id(r): s for s, r in enumerate(self.owner) if r is not None}
        for slot, r in running:
            if self.owner[slot] is r:
                continue
            src = where.get(id(r))
            if src is not None and self.owner[src] is r:
                self.cache.move(src, slot)
                self.owner[src] = None
                self.owner[slot] = r
                continue
            self._prefill(slot, r)

    def _prefill(self, slot, request):
        context = request.prompt + request.tokens
        n = len(context) - 1
        self.owner[slot] = None
        self.cache.reset(slot)
        if n < 1 or n > self.draft.max_context or n >= self.cache.capacity:
            if n > self.draft.max_context and not self._told:     # else a speed-up silently lost
                self._told = True
                logging.getLogger("kiln").warning(
                    "kiln speculative decoding: a request's context (%d tokens) is longer than the draft's largest "
                    "context bucket (%d), so it decodes without proposals (the answer is the same); compile the "
                    "draft with a context bucket that holds your prompts", n, self.draft.max_context)
            return                       # no proposals for this request: the target decodes alone
        with torch.no_grad():
            _, k, v = self.draft.prefill_for(n)(torch.tensor([context[:n]]), torch.arange(n).unsqueeze(0),
                                                torch.tensor([n - 1]))
        self.cache.write_slot(slot, k[:, 0, :, :n], v[:, 0, :, :n], context[:n])
        self.owner[slot] = request

    def _common(self, slot, context) -> int:
        """Cut row ``slot`` back to the longest prefix of ``context`` it holds (proposals the
        target rejected go); its length."""
        held = self.cache.held[slot]
        n = 0
        for a, b in zip(held, context):
            if a != b:
                break
            n += 1
        n = min(n, len(context) - 1)
        del held[n:]
        self.cache.lengths[slot] = n
        return n

    def _call(self, feed, out):
        """One draft decode call: each row in ``feed`` takes its next token (context it has
        not seen, then its latest proposal); a row that has fed its last context token
        proposes the argmax after it, until it has its budget."""
        used = max(feed) + 1
        rows = next(b for b in self.decode if b >= used)
        tokens = torch.zeros(rows, 1, dtype=torch.int64)
        for slot, (queue, _) in feed.items():
            tokens[slot, 0] = queue[0]
        positions = self.cache.lengths[:rows].clamp(max=self.cache.capacity - 1).unsqueeze(1).clone()
        with torch.no_grad():
            logits, new_k, new_v = self.decode[rows](tokens, positions, *self.cache.inputs(rows))
        self.cache.parked(rows)
        self.calls += 1
        written = self.cache.written_by(self.decode[rows])
        for slot in list(feed):
            queue, budget = feed[slot]
            if written:
                self.cache.wrote_slot(slot, queue[0])
            else:
                self.cache.write_slot(slot, new_k[:, slot, :, :1], new_v[:, slot, :, :1], queue[:1])
            del queue[0]
            if queue:
                continue
            out[slot].append(int(greedy(logits[slot, -1])))
            if len(out[slot]) >= budget:
                del feed[slot]
            else:
                queue.append(out[slot][-1])

    def warm(self) -> int:
        return self.draft.warm_graphs()


def drafter_for(target, draft, prompt_lookup_max: int = 4, prompt_lookup_min: int = 2):
    """The drafter ``draft`` names: ``"ngram"``, a draft LLM, or a drafter."""
    if isinstance(draft, str) and draft == "ngram":
        return NgramDrafter(prompt_lookup_max, prompt_lookup_min)
    if hasattr(draft, "propose"):
        return draft
    if not hasattr(draft, "decode") or not hasattr(draft, "prefill_for"):
        raise InputError(f"draft= takes 'ngram', a loaded LLM with the target's vocabulary (kiln.load(path)), "
                         f"or a drafter; got {draft!r}")
    return ModelDrafter(draft, target.meta)
