"""``kiln serve``: serve .kiln artifacts over HTTP with the Open Inference Protocol (KServe v2).

The command line and the process around the app: argument parsing, logging
set-up, the listening socket, uvicorn, and the graceful shutdown on SIGTERM.
The app itself is :func:`kiln.serving.app.build_app` (to run under any ASGI
server); ``python -m kiln.serving`` runs :func:`main`. See ``docs/serving.md``.
"""
from __future__ import annotations

import argparse
import logging.config
import os
import signal
import socket
import sys
import threading
from dataclasses import asdict

from kiln import argtypes, config
from kiln.errors import KilnError
from kiln.observe import profiler
from kiln.serving.app import build_app
from kiln.serving.logs import log, logging_config
from kiln.serving.repository import ServerState
from kiln.serving.settings import ServeConfig


def serve(models, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          access_log: bool = False, drain_timeout: float = 30.0, **settings) -> int:
    """Serve ``models`` (see :func:`kiln.serving.app.build_app`) until SIGTERM/SIGINT; returns an exit code.

    On SIGTERM the listening socket closes, readiness turns false, queued requests
    run at once and in-flight ones finish (for up to ``drain_timeout`` seconds)
    before the process exits. ``port=0`` picks a free port, logged as ``listening``."""
    import uvicorn     # only when serving: building an app for another ASGI server needs none
    problem = profiler.env_path_problem()    # found now, not at exit after hours of serving
    if problem:
        raise KilnError(problem)
    logging.config.dictConfig(logging_config(log_level, access_log))
    app = build_app(models, **settings)
    state: ServerState = app.state.kiln
    state.drain_timeout = drain_timeout
    log("info", "starting", pid=os.getpid(), config=asdict(state.config),
        models={sm.name: sm.source if isinstance(sm.source, str) else type(sm.source).__name__
                for sm in state.models.values()})
    sock = bind(host, port)
    bound = sock.getsockname()

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            log("info", "listening", host=bound[0], port=bound[1], url=f"http://{url_host(host)}:{bound[1]}")

        def handle_exit(self, sig, frame):
            log("info", "shutdown_requested", signal=signal.Signals(sig).name)
            super().handle_exit(sig, frame)
            if state.loop is not None:
                state.loop.call_soon_threadsafe(state.begin_drain)

    config = uvicorn.Config(app, log_config=None, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=drain_timeout, lifespan="on")
    server = Server(config)
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        # uvicorn re-raises the signal that stopped it once it is done; a no-op handler lets
        # serve() return (and the process exit 0) after a graceful shutdown
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    problem = profiler.write_env_profile()     # here, so the exit status tells a lost trace
    if problem:
        raise KilnError(f"{problem} (the server itself ran and stopped)")
    return 1 if state.failed else 0


