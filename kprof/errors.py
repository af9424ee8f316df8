"""The one exception type the library raises for problems a user can fix, and kprof's exit codes.

The CLI catches it once, prints it in red and exits with its code. The message is one line that
says what is wrong and what to do next; `detail` (the user's script's own traceback, say) is
printed above it as plain text.
"""

# kprof's exit codes (README, "Exit codes"): one meaning each, whatever the command.
OK = 0
SCRIPT_FAILED = 1  # the user's script raised or exited non-zero (its own code is in the message)
BAD_INPUT = 2  # bad arguments, missing/unreadable/unwritable files, runs or run stores
PATCH_FAILED = 3  # a patch failed verification under --strict, or the patched run diverged
INTERRUPTED = 130  # Ctrl-C or SIGTERM (128 + SIGINT, the shell's convention)


class KprofError(Exception):
    """A user-facing error: bad input, missing run, impossible request (exit code 2 unless said)."""

    def __init__(self, message: str, *, exit_code: int = BAD_INPUT, detail: str | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.detail = detail
