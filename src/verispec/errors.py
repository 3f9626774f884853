"""The one exception type for a user's mistake.

:class:`UsageError` marks what the person calling verispec can fix: an argument out of range, an unknown
name, a missing or malformed file, a model that cannot do what was asked. The command line prints its
message as one line and exits with status 2 (a server answers 4xx); any other exception is a bug in
verispec or in a library beneath it, and is reported as one (with its traceback on request). It subclasses
ValueError, so code that catches bad values the standard way keeps working.
"""

__all__ = ["UsageError"]


class UsageError(ValueError):
    """A mistake of the caller's, with a message that says what to change (one line)."""
