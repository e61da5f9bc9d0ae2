"""A tensor-parallel LLM: one artifact (kind ``llm_tp``) holding every rank's graphs.

The artifact nests one ordinary ``llm`` artifact per rank (``rank/<r>.kiln``: that rank's
prefill, decode, chunk and window graphs over its share of the weights, its cache shape
``[L, B, H_kv / tp, S, D]``) and the tokenizer once. The manifest's ``llm`` entry is rank
0's with ``tp_degree`` and the head split (``heads``) added.

Loading reads rank 0's graphs in this process. The other ranks start on first use
(:meth:`TensorParallelLLM.start`), as processes pinned to their own kiln cores
(:func:`kiln.distributed.launch.start_ranks`; each loads its own share from the file),
as threads of this process (``mode="threads"``: one process's engines, for tests and
small models), or — when ``torch.distributed`` already joins ``tp_degree`` processes
(``torchrun``, several hosts) — as those processes, each of which loads its rank and,
but for rank 0, runs :func:`follow_from_env`. From then on rank 0 drives, and the others
follow each step (:mod:`kiln.runtime.lockstep`).
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
import traceback

import torch

from kiln.artifact.container import Artifact, wrapper_manifest
from kiln.distributed import ops  # noqa: F401 - registers the kiln:: collectives the ranks' graphs run
from kiln.errors import ArtifactError, InputError, KilnError
from kiln.runtime import lockstep
from kiln.runtime.llm import LLM, generate_args
from kiln.runtime.scheduler import run_all

KIND = "llm_tp"
_started: set = set()        # the models whose ranks run in this process (start .. close)


class TensorParallelLLM:
    """The :class:`~kiln.runtime.llm.LLM` interface over ``tp_degree`` ranks."""

    def __init__(self, ranks: list, meta: dict, tokenizer_files: dict, manifest=None, *, source=None,
                 rank_loader=None):
        self.ranks = list(ranks)                 # rank -> LLM (None until loaded)
        self.meta = meta
        self.tokenizer_files = tokenizer_files
        self.source, self._rank_loader = source, rank_loader
        self.mode = None                         # "threads", "processes" or "torch.distributed"
        self._channel = self._launched = None
        self._threads: list = []
        self._thread_groups: list = []
        self._cleanup = None                     # a private copy of the artifact to remove
        self.threads = None                      # engine threads per rank (None: the rank's CPUs)
        self.failed = None                       # why a rank is gone, once one is
        self.failed_traceback = None             # a follower thread's own failure, where that was the cause
        self._failing = threading.Lock()         # the first failure is recorded and told once
        self.on_failure: list = []               # listener(rank, returncode, stderr_tail)
        if manifest is None:
            manifest = wrapper_manifest(KIND, self.ranks[0].manifest, llm=meta,
                                        graphs={"ranks": [f"rank/{r}.kiln" for r in range(len(ranks))]})
        self.manifest = manifest

    # -- what the server and the CLI read, as LLM has it ------------------------------------
    @property
    def tp_degree(self) -> int:
        return int(self.meta["tp_degree"])

    @property
    def leader(self) -> LLM:
        return self.ranks[0]

    batch_size = property(lambda self: self.leader.batch_size)
    max_context = property(lambda self: self.leader.max_context)
    prefill = property(lambda self: self.leader.prefill)
    decode = property(lambda self: self.leader.decode)
    chunk = property(lambda self: self.leader.chunk)
    windows = property(lambda self: self.leader.windows)

    # -- ranks -----------------------------------------------------------------------------
    def start(self, mode: str | None = None) -> "TensorParallelLLM":
        """Start the other ranks (module doc); a no-op once started. ``mode``: ``"processes"``
        (default), ``"threads"``; under ``torch.distributed`` with ``tp_degree`` processes
        the existing group is used whatever is asked."""
        if self.mode is not None:
            return self
        # Which decode graphs to run is agreed by all ranks (a collective probe, once per
        # start): a plan kept from ranks started before (compile_llm's check runs threads,
        # then closes them) would leave rank 0 skipping the probe that fresh followers run,
        # and the ranks waiting on each other for good
        for llm in self.ranks:
            if llm is not None:
                llm._invariance = None
        others = [m for m in _started if m is not self]
        if others:
            # the collective group its graphs call ("tp") and the world its processes serve are
            # this process's: a second model joined the first's world as if torchrun had made
            # it and waited for followers that serve the first, for good (found by probing)
            raise KilnError(f"another tensor-parallel model in this process has its ranks running "
                            f"({others[0].mode}, from {others[0].source or 'memory'}); close() it before "
                            "starting this one: one process runs one tensor-parallel model's ranks at a time")
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() == self.tp_degree:
            self._join_group()
        elif (mode or "processes") == "threads":
            self._start_threads()
        elif (mode or "processes") == "processes":
            self._start_processes()
        else:
            raise InputError(f"mode={mode!r}: tensor-parallel ranks run as 'processes' or 'threads'")
        for llm in self.ranks:
            if llm is not None:
                llm.agree = _agree
        _started.add(self)
        return self

    def _start_threads(self):
        from kiln.distributed import groups
        for r in range(1, self.tp_degree):
            if self.ranks[r] is None:
                self.ranks[r] = self._rank_loader(r)
        group = groups.ThreadGroup(self.tp_degree)
        self._thread_groups = [group]
        groups.register("tp", group.rank_view(0))
        channel = lockstep.ThreadChannel(self.tp_degree - 1)
        self._threads = lockstep.thread_followers([Follower(llm) for llm in self.ranks[1:]], channel, group,
                                                  self._thread_failed)
        self._channel, self.mode = channel, "threads"

    def _start_processes(self):
        from kiln.distributed import launch
        path, cleanup = self._file()
        self._launched = launch.start_ranks(self.tp_degree, "kiln.runtime.tp_rank:follower_main",
                                            {"path": path, "threads": self.threads}, on_failure=self._rank_failed)
        self._join_group()
        self.mode = "processes"
        self._cleanup = path if cleanup else None

    def _rank_failed(self, rank, returncode, tail):
        """A follower process died: its peers' collectives fail from now on; tell the owner.
        Each rank has a watchdog thread of its own, so ranks that exit because the first one
        did (their collectives aborted) report too: only the first is the cause, kept and
        told once, as for threads."""
        first = self._first_failure(f"rank {rank} exited with code {returncode}")
        self._channel = None        # nothing can run any more: _command says so, not gloo's error
        if first:
            for listener in list(self.on_failure):
                listener(rank, returncode, tail)

    def _thread_failed(self, rank, error):
        """A follower thread failed. Where nothing had failed before, this is the cause: the
        owner hears of it as of rank 0's failed step (no exit code, the reason as the text),
        and its traceback is kept in ``failed_traceback``. A failure that follows another's
        (a rank whose collective was aborted after rank 0 failed its step) adds nothing."""
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        if self._first_failure(f"rank {rank} failed: {type(error).__name__}: {error}", trace):
            for listener in list(self.on_failure):
                listener(rank, None, self.failed)

    def _first_failure(self, why: str, trace: str | None = None) -> bool:
        """Record ``why`` (and a follower thread's ``trace``) as the cause, where nothing had
        failed before; True when it is the cause, whose listeners are then told. Ranks'
        watchdogs, follower threads and rank 0's step report from different threads."""
        with self._failing:
            if self.failed is not None:
                return False
            self.failed, self.failed_traceback = why, trace
            return True

    def _join_group(self):
        from kiln.distributed import groups
        groups.register("tp", groups.get("world") if groups.is_bound("world") else groups.TorchGroup(None))
        self._channel = lockstep.ProcessChannel(lockstep.command_group())
        self.mode = self.mode or "torch.distributed"

    def _file(self):
        """A path the other processes read their ranks from: the loaded file, or a private copy."""
        if self.source and os.path.isfile(self.source):
            return self.source, False
        fd, path = tempfile.mkstemp(prefix="kiln-tp-", suffix=".kiln")      # mode 0600
        with os.fdopen(fd, "wb") as f:
            self._as_artifact().write_to(f)
        return path, True

    def close(self):
        """Stop the other ranks (they finish their current step first)."""
        if self._channel is not None:
            try:
                self._channel.send(("stop",))
            except Exception:  # noqa: BLE001 - a rank is gone; the rest of the clean-up still runs
                pass
            self._channel = None
        for t in self._threads:
            t.join(60)
        if self._launched is not None:
            try:
                if self.failed is None:
                    self._launched.wait(60)
            finally:
                self._launched.terminate()
                self._launched = None
        if self._cleanup:
            os.unlink(self._cleanup)
            self._cleanup = None
        from kiln.distributed import groups
        groups.unregister("tp")
        self.mode = None
        _started.discard(self)

    def _command(self, *message):
        self.start()
        if self._channel is None:
            raise KilnError(f"this tensor-parallel model's ranks have stopped ({self.failed}); close() it and "
                            "load the artifact again")
        self._channel.send(message)

    # -- running ---------------------------------------------------------------------------
    def scheduler(self, draft=None, **options) -> lockstep.LockstepScheduler:
        """A continuous-batching scheduler on rank 0 whose every step the other ranks follow.
        ``draft`` is refused: speculative decoding's verify step runs on one process's graphs."""
        _refuse_draft(draft)
        self._command("scheduler", options)
        scheduler = local_scheduler(self.leader, options, self._channel)
        scheduler.on_broken, scheduler.explain = self._broken, self._explain
        return scheduler

    def _explain(self, error: BaseException) -> BaseException:
        """A request's error on rank 0 as its cause: where a rank has failed (a follower process
        died, its thread failed), rank 0's collective raises its own error (gloo's 'Connection
        closed by peer', an aborted thread group's), which names no rank; that becomes a KilnError naming the failed rank
        and what to do, caused by it. Rank 0's own failure, and a request's own, stay as they are."""
        launched = self._launched
        if self.failed is None and launched is not None and not launched.alive():
            deadline = time.monotonic() + 5.0       # a rank died: its watchdog records why, at once
            while self.failed is None and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.failed is None or self.failed.startswith("rank 0 ") or self.failed in str(error):
            return error
        explained = KilnError(f"this tensor-parallel model's ranks have stopped ({self.failed}): "
                              f"{type(error).__name__}: {error}; close() it and load the artifact again "
                              "(a server shuts down; restart it)")
        explained.__cause__ = error
        return explained

    def stop_ranks(self, why: str):
        """Kill the other ranks now, as the cause ``why``: rank 0's collective with a rank that
        does not answer (stopped, or stuck) then fails at once instead of waiting out the
        collective timeout (30 minutes). SIGKILL, since a stopped process keeps a SIGTERM
        pending until it is continued. A server stopping calls this when its scheduler is still
        in a step after the drain timeout."""
        self._first_failure(why)
        if self._launched is not None:
            self._launched.kill()
        for group in self._thread_groups:
            group.abort()
        self._channel = None

    def _broken(self, error):
        """Rank 0's graph call failed: the ranks are out of step, so they are stopped (a
        follower waiting in a collective would otherwise wait for a call that never comes)."""
        # else a follower failed first, was reported, and this followed
        first = self._first_failure(f"rank 0 failed a step: {type(error).__name__}: {error}")
        if self._launched is not None:
            self._launched.terminate()
            self._launched = None
        for group in self._thread_groups:
            group.abort()
        self._channel = None
        for listener in list(self.on_failure) if first else ():
            listener(0, None, self.failed)

    def warm_graphs(self) -> int:
        self._command("warm")
        return self.leader.warm_graphs()

    @property
    def batch_invariance(self) -> dict:
        self._command("plan")
        return self.leader.batch_invariance

    def last_logits(self, prompt: list):
        """The prefill logits of ``prompt``'s last token (``[1, V]``), every rank taking part."""
        self._command("prefill", list(prompt))
        return prefill_logits(self.leader, prompt)

    def generate(self, prompts: list, max_new_tokens: int, *, params=None, stop_at_eos: bool = True,
                 draft=None) -> list:
        """As :meth:`kiln.runtime.llm.LLM.generate` (``draft``: refused, as by :meth:`scheduler`)."""
        prompts, max_new_tokens, params = generate_args(prompts, max_new_tokens, params)
        _refuse_draft(draft)
        eos = self.meta["eos_token_ids"] if stop_at_eos else ()
        return self._generate_rows(prompts, max_new_tokens, params, eos)

    hf_generate = LLM.hf_generate
    _streamed = LLM._streamed

    def _generate_rows(self, prompts, max_new_tokens, params, eos):
        return run_all(self.scheduler(), prompts, max_new_tokens, params, eos)

    # -- the artifact ----------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return self._as_artifact().to_bytes()

    def _as_artifact(self) -> Artifact:
        """Each rank's LLM artifact a blob of it, and the tokenizer's files."""
        blobs = {}
        for r in range(self.tp_degree):
            llm = self.ranks[r] if self.ranks[r] is not None else self._rank_loader(r)
            blobs[f"rank/{r}.kiln"] = llm.to_bytes()
        blobs.update({f"tokenizer/{name}": data for name, data in self.tokenizer_files.items()})
        return Artifact(self.manifest, blobs)

    save = LLM.save

    def __repr__(self):
        return f"kiln.TensorParallelLLM({self.manifest.get('model_name')}; tp_degree {self.tp_degree}, {self.leader!r})"


def _agree(ok: bool) -> bool:
    """Every rank's finding at once: true only where it is true on all ranks."""
    return bool(ops.all_reduce(torch.tensor([1.0 if ok else 0.0]), "tp", "min")[0] > 0)


def prefill_logits(llm: LLM, prompt: list):
    n = len(prompt)
    with torch.no_grad():
        logits = llm.prefill_for(n)(torch.tensor([prompt]), torch.arange(n).unsqueeze(0), torch.tensor([n - 1]))[0]
    return logits[0]


def _refuse_draft(draft):
    if draft is not None:
        raise InputError("speculative decoding (draft=) does not run tensor-parallel LLMs yet: decode without a "
                         "draft, or compile the model without tp_degree to decode with one")


def local_scheduler(llm: LLM, options: dict, channel=None) -> lockstep.LockstepScheduler:
    """This rank's scheduler over its graphs (the leader's when ``channel`` is given)."""
    decode, windows = llm.decode_plan()
    return lockstep.LockstepScheduler(llm.prefill_for, decode, llm.meta["cache_shape"], max_context=llm.max_context,
                                      chunk=llm.chunk_step(), windows=windows, channel=channel, **options)


class Follower:
    """What :func:`kiln.runtime.lockstep.follow` drives on a follower rank."""

    def __init__(self, llm: LLM):
        self.llm = llm
        llm.agree = _agree

    def local_scheduler(self, options):
        return local_scheduler(self.llm, options)

    def plan(self):
        self.llm.decode_plan()

    def warm_graphs(self):
        self.llm.warm_graphs()

    def prefill_logits(self, prompt):
        prefill_logits(self.llm, prompt)


def load_llm_tp(art, opts, source, core=None, worker=None, load_nested=None) -> TensorParallelLLM:
    meta, graphs = art.manifest.get("llm"), art.manifest.get("graphs")
    if not isinstance(meta, dict) or not isinstance(graphs, dict) or not isinstance(graphs.get("ranks"), list):
        raise ArtifactError(f"{source}: the tensor-parallel LLM's manifest lacks its 'llm'/'graphs' entries; "
                            "the file is corrupt or was edited")
    names = graphs["ranks"]
    if len(names) != int(meta.get("tp_degree", -1)):
        raise ArtifactError(f"{source}: the manifest lists {len(names)} ranks for tp_degree "
                            f"{meta.get('tp_degree')}; the file is corrupt or was edited")

    def rank(r):
        name = names[r]
        return load_nested(art.nested(name, f"{source}:{name}"), opts, f"{source}:{name}")

    tokenizer = {name[len("tokenizer/"):]: bytes(data) for name, data in art.blobs.items()
                 if name.startswith("tokenizer/")}
    ranks = [rank(0)] + [None] * (len(names) - 1)
    return TensorParallelLLM(ranks, meta, tokenizer, art.manifest, source=source, rank_loader=rank)
