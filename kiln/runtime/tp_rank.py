"""A tensor-parallel LLM's follower process: load this rank's share of the artifact and
follow rank 0 (:mod:`kiln.runtime.lockstep`) until it stops.

Apart from :mod:`kiln.runtime.tp_llm` because it loads an artifact: it needs the loader,
which itself imports ``tp_llm`` for the ``llm_tp`` kind.
"""
from __future__ import annotations

from kiln.artifact.container import Artifact
from kiln.errors import ArtifactError
from kiln.runtime import lockstep, loader, tp_llm
from kiln.runtime.options import RuntimeOptions


def load_rank(path: str, rank: int, threads: int | None = None):
    """Rank ``rank``'s :class:`~kiln.runtime.llm.LLM` from the tensor-parallel artifact at
    ``path`` (only its graphs are read)."""
    art = Artifact.load(path)
    if art.manifest.get("kind") != tp_llm.KIND:
        raise ArtifactError(f"{path}: not a tensor-parallel LLM (kind {art.manifest.get('kind')!r})")
    names = art.manifest.get("graphs", {}).get("ranks") or []
    if not 0 <= rank < len(names):
        raise ArtifactError(f"{path}: holds {len(names)} ranks; rank {rank} has no share in it")
    name = names[rank]
    llm = loader.from_artifact(art.nested(name, f"{path}:{name}"), RuntimeOptions(threads=threads),
                               f"{path}:{name}")
    art.release_pages()
    return llm


def follow_rank(path: str, rank: int, threads: int | None = None):
    """Load rank ``rank`` and follow rank 0 over the default ``torch.distributed`` group."""
    import torch.distributed as dist
    from kiln.distributed import groups
    llm = load_rank(path, rank, threads)
    groups.register("tp", groups.get("world") if groups.is_bound("world") else groups.TorchGroup(None))
    channel = lockstep.ProcessChannel(lockstep.command_group())
    lockstep.follow(tp_llm.Follower(llm), channel)


def follower_main(info, payload: dict):
    """The entry :func:`kiln.distributed.launch.start_ranks` runs in each follower process."""
    import torch.distributed as dist
    follow_rank(payload["path"], dist.get_rank(), payload.get("threads"))