def url_host(host: str) -> str:
    """``host`` as it goes in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before uvicorn starts so that ``port=0`` can be logged."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise KilnError(f"cannot listen on {host}:{port}: {e}") from None
    sock.set_inheritable(True)
    return sock


# -- command line ------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser):
    """The ``kiln serve`` arguments (for a subparser of the ``kiln`` command line). Counts and
    times are checked as they are parsed (until 12-03 ``--instances 0`` or ``--timeout 0`` started
    a server that answered nothing, and ``--port 70000`` was a traceback)."""
    d = ServeConfig()
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="a .kiln artifact, or name=path.kiln to choose its URL name "
                        "(default: the file's name without .kiln)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=argtypes.port, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--max-batch-size", type=argtypes.positive_int, default=d.max_batch_size,
                   help=f"rows per merged batch (default {d.max_batch_size}; 1 turns batching off)")
    p.add_argument("--max-queue-delay-ms", type=argtypes.non_negative_seconds, default=d.max_queue_delay_ms,
                   help=f"how long a request waits for others to batch with (default {d.max_queue_delay_ms})")
    p.add_argument("--no-batching", action="store_true", help="run every request alone")
    p.add_argument("--instances", type=argtypes.positive_int, default=d.instances,
                   help="copies of each model, placed on kiln cores round-robin (default 1: unpinned)")
    p.add_argument("--max-queue", type=argtypes.positive_int, default=d.max_queue,
                   help=f"queued requests per model beyond which requests get 503 (default {d.max_queue})")
    p.add_argument("--timeout", type=argtypes.positive_seconds, default=d.timeout_s,
                   help=f"per-request timeout in seconds, queue + inference (default {d.timeout_s:g})")
    p.add_argument("--threads", type=argtypes.positive_int, default=None,
                   help="engine threads per instance (default: its CPUs)")
    p.add_argument("--max-body-bytes", type=parse_size, default=d.max_request_bytes, metavar="N",
                   help=f"largest request body (bytes, or with K/M/G: 64M); larger ones get 413 "
                        f"(default {d.max_request_bytes >> 20}M; also the limit on an inflated gzip body)")
    p.add_argument("--body-timeout", type=argtypes.positive_seconds, default=d.body_timeout_s, metavar="S",
                   help=f"seconds a request body may take to arrive before 408 (default {d.body_timeout_s:g})")
    p.add_argument("--stall-timeout", type=argtypes.non_negative_seconds, default=d.stall_timeout_s, metavar="S",
                   help="an LLM whose step (a prefill, a decode step) has run this many seconds is stalled "
                        "(a tensor-parallel rank that stopped answering, a hung engine): /health and "
                        f"/v2/health/ready answer 503 naming it until the step ends (default {d.stall_timeout_s:g}; "
                        "0: never)")
    p.add_argument("--no-merge-check", action="store_true",
                   help="trust that merging requests into a batch never changes a model's answers "
                        "(skip the check at load that turns batching off for models whose rows interact)")
    p.add_argument("--embeddings", action="append", default=[], metavar="NAME=DIR",
                   help="serve model NAME (an encoder artifact) on /v1/embeddings, with the tokenizer and "
                        "pooling of its sentence-transformers (or Hugging Face) directory DIR; repeatable")
    p.add_argument("--draft", action="append", default=[], metavar="[MODEL=]DRAFT",
                   help="speculative decoding for an LLM: DRAFT is a smaller LLM artifact with the same "
                        "vocabulary, or 'ngram' (prompt lookup, no second model); MODEL= picks the served "
                        "LLM (default: every one). The LLM needs its verify graph (compiled with "
                        "--speculation-length). Repeatable")
    p.add_argument("--prompt-lookup-max", type=argtypes.positive_int, default=d.prompt_lookup_max,
                   help=f"n-gram drafting: the longest suffix looked up (default {d.prompt_lookup_max})")
    p.add_argument("--prompt-lookup-min", type=argtypes.positive_int, default=d.prompt_lookup_min,
                   help=f"n-gram drafting: the shortest suffix looked up (default {d.prompt_lookup_min})")
    p.add_argument("--drain-timeout", type=argtypes.non_negative_seconds, default=30.0,
                   help="on SIGTERM, how long in-flight requests may take to finish (default 30)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--trust-native-code", action="store_true",
                   help="load native code (TorchInductor partitions) from artifacts that no key trusted "
                        "here signed (as KILN_TRUST_NATIVE_CODE=1); only for artifacts from a source you trust")


def parse_size(text: str) -> int:
    """``--max-body-bytes`` values: bytes, or a number with K, M or G (binary units)."""
    try:
        n = config.parse_size(text, binary=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"the size must be positive: {text!r}")
    return n


def parse_pairs(items: list) -> dict:
    """``--embeddings NAME=DIR`` values as ``{NAME: DIR}``."""
    out = {}
    for item in items:
        name, sep, directory = item.partition("=")
        if not sep or not name or not directory:
            raise KilnError(f"--embeddings takes NAME=DIR (a served model's name and its tokenizer's "
                            f"directory); got {item!r}")
        out[name] = directory
    return out


def parse_drafts(values: list, models=()) -> dict:
    """``--draft`` values (``DRAFT`` or ``MODEL=DRAFT``) as ``{model or "*": draft}``; a
    MODEL that is not among ``models`` (the served ones) is an error."""
    from kiln.serving.repository import resolve_models
    drafts = {}
    for value in values:
        name, sep, draft = value.partition("=")
        name, draft = (name, draft) if sep and not os.path.exists(value) else ("*", value)
        if not draft or name in drafts:
            raise KilnError(f"--draft {value!r}: give one DRAFT ('ngram' or a .kiln path) per model, as "
                            "--draft DRAFT or --draft MODEL=DRAFT")
        drafts[name] = draft
    served = set(resolve_models(models)) if models else set()
    unknown = sorted(set(drafts) - {"*"} - served) if models else []
    if unknown:
        raise KilnError(f"--draft names {', '.join(unknown)}, which is not a served model (served: "
                        f"{', '.join(sorted(served))})")
    return drafts


def run(args) -> int:
    """Run ``kiln serve`` from parsed :func:`add_arguments` arguments."""
    if getattr(args, "trust_native_code", False):
        os.environ["KILN_TRUST_NATIVE_CODE"] = "1"
    try:
        if _torchrun_follower(args):
            return 0
        return serve(args.models, args.host, args.port, log_level=args.log_level,
                     access_log=args.access_log, drain_timeout=args.drain_timeout,
                     max_batch_size=1 if args.no_batching else args.max_batch_size,
                     max_queue_delay_ms=args.max_queue_delay_ms, max_queue=args.max_queue,
                     instances=args.instances, timeout_s=args.timeout, threads=args.threads,
                     max_request_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                     stall_timeout_s=args.stall_timeout,
                     merge_check=not args.no_merge_check, embeddings=parse_pairs(args.embeddings),
                     drafts=parse_drafts(args.draft, args.models), prompt_lookup_max=args.prompt_lookup_max,
                     prompt_lookup_min=args.prompt_lookup_min)
    except KilnError as e:
        print(f"kiln serve: error: {e}", file=sys.stderr)
        return 2


def _torchrun_follower(args) -> bool:
    """Under ``torchrun`` (several processes, on one host or several), every process joins
    the world; rank 0 goes on to serve, and the others follow it as ranks of the one
    tensor-parallel artifact served (True: this process was a follower and is done)."""
    from kiln import config
    if int(config.get("WORLD_SIZE") or 1) <= 1:
        return False
    from kiln.distributed import launch
    info = launch.init_from_env()
    if info.rank == 0:
        return False
    from kiln.runtime import tp_rank
    if len(args.models) != 1:
        raise KilnError("under torchrun, kiln serve serves one tensor-parallel LLM artifact; "
                        f"got {len(args.models)} models")
    spec = os.fspath(args.models[0])
    tp_rank.follow_rank(spec if os.path.exists(spec) else spec.partition("=")[2], info.rank, args.threads)
    return True


def main(argv=None) -> int:
    """``kiln serve`` and ``python -m kiln.serving``: parse ``argv`` and serve; the exit code."""
    p = argparse.ArgumentParser(prog="kiln serve", description="Serve .kiln artifacts over HTTP "
                                "with the Open Inference Protocol (KServe v2); LLM artifacts with the "
                                "OpenAI API (/v1/completions, /v1/chat/completions); encoders named by "
                                "--embeddings on /v1/embeddings.")
    add_arguments(p)
    return run(p.parse_args(argv))
