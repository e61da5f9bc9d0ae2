"""A compiled LLM: prefill graphs per context bucket, decode graphs per batch size, their
metadata, loaded from one ``.kiln`` artifact (kind ``llm``) without the model's code.

The artifact nests one compiled artifact per graph (``prefill/<width>.kiln`` for each
context bucket, ``decode/<rows>.kiln`` for each decode batch size, ``verify/<k+1>.kiln``
(one row) and ``verify/<rows>x<k+1>.kiln`` (each larger decode batch size; artifacts
from before them have the one-row graph only) when compiled for speculative decoding,
``chunk/<width>.kiln`` for chunked prefill,
``window/<W>/decode/<rows>.kiln`` and ``window/<W>/chunk/<width>.kiln`` for each smaller
cache window, the sequence-length buckets) and, when it was compiled with one, the
tokenizer's files (``tokenizer/<name>``). The manifest's ``llm`` entry says what the
graphs were built for: ``format`` (2: prefill for one prompt, the cache one input per
layer), ``batch_size`` (requests generating at once), ``decode_batches``,
``context_buckets``, ``sequence_buckets``, ``cache_shape`` ``[L, B, H_kv, S, D]`` and
the end-of-sequence ids. An artifact without windows (from before them) runs every step
over the whole cache, as it did. Generation runs :mod:`kiln.runtime.scheduler` over the graphs.
"""
from __future__ import annotations

import collections
import numbers
import os
from concurrent.futures import ThreadPoolExecutor

from kiln.artifact.container import POOLED_FORMAT, Artifact, wrapper_manifest
from kiln.errors import ArtifactError, InputError
from kiln.runtime import cuda_llm, hf_settings, invariance, kv, ort_pool, sampling, value_checks
from kiln.runtime.scheduler import Scheduler, generate, run_all

FORMAT = 2          # the graphs' interface (module doc); load refuses others

def generate_args(prompts, max_new_tokens, params) -> tuple:
    """``generate``'s arguments checked (:mod:`kiln.runtime.value_checks`): the prompts as
    lists of ids, ``max_new_tokens`` an int, ``params`` a SamplingParams; or InputError."""
    return (value_checks.prompt_batch(prompts), value_checks.count(max_new_tokens, "max_new_tokens"),
            sampling.checked(params))


