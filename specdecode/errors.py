"""Errors that reach users. Each message says what to change."""


class SpecdecodeError(ValueError):
    """Base class: bad input or a bad checkpoint, reported with what to change."""


class ConfigError(SpecdecodeError):
    """A configuration value (model config, sampling parameters, speculative config) is invalid."""


class CheckpointError(SpecdecodeError):
    """A checkpoint directory is missing a file, has a corrupt file, or does not match its config."""


class IncompatibleDraftError(SpecdecodeError):
    """A draft model cannot be used with the target (different vocabulary or special tokens)."""
