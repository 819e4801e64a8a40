"""The one error type users see: a message that names the file or option and what is wrong."""


class SpecPrefetchError(Exception):
    """A user-facing error. The CLI prints its message without a traceback and exits non-zero."""