class LLM:
    """``generate(prompts, max_new_tokens, params=...)``: continuations of token-id lists."""

    def __init__(self, prefill: dict, decode: dict, meta: dict, tokenizer_files: dict, manifest: dict | None = None,
                 verify=None, chunk=None, windows=None):
        self.prefill = dict(sorted(prefill.items()))     # context width -> compiled model
        self.decode = dict(sorted(decode.items()))       # rows -> compiled model
        # speculative decoding's check: rows -> verify graph ({} without); a lone graph is one row's
        self.verify_steps = dict(sorted(verify.items())) if isinstance(verify, dict) else (
            {} if verify is None else {1: verify})
        self.verify = self.verify_steps.get(1)           # the single-stream decoder's graph (or None)
        self.chunk = chunk                               # chunked prefill's step (or None)
        # smaller cache windows (sequence-length buckets): window -> {"decode": {rows: model},
        # "chunk": model or None}; the full cache's graphs are decode and chunk above
        self.windows = dict(sorted((windows or {}).items()))
        self.meta = meta
        self.tokenizer_files = tokenizer_files
        self._invariance = None     # (decode, windows, report) once checked (kiln.runtime.invariance)
        self.agree = bool           # how a finding of the check becomes every rank's (tensor parallelism)
        graphs = {"prefill": {str(w): f"prefill/{w}.kiln" for w in self.prefill},
                  "decode": {str(b): f"decode/{b}.kiln" for b in self.decode}}
        width = (meta.get("speculation_length") or 0) + 1
        if self.verify is not None:
            graphs["verify"] = f"verify/{width}.kiln"
        if len(self.verify_steps) > (self.verify is not None):
            graphs["verify_rows"] = {str(b): f"verify/{b}x{width}.kiln" for b in self.verify_steps if b != 1}
        if chunk is not None:
            graphs["chunk"] = f"chunk/{meta['prefill_chunk']}.kiln"
        if self.windows:
            graphs["windows"] = {str(w): {"decode": {str(b): f"window/{w}/decode/{b}.kiln" for b in g["decode"]},
                                          **({"chunk": f"window/{w}/chunk/{meta['prefill_chunk']}.kiln"}
                                             if g.get("chunk") is not None else {})}
                                 for w, g in self.windows.items()}
        self.manifest = manifest or wrapper_manifest("llm", self.decode[max(self.decode)].manifest, llm=meta,
                                                     graphs=graphs)
        # the KV cache's buffers, kept between schedulers (kiln.runtime.kv.CacheMemory); on the
        # GPU when compiled for one (kiln.runtime.cuda_llm)
        self.cache_memory = kv.CacheMemory("cpu")
        if cuda_llm.is_cuda(self.decode[max(self.decode)]):
            cuda_llm.place(self)

    @property
    def batch_size(self) -> int:
        return self.meta["batch_size"]

    @property
    def max_context(self) -> int:
        return max(self.prefill)

    def prefill_for(self, width: int):
        for w, model in self.prefill.items():
            if width <= w:
                return kv.padded(model, w)
        raise InputError(f"a prompt of {width} tokens is longer than the largest context bucket "
                         f"({self.max_context}); compile with a larger context bucket")

    def scheduler(self, draft=None, prompt_lookup_max: int = 4, prompt_lookup_min: int = 2,
                  **options) -> Scheduler:
        """A continuous-batching :class:`~kiln.runtime.scheduler.Scheduler` over this model's
        graphs (``max_queue``, ``prefills_per_step``), with a KV cache of its own.
        ``draft``: speculative decoding (:mod:`kiln.runtime.spec_step`) with proposals from a
        draft LLM sharing this one's vocabulary, or ``"ngram"`` (prompt lookup,
        ``prompt_lookup_max`` / ``_min`` tokens); this model needs its verify graph
        (``speculation_length``). The cache then has no smaller sequence windows."""
        decode, windows = self._decode_plan()
        speculative = None
        if draft is not None:
            speculative, windows = self.speculative_step(draft, prompt_lookup_max, prompt_lookup_min), None
        with kv.placed(self.cache_memory):
            return Scheduler(self.prefill_for, decode, self.meta["cache_shape"], max_context=self.max_context,
                             chunk=self._chunk(), windows=windows, speculative=speculative, **options)

    def speculative_step(self, draft, prompt_lookup_max: int = 4, prompt_lookup_min: int = 2):
        """The scheduler's speculative step with ``draft``'s proposals (:meth:`scheduler`)."""
        from kiln.runtime.drafters import drafter_for
        from kiln.runtime.spec_step import SpeculativeStep
        if not self.verify_steps:
            raise InputError("speculative decoding needs the target's verify graph, which this artifact lacks: "
                             "compile it with speculation_length=k (kiln llm compile --speculation-length k)")
        drafter = drafter_for(self, draft, prompt_lookup_max, prompt_lookup_min)
        # verify graphs for the row counts whose decode graphs passed the batch-invariance
        # check (kiln.runtime.invariance): where a smaller graph computes a row differently,
        # a lone stream verifies through the larger one, as it decodes through it
        decode, _ = self._decode_plan()
        verify = {b: g for b, g in self.verify_steps.items() if b in decode} or self.verify_steps
        return SpeculativeStep(verify, self.meta["speculation_length"], drafter)

    @property
    def batch_invariance(self) -> dict:
        """What :mod:`kiln.runtime.invariance` found on this machine: ``invariant`` (every
        decode graph gives each row what it gives alone), ``decode_rows`` (the graphs
        used), ``dropped``, ``row_by_row``, ``probe_calls``, ``probe_seconds``."""
        self._decode_plan()
        return self._invariance[2]

    def decode_plan(self):
        """``(decode, windows)``: the graphs the scheduler may run (``_decode_plan``)."""
        return self._decode_plan()

    def chunk_step(self):
        """``(width, step)`` for chunked prefill, or None."""
        return self._chunk()

    def _decode_plan(self):
        """The decode graphs the scheduler runs, checked once per loaded model (the first
        scheduler or generation pays the check: one call per graph and row)."""
        if self._invariance is None:
            windows = {w: g["decode"] for w, g in self.windows.items()}
            self._invariance = invariance.plan(self.decode, windows, self.meta["cache_shape"], self.agree)
        decode, windows, _ = self._invariance
        return decode, {w: (windows[w], g.get("chunk")) for w, g in self.windows.items()}

    def _chunk(self):
        return None if self.chunk is None else (self.meta["prefill_chunk"], self.chunk)

    def warm_graphs(self) -> int:
        """Call every decode and chunk graph once on an empty cache (a graph's first call
        is its slowest), so no request pays for it; returns how many were called."""
        import torch
        layers, _, heads, slots, dim = self.meta["cache_shape"]
        calls = [(slots, rows, 1, g) for rows, g in self.decode.items()]
        calls += [(w, rows, 1, g) for w, wg in self.windows.items() for rows, g in wg["decode"].items()]
        width = self.meta.get("prefill_chunk")
        calls += [(slots, 1, width, self.chunk)] if self.chunk is not None else []
        calls += [(w, 1, width, wg["chunk"]) for w, wg in self.windows.items() if wg.get("chunk") is not None]
        with torch.no_grad():
            for window, rows, tokens, graph in calls:
                cache = [torch.zeros(rows, heads, window, dim)] * (2 * layers)
                graph(torch.zeros(rows, tokens, dtype=torch.int64), torch.arange(tokens).repeat(rows, 1), *cache,
                      torch.zeros(rows, window, dtype=torch.bool))
        return len(calls)

    def generate(self, prompts: list, max_new_tokens: int, *, params=None, stop_at_eos: bool = True,
                 draft=None) -> list:
        """The continuation of each prompt (a list of token ids, or a row of a 2-D integer
        tensor): greedy, or sampled per ``params`` (:class:`kiln.runtime.sampling.SamplingParams`);
        each ends after the model's end-of-sequence token (kept) unless ``stop_at_eos=False``,
        or after ``max_new_tokens`` (an integer). Any number of prompts: they run through
        the continuous-batching scheduler, ``batch_size`` at a time, each getting the tokens
        it would get alone. ``draft``: speculative decoding, as for :meth:`scheduler` (the
        same tokens). A flat list of ids is an error naming ``[[...]]``."""
        prompts, max_new_tokens, params = generate_args(prompts, max_new_tokens, params)
        eos = self.meta["eos_token_ids"] if stop_at_eos else ()
        if draft is not None:
            return run_all(self.scheduler(draft=draft), prompts, max_new_tokens, params, eos)
        return self._generate_rows(prompts, max_new_tokens, params, eos)

    def hf_generate(self, input_ids, attention_mask=None, generation_config=None, streamer=None,
                    checkpoint_defaults: bool = True, **overrides):
        """Hugging Face's ``generate`` for decoder-only models: ``[B, T]`` ids (left or right
        padded, ``attention_mask`` marking the real tokens) → ``[B, T + N]``, the input
        followed by each row's new tokens, rows that stopped early padded with
        ``pad_token_id``. Settings come from ``generation_config`` (a transformers
        ``GenerationConfig`` or anything with its attributes) and keyword overrides,
        with transformers' precedence (the checkpoint's generation config, recorded in
        ``meta["generation_config"]`` at compile, under the call's config under its
        keywords; then GenerationConfig's defaults: 20 new tokens when no length is set, as
        transformers 5 generates; ``eos_token_id=None`` given is no stop token;
        ``max_length`` counts the padded prompt; ``top_k=50`` when sampling, as there);
        settings kiln does not implement are errors, not ignored
        (:mod:`kiln.runtime.hf_settings`). ``streamer``: transformers' protocol
        (``TextStreamer``), one row only, as there: ``put`` the input ids, then each new
        token (shape ``[1]``) as the scheduler makes it, then ``end()``.
        ``checkpoint_defaults=False``: without the checkpoint's generation config
        (transformers-neuronx's ``sample()``)."""
        import torch
        ids = torch.as_tensor(input_ids)
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        if ids.dim() != 2 or mask.shape != ids.shape:
            raise InputError(f"input_ids must be [batch, tokens] with attention_mask of the same shape; got "
                             f"{tuple(ids.shape)} and {tuple(mask.shape)}")
        cfg, max_new_tokens = hf_settings.resolve(generation_config, overrides, ids.shape[1],
                                                  self.meta.get("generation_config") if checkpoint_defaults else None)
        prompts = [value_checks.token_ids(row[m.bool()]) for row, m in zip(ids, mask)]
        if any(not p for p in prompts):
            raise InputError("every row of attention_mask needs at least one real token")
        eos = cfg["eos_token_id"]
        if eos is None:     # eos_token_id=None given: no stop token, as in transformers
            eos = [] if cfg["eos_given"] else self.meta["eos_token_ids"]
        else:      # an int of Python's or NumPy's, or a list, tensor or array of them
            one = isinstance(eos, numbers.Integral) or (isinstance(eos, torch.Tensor) and eos.dim() == 0)
            eos = value_checks.token_ids([eos] if one else eos)
        params = hf_settings.sampling_params(cfg)
        if streamer is not None:
            if ids.shape[0] != 1:
                raise InputError(f"a streamer takes one sequence, as in transformers (whose TextStreamer only "
                                 f"supports batch size 1); input_ids has {ids.shape[0]} rows")
            rows = [self._streamed(ids, prompts[0], max_new_tokens, params, eos, streamer)]
        else:
            rows = self._generate_rows(prompts, max_new_tokens, params, eos)
        pad = cfg["pad_token_id"]
        pad = (eos[0] if eos else 0) if pad is None else value_checks.token_ids([pad])[0]
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=ids.dtype)
        return torch.cat([ids, new], dim=1)

    def _streamed(self, ids, prompt, max_new_tokens, params, eos, streamer) -> list:
        """One row's new tokens through a scheduler of its own, each handed to
        ``streamer`` as it is made (the same tokens as without it); ``end()`` follows the
        last, or an error. transformers' order: the input ids first."""
        import torch

        from kiln.runtime.scheduler import Request

        def on_token(_request, token) -> bool:
            streamer.put(torch.tensor([token], dtype=ids.dtype))
            return False                    # never ends the request: EOS and the length do

        scheduler = self.scheduler()
        request = Request(prompt, max_new_tokens, params, eos, on_token=on_token)
        scheduler.check(request)            # a request that cannot run streams nothing
        streamer.put(ids)
        try:
            scheduler.add(request)
            scheduler.run()
        finally:
            streamer.end()
        if request.error is not None:
            raise request.error
        return request.tokens

    def _generate_rows(self, prompts, max_new_tokens, params, eos):
        decode, windows = self._decode_plan()
        with kv.placed(self.cache_memory):
            return generate(self.prefill_for, decode, prompts, max_new_tokens, self.meta["cache_shape"],
                            params=params, eos_token_ids=eos, max_context=self.max_context, chunk=self._chunk(),
                            windows=windows)

    def to_bytes(self) -> bytes:
        return self._as_artifact().to_bytes()

    def _as_artifact(self) -> Artifact:
        """The LLM artifact: each graph's artifact a blob of it, and the tokenizer's files.
        The weights the graphs' ONNX Runtime partitions have in common are stored once
        (:mod:`kiln.runtime.ort_pool`): SmolLM2 int4's two decode graphs held the same 272 MB."""
        graphs = {f"prefill/{w}.kiln": m for w, m in self.prefill.items()}
        graphs.update({f"decode/{b}.kiln": m for b, m in self.decode.items()})
        if self.verify is not None:
            graphs[self.manifest["graphs"]["verify"]] = self.verify
        for b, name in self.manifest["graphs"].get("verify_rows", {}).items():
            graphs[name] = self.verify_steps[int(b)]
        if self.chunk is not None:
            graphs[self.manifest["graphs"]["chunk"]] = self.chunk
        for w, names in self.manifest["graphs"].get("windows", {}).items():
            window = self.windows[int(w)]
            graphs.update({name: window["decode"][int(b)] for b, name in names["decode"].items()})
            if "chunk" in names:
                graphs[names["chunk"]] = window["chunk"]
        blobs, pooled = ort_pool.serialized(graphs)
        blobs.update({f"tokenizer/{name}": data for name, data in self.tokenizer_files.items()})
        manifest = dict(self.manifest)
        if pooled:
            manifest["format_version"] = POOLED_FORMAT
        return Artifact(manifest, blobs)

    def save(self, path) -> str:
        """Written to the file as it is serialized (atomically), not serialized into memory
        first: a float32 SmolLM2 is 1.9 GB, which ``to_bytes`` holds twice over."""
        return self._as_artifact().save(str(path))

    def __repr__(self):
        return (f"kiln.LLM({self.manifest.get('model_name')}; batch {self.batch_size} (decode graphs for "
                f"{list(self.decode)}), context buckets {list(self.prefill)}, cache {self.meta['cache_shape'][3]} "
                "positions)")


