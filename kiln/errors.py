"""kiln's exceptions.

Every failure a user can cause or hit (a model that will not capture, an op
with no device kernel, a corrupt artifact, a wrong input) gets its own class so
callers can catch precisely, and every message says what happened and what to
do about it.
"""


class KilnError(Exception):
    """Base class of everything kiln raises on purpose."""


class CaptureError(KilnError):
    """torch.export could not turn the model into a graph."""


class UnsupportedOpError(KilnError):
    """Ops have no device kernel and fallback to the host was disabled."""


class UnsupportedModelError(KilnError):
    """An LLM whose architecture kiln's LLM path cannot compile (the message names what is missing)."""


class CompileError(KilnError):
    """An engine failed to compile a device partition."""


class ValidationError(KilnError):
    """Compiled outputs differ from eager PyTorch beyond the tolerances."""

    def __init__(self, message, metrics=None):
        super().__init__(message)
        self.metrics = metrics or {}


class ArtifactError(KilnError):
    """A .kiln file is corrupt, truncated, foreign or from an incompatible kiln."""


class TargetMismatchError(ArtifactError):
    """The artifact needs CPU features or an engine this host does not have."""


class SignatureError(ArtifactError):
    """A signed artifact whose signature does not verify: it was modified after signing."""


class UntrustedArtifactError(ArtifactError):
    """The artifact holds native code and no key this host trusts signed it."""


class EngineUnavailableError(KilnError):
    """The engine an artifact or an option needs is not installed."""


class InputError(KilnError, ValueError):
    """A call's inputs do not match what the model was compiled for."""


class IndexRangeError(InputError, IndexError):
    """An input holds an index out of the range the model indexes with it (checked before
    any engine runs: :mod:`kiln.runtime.value_checks`); an ``IndexError``, as eager's is."""


class CompilerArgsError(KilnError, ValueError):
    """A compiler flag is unknown or not supported yet."""


# -- serving (kiln serve): each class maps to one HTTP status in kiln.serving.app --------------------
class BadRequestError(KilnError):
    """A malformed or mismatched inference request (HTTP 400): the client must change it."""


class BodyTooLargeError(KilnError):
    """A request body over the server's ``max_request_bytes`` (HTTP 413), refused as it streams
    in so that a huge body never fills memory."""


class BodyTimeoutError(KilnError):
    """A request body that did not arrive within the server's ``body_timeout_s`` (HTTP 408), so
    that slow or stalled clients cannot hold connections forever."""


class OverloadedError(KilnError):
    """A served model's queue is full (HTTP 503): the client should retry later, and the server
    answers at once instead of piling up work."""


class ModelUnavailableError(KilnError):
    """A served model is not ready yet, or the server is shutting down (HTTP 503)."""


class RequestTimeoutError(KilnError):
    """A request did not finish (queue + inference) within its timeout (HTTP 504)."""


class PlacementError(KilnError):
    """A core number or core setting (``KILN_VISIBLE_CORES``...) that this process cannot honour,
    or CPUs a worker cannot be pinned to."""


# -- the compile cache --------------------------------------------------------------------------
class CacheError(KilnError):
    """The compile cache's location cannot be used."""


class CachedFailure(KilnError):
    """This graph failed to compile before; the compile cache remembers it.

    Raised as a subclass of the original error's class too (see :func:`cached_failure`),
    so ``except CompileError`` catches a failure whether it is new or remembered."""


_CACHED_CLASSES: dict = {}


def cached_failure(class_name: str, message: str) -> CachedFailure:
    """A ``CachedFailure`` that is also an instance of the kiln error class ``class_name``
    (read back from the cache entry; a name that is not a kiln error gives a plain one)."""
    base = globals().get(class_name)
    if not (isinstance(base, type) and issubclass(base, KilnError)) or issubclass(base, CachedFailure):
        return CachedFailure(message)
    cls = _CACHED_CLASSES.get(base)
    if cls is None:
        cls = type(f"Cached{base.__name__}", (CachedFailure, base),
                   {"__module__": __name__, "__doc__": f"A remembered {base.__name__}."})
        _CACHED_CLASSES[base] = cls
    return cls(message)


class WorkerDiedError(KilnError):
    """A DataParallel replica process died or hung while holding a call."""
