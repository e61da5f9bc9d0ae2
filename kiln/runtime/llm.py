"""A compiled LLM: prefill graphs per context bucket, a decode graph, and its metadata,
loaded from one ``.kiln`` artifact (kind ``llm``) without the model's code.

The artifact nests one compiled artifact per graph (``prefill/<width>.kiln``,
``decode/<slots>.kiln``) and, when it was compiled with one, the tokenizer's files
(``tokenizer/<name>``). The manifest's ``llm`` entry says what the graphs were built for:
``batch_size``, ``context_buckets``, ``cache_shape`` ``[L, B, H_kv, S, D]`` and the end-of-
sequence ids. Generation runs :func:`kiln.runtime.kv.generate` over the compiled graphs.
"""
from __future__ import annotations

from kiln.artifact.container import Artifact, wrapper_manifest
from kiln.errors import ArtifactError, InputError
from kiln.runtime import kv


class LLM:
    """``generate(prompts, max_new_tokens, params=...)``: continuations of token-id lists."""

    def __init__(self, prefill: dict, decode, meta: dict, tokenizer_files: dict, manifest: dict | None = None):
        self.prefill = dict(sorted(prefill.items()))     # context width -> compiled model
        self.decode = decode
        self.meta = meta
        self.tokenizer_files = tokenizer_files
        self.manifest = manifest or wrapper_manifest(
            "llm", decode.manifest, llm=meta,
            graphs={"prefill": {str(w): f"prefill/{w}.kiln" for w in self.prefill},
                    "decode": f"decode/{meta['cache_shape'][3]}.kiln"})

    @property
    def batch_size(self) -> int:
        return self.meta["batch_size"]

    @property
    def max_context(self) -> int:
        return max(self.prefill)

    def _prefill_for(self, width: int):
        for w, model in self.prefill.items():
            if width <= w:
                return kv.padded(model, w)
        raise InputError(f"a prompt of {width} tokens is longer than the largest context bucket "
                         f"({self.max_context}); compile with a larger context bucket")

    def generate(self, prompts: list, max_new_tokens: int, *, params=None, stop_at_eos: bool = True) -> list:
        """The continuation of each prompt (a list of token ids): greedy, or sampled per
        ``params`` (:class:`kiln.runtime.sampling.SamplingParams`); each ends after the
        model's end-of-sequence token (kept) unless ``stop_at_eos=False``, or after
        ``max_new_tokens``."""
        if not prompts or len(prompts) > self.batch_size:
            raise InputError(f"give 1 to {self.batch_size} prompts (the compiled batch size); got {len(prompts)}")
        if any(not p for p in prompts):
            raise InputError("every prompt needs at least one token")
        width = max(len(p) for p in prompts)
        slots = self.meta["cache_shape"][3]
        if width + max_new_tokens > slots:
            raise InputError(f"{width} prompt tokens + {max_new_tokens} new ones exceed the compiled "
                             f"cache of {slots} positions")
        rows = list(prompts) + [prompts[0]] * (self.batch_size - len(prompts))   # real rows, no NaN
        eos = self.meta["eos_token_ids"] if stop_at_eos else ()
        out = kv.generate(self._prefill_for(width), self.decode, rows, max_new_tokens,
                          tuple(self.meta["cache_shape"]), params=params, eos_token_ids=eos)
        return out[:len(prompts)]

    def to_bytes(self) -> bytes:
        blobs = {f"prefill/{w}.kiln": m.to_bytes() for w, m in self.prefill.items()}
        blobs[self.manifest["graphs"]["decode"]] = self.decode.to_bytes()
        blobs.update({f"tokenizer/{name}": data for name, data in self.tokenizer_files.items()})
        return Artifact(self.manifest, blobs).to_bytes()

    def save(self, path) -> str:
        from kiln.atomic import write_atomic
        data = self.to_bytes()
        write_atomic(str(path), lambda out: out.write(data))
        return str(path)

    def __repr__(self):
        return (f"kiln.LLM({self.manifest.get('model_name')}; batch {self.batch_size}, context buckets "
                f"{list(self.prefill)}, cache {self.meta['cache_shape'][3]} positions)")


def load_llm(art, opts, source, core=None, worker=None, load_nested=None) -> LLM:
    meta, graphs = art.manifest.get("llm"), art.manifest.get("graphs")
    if not isinstance(meta, dict) or not isinstance(graphs, dict) or "decode" not in graphs:
        raise ArtifactError(f"{source}: the LLM artifact's manifest lacks its 'llm'/'graphs' entries; "
                            "the file is corrupt or was edited")

    def nested(name):
        return load_nested(art.nested(name, f"{source}:{name}"), opts, f"{source}:{name}")

    prefill = {int(w): nested(name) for w, name in graphs.get("prefill", {}).items()}
    if not prefill:
        raise ArtifactError(f"{source}: the LLM artifact has no prefill graph")
    tokenizer = {name[len("tokenizer/"):]: bytes(data) for name, data in art.blobs.items()
                 if name.startswith("tokenizer/")}
    return LLM(prefill, nested(graphs["decode"]), meta, tokenizer, art.manifest)

