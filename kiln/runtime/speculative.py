"""Speculative decoding: a small draft model proposes ``k`` tokens one by one, the target
checks all of them in one pass, and every proposal up to the first it disagrees with is
kept, plus the target's own token there. Greedy output is the target's: each kept token
is one the target chose itself.

The target is an LLM compiled with ``speculation_length=k``: besides prefill and decode
it has a *verify* graph, the decode step for one sequence and ``k + 1`` new tokens (the
last accepted token and the ``k`` proposals), whose logits at each position say what
the target would choose after that prefix. The draft is any LLM artifact with the same
vocabulary and a one-row decode graph.

Each model keeps its own one-row KV cache (:class:`kiln.runtime.kv.KVCache`). After a
round the target's cache holds the accepted tokens' keys and values (from the verify
pass, written for those positions only) and the draft's cache is cut back to the
accepted prefix by its length alone: positions past a sequence's length are never read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.errors import InputError
from kiln.runtime.kv import KVCache
from kiln.runtime.sampling import greedy


@dataclass
class SpeculationStats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate}


def _one_row(shape) -> tuple:
    layers, _, heads, slots, dim = shape
    return (layers, 1, heads, slots, dim)


class SpeculativeDecoder:
    """``SpeculativeDecoder(target, draft).generate(prompt, max_new_tokens)`` → (tokens, stats)."""

    def __init__(self, target, draft):
        if target.verify is None:
            raise InputError("the target has no verify graph: compile it with speculation_length=k "
                             "(kiln llm compile --speculation-length k)")
        if 1 not in draft.decode:
            raise InputError(f"the draft needs a one-row decode graph; it has {sorted(draft.decode)}")
        if target.meta["vocab_size"] != draft.meta["vocab_size"]:
            raise InputError(f"the draft's vocabulary ({draft.meta['vocab_size']} ids) is not the target's "
                             f"({target.meta['vocab_size']})")
        self.target, self.draft = target, draft
        self.k = target.meta["speculation_length"]

    def __repr__(self) -> str:
        return f"SpeculativeDecoder(target={self.target!r}, draft={self.draft!r}, k={self.k})"

    def generate(self, prompt: list, max_new_tokens: int, stop_token_ids=(), on_token=None) -> tuple:
        """``(tokens, stats)``: the target's greedy continuation of ``prompt`` (ids), ending
        after a stop token or ``max_new_tokens``. ``on_token(token)`` is called for each
        token as it is accepted (streaming); returning True ends generation there (a stop
        string seen in the text)."""
        n, k, stops = len(prompt), self.k, set(stop_token_ids)
        room = min(self.target.meta["cache_shape"][3], self.draft.meta["cache_shape"][3])
        if not prompt or max_new_tokens < 1 or n + max_new_tokens + k > room:
            raise InputError(f"{n} prompt tokens + {max_new_tokens} new ones + {k} speculated must fit the "
                             f"caches ({room} positions), with at least one token each")
        target = KVCache(_one_row(self.target.meta["cache_shape"]))
        draft = KVCache(_one_row(self.draft.meta["cache_shape"]))
        stats = SpeculationStats()
        out, ended = [], False

        def emit(token):
            nonlocal ended
            out.append(token)
            stop_here = bool(on_token is not None and on_token(token))
            ended = stop_here or token in stops or len(out) >= max_new_tokens
        with torch.no_grad():
            emit(self._prefill(self.target, target, prompt))
            self._prefill(self.draft, draft, prompt)
            while not ended:
                context = prompt + out
                self._catch_up(draft, context)
                steps = min(k, max_new_tokens - len(out))
                proposal = self._propose(draft, context, steps)
                accepted, token = self._verify(target, context, proposal)
                draft.lengths[0] = len(context) + min(accepted, steps - 1)
                stats.rounds, stats.proposed, stats.accepted = (stats.rounds + 1, stats.proposed + steps,
                                                                stats.accepted + accepted)
                for t in proposal[:accepted] + [token]:
                    emit(t)
                    if ended:
                        break
        return out, stats

    @staticmethod
    def _prefill(llm, cache, prompt) -> int:
        n = len(prompt)
        logits, k, v = llm.prefill_for(n)(torch.tensor([prompt]), torch.arange(n).unsqueeze(0), torch.tensor([n - 1]))
        cache.write_slot(0, k[:, 0, :, :n], v[:, 0, :, :n])
        return int(greedy(logits[0, -1]))

    def _step(self, cache, token: int, position: int) -> int:
        logits, k, v = self.draft.decode[1](torch.tensor([[token]]), torch.tensor([[position]]), *cache.inputs(1))
        cache.write_slot(0, k[:, 0], v[:, 0])
        return int(greedy(logits[0, -1]))

    def _catch_up(self, cache, context):
        """Feed the draft the accepted tokens it has not seen (all but the last)."""
        while int(cache.lengths[0]) < len(context) - 1:
            p = int(cache.lengths[0])
            self._step(cache, context[p], p)

    def _propose(self, cache, context, steps) -> list:
        token, base, out = context[-1], len(context) - 1, []
        for i in range(steps):
            token = self._step(cache, token, base + i)
            out.append(token)
        return out

    def _verify(self, cache, context, proposal) -> tuple:
        """(proposals accepted, the target's token after them); the target's cache gains
        the keys and values of the last context token and the accepted proposals."""
        width = self.k + 1
        tokens = [context[-1]] + proposal + [0] * (width - 1 - len(proposal))     # padding comes last
        base = len(context) - 1
        logits, k, v = self.target.verify(torch.tensor([tokens]), torch.arange(base, base + width).unsqueeze(0),
                                          *cache.inputs(1))
        choice = greedy(logits[0]).tolist()
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == choice[accepted]:
            accepted += 1
        cache.write_slot(0, k[:, 0, :, :accepted + 1], v[:, 0, :, :accepted + 1])
        return accepted, choice[accepted]
