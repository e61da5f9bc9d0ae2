"""Speculative decoding inside continuous batching: one *verify* call checks every running
row's proposals at once, each row at its own cache position, and each row keeps its own
number of them.

A drafter (:mod:`kiln.runtime.drafters`: a small draft model, or n-gram lookup in the
request's own text) proposes up to ``k`` tokens per running row. The target's verify
graph for ``b`` rows is its decode step at ``[b, k + 1]``: row ``r`` gets its last token
and its proposals at positions ``p_r .. p_r + k`` (``p_r``: the row's cache length), its
own valid cache slots, and returns the logits after each prefix. Rows of one call are
independent (attention is masked per row), so they need not be at the same position.

Which proposals a row keeps is decided token by token with the scheduler's own choice
(:meth:`~kiln.runtime.scheduler.Scheduler.append_token`): the token at position ``i`` is
chosen from the logits after the last token and proposals ``0 .. i - 1``, exactly as a
decode step would choose it after those tokens; while it equals proposal ``i`` the next
position's logits are valid too, so the loop goes on; at the first difference it stops,
having emitted the target's own token there. Greedy output is the target's alone. A
*sampled* request draws each token from the target's distribution after the tokens
actually emitted, one draw from its own generator per token as without speculation, so
its output has exactly the target's distribution and a seed gives the same tokens (the
price: a proposal is kept only when the draw equals it, ``p(x)`` rather than speculative
sampling's ``min(1, p(x)/q(x))``, so sampled rows accept less). Stop tokens, stop
strings, logprobs (each token's own logits row) and ``max_new_tokens`` apply per token as
they do in a decode step. Only the accepted tokens' keys and values are written into the
row's cache; a row never gets more proposals than ``max_new_tokens`` leaves room for
(``k_r <= remaining - 1``), which also keeps every position inside the cache.

When no row has a proposal, the step is a plain decode step (cheaper than verifying
``k + 1`` positions). Rows still prefilling ride along, as in decode.
"""
from __future__ import annotations

import torch

from kiln.errors import InputError


