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


class CompilerArgsError(KilnError, ValueError):
    """A compiler flag is unknown or not supported yet."""