def load_llm(art, opts, source, core=None, worker=None, load_nested=None) -> LLM:
    meta, graphs = art.manifest.get("llm"), art.manifest.get("graphs")
    if not isinstance(meta, dict) or not isinstance(graphs, dict) or "decode" not in graphs:
        raise ArtifactError(f"{source}: the LLM artifact's manifest lacks its 'llm'/'graphs' entries; "
                            "the file is corrupt or was edited")

    def nested(name):
        return load_nested(art.nested(name, f"{source}:{name}"), opts, f"{source}:{name}")

    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{source}: this LLM artifact's graphs have another layout (format "
                            f"{meta.get('format', 1)}; this kiln runs format {FORMAT}): compile it again")
    if not graphs.get("prefill"):
        raise ArtifactError(f"{source}: the LLM artifact has no prefill graph")
    names = [("prefill", int(w), name) for w, name in graphs["prefill"].items()]
    names += [("decode", int(b), name) for b, name in graphs["decode"].items()]
    names += [(kind, 0, graphs[kind]) for kind in ("chunk",) if kind in graphs]
    names += [("verify", 1, graphs["verify"])] if "verify" in graphs else []
    names += [("verify", int(b), name) for b, name in graphs.get("verify_rows", {}).items()]
    for w, entry in graphs.get("windows", {}).items():
        names += [((int(w), "decode"), int(b), name) for b, name in entry["decode"].items()]
        names += [((int(w), "chunk"), 0, entry["chunk"])] if "chunk" in entry else []
    loaded = collections.defaultdict(dict)
    # The graphs load side by side, which helps a little: SmolLM2's three graphs took
    # 1.38 -> 1.14 s (int4, ONNX Runtime) and 2.2 -> 2.0 s (fp32, OpenVINO, whose imports
    # barely overlap) on 2 cores.
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        for (kind, key, _), model in zip(names, pool.map(lambda entry: nested(entry[2]), names)):
            loaded[kind][key] = model
    tokenizer = {name[len("tokenizer/"):]: bytes(data) for name, data in art.blobs.items()
                 if name.startswith("tokenizer/")}
    windows = {int(w): {"decode": loaded[(int(w), "decode")], "chunk": loaded[(int(w), "chunk")].get(0)}
               for w in graphs.get("windows", {})}
    check_cache_shape(meta, loaded["prefill"], loaded["decode"], windows, source)
    return LLM(loaded["prefill"], loaded["decode"], meta, tokenizer, art.manifest, dict(loaded["verify"]),
               loaded["chunk"].get(0), windows=windows)


