"""Exceptions vlserve raises on purpose. User mistakes subclass InvalidInputError (an HTTP 400 later)."""


class VlserveError(Exception):
    """Base class of every error vlserve raises deliberately."""


class InvalidInputError(VlserveError, ValueError):
    """The request itself is wrong: bad image, bad parameter, prompt too long, ..."""


class ModelLoadError(VlserveError):
    """A checkpoint cannot be loaded: missing file, corrupt weights, unsupported architecture."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's `architectures` names no model vlserve implements."""
