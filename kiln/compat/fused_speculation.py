"""transformers-neuronx's ``FusedSpeculativeDecoder`` over kiln's speculative decoding
(:class:`kiln.runtime.speculative.SpeculativeDecoder`)::

    draft = NeuronAutoModelForCausalLM.from_pretrained(small, n_positions=256)
    target = NeuronAutoModelForCausalLM.from_pretrained(big, n_positions=256)
    draft.to_neuron(); target.to_neuron()
    fsd = FusedSpeculativeDecoder(draft, target, 4, eos_token_id=2)
    fsd.to_neuron()                        # adds the target's verify graph for k + 1 tokens
    ids = fsd.sample(input_ids, sequence_length=128)

As in transformers-neuronx: one sequence at a time, greedy (the target's own tokens),
the prompt and its continuation returned as ``[1, n]``, a ``streamer`` given the prompt,
then each token, then ``end()``. Unlike it, the draft and target run as two compiled
models taking turns on the host, not one fused graph; ``fsd.stats`` holds the last
``sample``'s acceptance rate. ``buckets=`` and ``output_scores=True`` are errors that say
kiln does not have them.
"""
from __future__ import annotations

import torch

from kiln.errors import CompilerArgsError, InputError


class FusedSpeculativeDecoder:
    def __init__(self, draft, target, k: int = 2, pad_token_id: int = 0, eos_token_id=None, buckets=None,
                 output_scores: bool = False):
        if not isinstance(k, int) or k < 1:
            raise CompilerArgsError(f"k must be a positive integer (draft tokens per round); got {k!r}")
        if buckets is not None:
            raise CompilerArgsError("buckets=: kiln compiles the target's verify graph for its one cache "
                                    "length (n_positions); leave buckets unset")
        if output_scores:
            raise CompilerArgsError("output_scores=True: kiln's speculative decoding does not return scores")
        if target.model.config.vocab_size != draft.model.config.vocab_size:
            raise CompilerArgsError(f"the target and draft models must have the same vocabulary; got "
                                    f"{target.model.config.vocab_size} and {draft.model.config.vocab_size} ids")
        self.draft, self.target, self.k = draft, target, k
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.speculator = None
        self.stats = None

    def to_neuron(self, workers=None):
        """Compile the draft if it is not yet, and the target with its verify graph."""
        from kiln.llm.build import add_verify
        from kiln.runtime.speculative import SpeculativeDecoder
        for model in (self.draft, self.target):
            if model.compiled is None:
                model.to_neuron()
        if self.target.compiled.meta.get("speculation_length") != self.k:
            self.target.compiled = add_verify(self.target.model, self.target.compiled, self.k)
        self.speculator = SpeculativeDecoder(self.target.compiled, self.draft.compiled)
        return self

    def sample(self, input_ids, attention_mask=None, sequence_length=None, streamer=None):
        """Prompt plus the target's greedy tokens up to ``sequence_length`` in all (default:
        ``n_positions - k``), stopping after ``eos_token_id``."""
        if self.speculator is None:
            raise InputError("call to_neuron() before sample(): the speculative decoder is not compiled yet")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InputError(f"speculative sampling takes one sequence ([1, n] input_ids); got "
                             f"{tuple(input_ids.shape)}")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise InputError("attention_mask with padding: speculative sampling takes one unpadded sequence")
        prompt = input_ids[0].tolist()
        if sequence_length is None:
            sequence_length = self.target.n_positions - self.k
        new = int(sequence_length) - len(prompt)
        if new < 1:
            raise InputError(f"sequence_length={sequence_length} leaves no room after the {len(prompt)}-token prompt")
        if streamer is not None:
            streamer.put(input_ids)
        stops = () if self.eos_token_id is None else (
            [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id))

        def on_token(token):
            if streamer is not None:
                streamer.put(torch.tensor([[token]]))
        tokens, self.stats = self.speculator.generate(prompt, new, stop_token_ids=stops, on_token=on_token)
        if streamer is not None:
            streamer.end()
        return torch.tensor([prompt + tokens])
