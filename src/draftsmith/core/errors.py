"""The one exception type for mistakes a user can fix.

Anything else that escapes is our bug and keeps its traceback (docs/architecture.md, user errors).
"""


class DraftsmithError(Exception):
    """A user-fixable problem: the message names the file, record or option and what to do."""