def check_cache_shape(meta, prefill, decode, windows, source):
    """The manifest's ``cache_shape`` ``[L, B, H_kv, S, D]`` is what generation allocates: it must
    agree with ``batch_size``, the context buckets and every decode graph's cache inputs (``2L``
    of ``[rows, H_kv, S or its window, D]`` after the ids and positions), or an edited number
    costs an allocation of any size (2^31 positions: 137 GB) or an error blaming the input."""
    shape = meta.get("cache_shape")
    if not (isinstance(shape, list) and len(shape) == 5 and all(type(d) is int and d > 0 for d in shape)):
        raise ArtifactError(f"{source}: llm.cache_shape is {shape!r}, not [layers, batch, kv heads, positions, "
                            "head dim] of positive integers; the file is corrupt or was edited")
    layers, batch, heads, slots, dim = shape
    if batch != meta.get("batch_size") or max(prefill) > slots:
        raise ArtifactError(f"{source}: llm.cache_shape {shape} does not agree with llm.batch_size "
                            f"{meta.get('batch_size')!r} and the largest context bucket {max(prefill)} (at most "
                            f"{slots} positions); the file is corrupt or was edited")
    graphs = [("decode", rows, slots, model) for rows, model in decode.items()]
    graphs += [(f"window/{w}/decode", rows, w, model) for w, g in windows.items() for rows, model in g["decode"].items()]
    for kind, rows, positions, model in graphs:
        specs = model.manifest["inputs"]["tensors"]
        want = [rows, heads, positions, dim]
        found = [s.get("shape") for s in specs[2:2 + 2 * layers]]
        if rows > batch or len(specs) < 2 * layers + 3 or any(f != want for f in found):
            raise ArtifactError(f"{source}: llm.cache_shape {shape} does not match the {kind}/{rows}.kiln graph, "
                                f"whose cache inputs are {found[:2]}{'...' if len(found) > 2 else ''} ({len(found)} "
                                f"of them; {2 * layers} of {want} expected); the file is corrupt or was edited")

