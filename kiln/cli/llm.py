"""``kiln llm compile | generate | chat``: an LLM from a checkpoint to an artifact, and
text from the artifact, streamed to the terminal as it is generated.

``generate`` and ``chat`` run the artifact with kiln's runtime, without transformers or
the model's code: the tokenizer and chat template come from the artifact. Statistics (tokens, time to first
token, decode rate) go to stderr so stdout holds only the generated text.
"""
from __future__ import annotations

import sys
import time

from kiln.cli.common import positive_int


def add_parser(sub):
    p = sub.add_parser("llm", help="compile an LLM (Llama family) and generate or chat with it")
    llm_sub = p.add_subparsers(dest="llm_cmd", required=True)

    c = llm_sub.add_parser("compile", help="compile a Hugging Face checkpoint directory or .gguf file")
    c.add_argument("source", help="checkpoint directory (config + safetensors) or a .gguf file")
    c.add_argument("-o", "--output", required=True, help="the .kiln artifact to write")
    c.add_argument("--batch-size", type=positive_int, default=4, help="requests generating at once (default 4)")
    c.add_argument("--context-buckets", default="128",
                   help="prompt widths prefill is compiled for, comma-separated (default 128)")
    c.add_argument("--cache-length", type=positive_int, default=256,
                   help="KV-cache positions per request, prompt + generated (default 256)")
    c.add_argument("--sequence-buckets", default=None,
                   help="smaller cache windows to compile decode graphs for as well, comma-separated "
                        "(e.g. 256,512 with --cache-length 2048): a step attends over the smallest "
                        "window holding the running sequences, not the whole cache")
    c.add_argument("-O", "--optlevel", type=int, choices=(1, 2, 3), default=None,
                   help="kiln's optimisation level (default 2: engines chosen by measurement)")
    c.add_argument("--engine", default=None, help="compile every graph with this engine")
    c.add_argument("--tp-degree", type=positive_int, default=1,
                   help="shard the model over N tensor-parallel ranks (processes on their own kiln cores "
                        "when served or run; see docs/distributed.md) (default 1)")
    c.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="also compile a chunk graph of this many tokens: long prompts are prefilled a "
                        "chunk per step between decode steps, and may exceed the largest context bucket")
    c.add_argument("--quantize", choices=("gguf", "int8", "int4", "none"), default=None,
                   help="weights: gguf = as the .gguf file stores them (its blocks kept where a kernel "
                        "takes them, float where it holds float; the default for a quantized .gguf file), "
                        "int8 / int4 = kiln's weight-only quantization, none = float32 (the default "
                        "otherwise); all but none are held to the LLM accuracy gate")
    c.add_argument("--prefill-auto-cast", choices=("bf16",), default=None,
                   help="quantized builds on a CPU that computes bf16 natively (AVX512-BF16, AMX): prefill "
                        "graphs compute in bf16, as OpenVINO GenAI does there (faster first tokens; the "
                        "accuracy gate judges the build)")
    c.add_argument("--max-ppl-ratio", type=float, default=None,
                   help="the gate's most perplexity relative to float32 (default: int8 and gguf 1.05, int4 1.25)")
    c.add_argument("--min-agreement", type=float, default=None,
                   help="the gate's least greedy agreement with float32 (default: int8 0.90, gguf 0.85, int4 0.75)")
    c.add_argument("--workers", type=positive_int, default=None,
                   help="processes compiling graphs side by side (default: one per CPU for models "
                        "of 20M parameters or more)")
    c.add_argument("--speculation-length", type=positive_int, default=None,
                   help="also compile the graph that verifies this many draft tokens at once "
                        "(speculative decoding: `kiln llm generate --draft`)")
    c.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cuda: compile for this machine's NVIDIA GPU (TorchInductor; the KV cache on the GPU, "
                        "decode replayed as CUDA graphs; float weights, a .gguf file dequantized) "
                        "(default cpu)")
    c.set_defaults(fn=cmd_compile)

    for name, helptext in (("generate", "continue a prompt, streaming the text"),
                           ("chat", "chat with the model on the terminal (its chat template)")):
        g = llm_sub.add_parser(name, help=helptext)
        g.add_argument("artifact", help="an LLM .kiln artifact")
        if name == "generate":
            g.add_argument("prompt", help="the prompt text ('-' reads stdin)")
            g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message")
        else:
            g.add_argument("--system", default=None, help="a system message to start with")
        g.add_argument("--max-tokens", type=positive_int, default=None,
                       help="most tokens to generate (default: as many as the KV cache holds)")
        g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sampled")
        g.add_argument("--top-p", type=float, default=1.0)
        g.add_argument("--top-k", type=int, default=0)
        g.add_argument("--repetition-penalty", type=float, default=1.0)
        g.add_argument("--seed", type=int, default=None)
        g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
        g.add_argument("--threads", type=positive_int, default=None, help="engine threads (default: all CPUs)")
        g.add_argument("--draft", default=None,
                       help="speculative decoding: a smaller LLM artifact with the same vocabulary proposing "
                            "tokens for this one to verify, or 'ngram' (prompt lookup, no second model); the "
                            "same text as without it; this artifact needs --speculation-length")
        g.add_argument("--prompt-lookup-max", type=positive_int, default=4,
                       help="--draft ngram: the longest suffix looked up in the text so far (default 4)")
        g.add_argument("--prompt-lookup-min", type=positive_int, default=2,
                       help="--draft ngram: the shortest suffix looked up (default 2)")
        g.set_defaults(fn=cmd_generate if name == "generate" else cmd_chat)


