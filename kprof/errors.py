"""The one exception type the library raises for problems a user can fix.

The CLI catches it once, prints it in red and exits non-zero. The message says what is wrong
and what to do next.
"""


class KprofError(Exception):
    """A user-facing error: bad input, missing run, impossible request."""

    def __init__(self, message: str, *, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