class SpeculativeStep:
    """The scheduler's decode step with speculation (module doc). ``verify``: ``{rows: graph}``
    (a graph for ``rows`` rows of ``k + 1`` tokens); without one covering the occupied rows
    (an artifact from before batched verify graphs), each row is verified alone through the
    one-row graph. ``drafter``: an object with ``propose(running, budgets)`` -> ``{slot:
    [ids]}`` (``running``: ``[(slot, request)]``; ``budgets``: ``{slot: most proposals}``)
    and ``warm()`` -> graph calls made."""

    def __init__(self, verify: dict, k: int, drafter):
        if not verify:
            raise InputError("speculative decoding needs the target's verify graph: compile it with "
                             "speculation_length=k (kiln llm compile --speculation-length k)")
        self.verify = dict(sorted(verify.items()))
        self.k, self.drafter = int(k), drafter
        self.rounds = 0                   # verify calls
        self.plain_steps = 0              # steps without any proposal (a decode step ran)

    def __repr__(self) -> str:
        return f"SpeculativeStep(k={self.k}, drafter={self.drafter!r}, verify rows {list(self.verify)})"

    def budget(self, request) -> int:
        """Proposals ``request`` may take this step: the verify width, and one less than the
        tokens it may still generate (the target's own token after them is the last)."""
        return max(0, min(self.k, request.max_new_tokens - len(request.tokens) - 1))

    def step(self, sched):
        running = [(s, r) for s, r in enumerate(sched.slots) if r is not None and not r.prefilling]
        budgets = {s: self.budget(r) for s, r in running}
        proposals = self.drafter.propose(running, budgets) if any(budgets.values()) else {}
        proposals = {s: [int(t) for t in p[:budgets[s]]] for s, p in proposals.items() if p and budgets.get(s)}
        if not proposals:
            self.plain_steps += 1
            sched.decode_step()
            return
        used = max(s for s, r in enumerate(sched.slots) if r is not None) + 1
        tokens, positions = self._inputs(sched, used, running, proposals)
        try:
            with torch.no_grad():
                logits, new_k, new_v = self._verify(sched, used, tokens, positions, [s for s, _ in running])
        except Exception as e:  # noqa: BLE001 - every running request failed; the next ones may not
            for slot, r in running:
                r.error = e
                sched.free(slot, "error")
            return
        self.rounds += 1
        for slot, r in running:
            self._accept(sched, slot, r, proposals.get(slot, []), logits[slot], new_k[:, slot], new_v[:, slot])

    def _inputs(self, sched, used, running, proposals):
        """``[rows, k + 1]`` ids and positions: each running row's last token and proposals
        (padded on the right) from its own cache length on; other rows at their own
        length. Positions past the cache's end (padding only) repeat the last one, so a
        model with learned positions (GPT-2) never indexes past its table."""
        rows = self._rows(used) or used
        width = self.k + 1
        lengths = sched.cache.lengths[:rows].unsqueeze(1)
        positions = (lengths + torch.arange(width)).clamp(max=sched.cache.capacity - 1)
        tokens = torch.zeros(rows, width, dtype=torch.int64)
        for slot, r in running:
            row = [r.tokens[-1]] + proposals.get(slot, [])
            tokens[slot, :len(row)] = torch.tensor(row)
        return tokens, positions

    def _rows(self, used):
        return next((b for b in self.verify if b >= used), None)

    def _verify(self, sched, used, tokens, positions, slots):
        """The verify call for the first ``used`` rows, or one call per running row through
        the one-row graph when no graph covers them."""
        rows = self._rows(used)
        if rows is not None:
            return self.verify[rows](tokens, positions, *sched.cache.inputs(rows))
        parts = {slot: self.verify[1](tokens[slot:slot + 1], positions[slot:slot + 1], *sched.cache.row_inputs(slot))
                 for slot in slots}
        logits, k, v = next(iter(parts.values()))
        out = (logits.new_zeros(tokens.shape[0], *logits.shape[1:]),
               k.new_zeros(k.shape[0], tokens.shape[0], *k.shape[2:]),
               v.new_zeros(v.shape[0], tokens.shape[0], *v.shape[2:]))
        for slot, (logits, k, v) in parts.items():
            out[0][slot], out[1][:, slot], out[2][:, slot] = logits[0], k[:, 0], v[:, 0]
        return out

    def _accept(self, sched, slot, request, proposal, logits, new_k, new_v):
        """Emit the target's tokens for row ``slot`` (module doc), writing the keys and values
        of the last token and of each proposal kept, each before the token after it."""
        sched.cache.write_slot(slot, new_k[:, :, :1], new_v[:, :, :1], request.tokens[-1:])
        request.draft_proposed += len(proposal)
        sched.draft_proposed += len(proposal)
        for i in range(len(proposal) + 1):
            # a kept proposal is counted (by the scheduler, before the request's listener
            # hears of it) even when it ends the request (a stop token)
            token = sched.append_token(slot, request, logits[i:i + 1], proposal[i] if i < len(proposal) else None)
            if i == len(proposal) or token != proposal[i]:
                return
            if request.done:
                return
            sched.cache.write_slot(slot, new_k[:, :, i + 1:i + 2], new_v[:, :, i + 1:i + 2], [token])

    def warm(self, cache_shape) -> int:
        """Call each verify graph once on an empty cache (a graph's first call is its slowest)."""
        layers, _, heads, slots, dim = cache_shape
        width = self.k + 1
        with torch.no_grad():
            for rows, graph in self.verify.items():
                cache = [torch.zeros(rows, heads, slots, dim)] * (2 * layers)
                graph(torch.zeros(rows, width, dtype=torch.int64), torch.arange(width).repeat(rows, 1), *cache,
                      torch.zeros(rows, slots, dtype=torch.bool))
        return len(self.verify) + self.drafter.warm()