def cmd_compile(args, console) -> int:
    from kiln.llm.build import compile_llm
    from kiln.llm.source import load_pretrained
    buckets = _integers(args.context_buckets, "--context-buckets")
    started = time.perf_counter()
    print(f"kiln llm: loading {args.source}", file=sys.stderr, flush=True)
    model, tokenizer = load_pretrained(args.source)
    print(f"kiln llm: loaded {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"parameters) in {time.perf_counter() - started:.1f}s; tokenizer: {'yes' if tokenizer else 'none'}",
          file=sys.stderr, flush=True)

    def progress(name, k, n, seconds):
        print(f"kiln llm: compiled {name} ({k}/{n}) in {seconds:.1f}s", file=sys.stderr, flush=True)

    windows = _integers(args.sequence_buckets, "--sequence-buckets") if args.sequence_buckets else None
    # on the GPU a .gguf file's weights are dequantized (its blocks are CPU kernels' layouts)
    quantize = (_quantize_for(args.source, args.quantize, args.tp_degree or 1)
                if args.device != "cuda" or args.quantize else None)
    options = {k: v for k, v in (("optlevel", args.optlevel), ("engine", args.engine),
                                 ("sequence_buckets", windows), ("device", args.device),
                                 ("quantize", quantize), ("workers", args.workers),
                                 ("prefill_chunk", args.prefill_chunk),
                                 ("speculation_length", args.speculation_length),
                                 ("max_ppl_ratio", args.max_ppl_ratio), ("min_agreement", args.min_agreement),
                                 ("prefill_auto_cast", args.prefill_auto_cast))
               if v is not None}
    llm = compile_llm(model, batch_size=args.batch_size, context_buckets=buckets, cache_length=args.cache_length,
                      tokenizer=tokenizer, on_graph=progress, tp_degree=args.tp_degree, **options)
    _print_gguf(llm.meta.get("gguf"))
    gate = llm.meta.get("accuracy_gate")
    if gate:
        print(f"kiln llm: {quantize} accuracy gate passed: perplexity x{gate['ppl_ratio']:.3f} of float32's "
              f"(limit x{gate['max_ppl_ratio']}), greedy agreement {gate['agreement']:.1%} (limit "
              f"{gate['min_agreement']:.0%}) over {gate['tokens']} tokens", file=sys.stderr, flush=True)
    llm.save(args.output)
    print(f"kiln llm: wrote {args.output}: {llm!r} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0


def _quantize_for(source, asked, tp_degree=1):
    """``--quantize`` as ``compile_llm`` takes it. No flag: ``gguf`` for a .gguf file that
    holds quantized matrices (the model as downloaded: its size, speed and answers, not
    its dequantized weights in float32 or rounded again onto kiln's grid), else float32;
    float32 with a note at ``--tp-degree`` above 1, where kept blocks do not run (until 12-03
    an error about ``quantize='gguf'``, which the user never gave)."""
    import os
    if asked is not None:
        return None if asked == "none" else asked
    if str(source).lower().endswith(".gguf") and os.path.isfile(source):     # any case, as load_pretrained reads it
        from kiln.llm import gguf_file
        if any(t.type in gguf_file.KEPT_TYPES for t in gguf_file.check(source)):
            if tp_degree > 1:
                print(f"kiln llm: --tp-degree {tp_degree}: a GGUF file's quantized blocks run unsharded only, so "
                      "its weights are dequantized to float32 (--quantize none); drop --tp-degree to keep them",
                      file=sys.stderr, flush=True)
                return None
            return "gguf"
    return None


def _print_gguf(note) -> None:
    """The note ``quantize="gguf"`` leaves: which of the file's types were kept as blocks."""
    if note:
        def listing(counts):
            return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"
        unused = (f"; matched to no parameter of the model (the model's own matrices there are int8): "
                  f"{listing(note['unused'])}" if note.get("unused") else "")
        print(f"kiln llm: {note['file']}: matrices kept as the file's blocks: {listing(note['kept'])}; in "
              f"float32: {listing(note['float32'])}{unused} (per tensor: the artifact's manifest, llm.gguf)",
              file=sys.stderr, flush=True)


def _integers(text: str, flag: str) -> list:
    from kiln.errors import CompilerArgsError
    try:
        return [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise CompilerArgsError(f"{flag} must be integers separated by commas; got {text!r}") from None


def _setup(args):
    from kiln.errors import InputError
    from kiln.runtime.loader import load
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling import SamplingParams
    from kiln.runtime.text import Tokenizer
    from kiln.runtime.tp_llm import TensorParallelLLM
    if not args.temperature >= 0:       # NaN too; SamplingParams' message names do_sample=, not a flag
        raise InputError(f"--temperature must be >= 0 (0, the default, decodes greedily); got {args.temperature}")
    greedy = args.temperature == 0
    try:            # checked before the artifact loads, and said in the flags' spelling (12-03)
        params = SamplingParams(do_sample=not greedy, temperature=1.0 if greedy else args.temperature,
                                top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                                seed=args.seed)
    except InputError as e:
        message = str(e)
        for name in ("repetition_penalty", "top_p", "top_k", "seed"):
            message = message.replace(f"{name} must", f"--{name.replace('_', '-')} must")
        raise InputError(message) from None
    llm = load(args.artifact, threads=args.threads)
    if not isinstance(llm, (LLM, TensorParallelLLM)):
        raise InputError(f"{args.artifact} is not an LLM artifact (compile one with `kiln llm compile`)")
    tokenizer = Tokenizer(llm.tokenizer_files)
    stops = set(llm.meta["eos_token_ids"])
    if tokenizer.token_id("eos_token") is not None:
        stops.add(tokenizer.token_id("eos_token"))
    args.drafter = None
    if args.draft is not None:
        if not isinstance(llm, LLM):
            raise InputError("--draft: speculative decoding does not run tensor-parallel LLMs yet")
        draft = args.draft
        if draft != "ngram":
            draft = load(draft, threads=args.threads)
            if not isinstance(draft, LLM):
                raise InputError(f"--draft {args.draft} is not an LLM artifact (nor 'ngram')")
        # built now, so a target that cannot verify is a clear error before any prompt
        args.drafter = llm.speculative_step(draft, args.prompt_lookup_max, args.prompt_lookup_min).drafter
    return llm, tokenizer, params, tuple(sorted(stops))


def _stream(llm, tokenizer, prompt, args, params, stop_ids, out=sys.stdout) -> str:
    """Generate for ``prompt`` (ids), writing text to ``out`` as it comes; the whole text.
    With ``--draft``, the scheduler decodes speculatively (``args.drafter``: its step)."""
    from kiln.runtime.scheduler import Request
    from kiln.runtime.text import TextStream
    drafter = getattr(args, "drafter", None)
    sched = llm.scheduler() if drafter is None else llm.scheduler(draft=drafter)
    text = TextStream(tokenizer, tuple(args.stop))
    room = llm.meta["cache_shape"][3] - len(prompt)
    max_tokens = args.max_tokens if args.max_tokens is not None else max(1, room)

    def on_token(request, token):
        out.write(text.push(token))
        out.flush()
        return text.stopped

    request = sched.add(Request(prompt, max_tokens, params, stop_ids, on_token=on_token))
    sched.run()
    out.write(text.finish())
    out.flush()
    if request.error is not None:
        raise request.error
    t = request.token_times
    rate = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else float("nan")
    spec = ""
    if sched.speculative is not None:
        share = request.draft_accepted / request.draft_proposed if request.draft_proposed else 0.0
        spec = (f"; draft tokens accepted {request.draft_accepted}/{request.draft_proposed} ({share:.0%}) "
                f"in {sched.speculative.rounds} verify steps of k={sched.speculative.k}")
    print(f"\n[{len(prompt)} prompt tokens, {len(t)} generated ({request.finish_reason}); first token "
          f"{t[0] - request.arrived:.3f}s, {rate:.1f} tokens/s{spec}]", file=sys.stderr, flush=True)
    return text.text


def cmd_generate(args, console) -> int:
    llm, tokenizer, params, stop_ids = _setup(args)
    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        prompt = tokenizer.encode_chat([{"role": "user", "content": prompt_text}])
    else:
        prompt = tokenizer.encode(prompt_text)
    _stream(llm, tokenizer, prompt, args, params, stop_ids)
    print()
    return 0


def cmd_chat(args, console) -> int:
    from kiln.errors import InputError
    llm, tokenizer, params, stop_ids = _setup(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    tty = sys.stdin.isatty()
    if tty:
        print(f"kiln llm chat: {llm!r}. /reset starts over, /exit or Ctrl-D ends.", file=sys.stderr)
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        try:
            reply = _stream(llm, tokenizer, tokenizer.encode_chat(messages), args, params, stop_ids)
        except InputError as e:
            messages.pop()
            print(f"kiln llm chat: {e}; /reset starts a new conversation", file=sys.stderr, flush=True)
            continue
        print(flush=True)                   # each reply on its own line, as generate ends its text
        messages.append({"role": "assistant", "content": reply})
