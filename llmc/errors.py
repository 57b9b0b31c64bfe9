"""Typed errors for user mistakes, each mapped to a CLI exit code.

Internal invariants use `assert`; anything a user can cause (a bad spec, a missing file, a model
that does not match its ONNX export) raises one of these with a message that says what to change.
"""


class LlmcError(Exception):
    """Base class: a problem the user can act on. `exit_code` is what the CLI exits with."""

    exit_code = 1


class SpecError(LlmcError):
    """The build spec (model.yaml) is malformed or inconsistent."""

    exit_code = 2


class SourceError(LlmcError):
    """The model source (checkpoint dir / GGUF file) cannot be used."""

    exit_code = 3


class ExportError(LlmcError):
    """Export to ONNX failed."""

    exit_code = 4


class VerifyError(LlmcError):
    """The exported artifact does not reproduce the PyTorch model."""

    exit_code = 5


class ArtifactError(LlmcError):
    """A build folder or artifact is missing, incomplete or unreadable."""

    exit_code = 6


class UnsupportedError(LlmcError):
    """A valid request this version of llmc (or this machine) cannot carry out."""

    exit_code = 7


class ServingError(LlmcError):
    """The Triton server could not be started or reached, or it refused a request."""

    exit_code = 8


class QuantizationError(LlmcError):
    """The quantized model failed the spec's quality gate."""

    exit_code = 9


class EngineError(LlmcError):
    """TensorRT could not parse the prepared ONNX or build an engine from it."""

    exit_code = 10


class ExecutionEnvError(LlmcError):
    """The serving environment could not be made for the container's Python (execution_env)."""

    exit_code = 11


class ResourceError(LlmcError):
    """The build needs more of this machine (memory) than it has; the message says how much."""

    exit_code = 12
