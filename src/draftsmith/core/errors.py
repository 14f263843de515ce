"""The one exception type for mistakes a user can fix.

Anything else that escapes is our bug and keeps its traceback (docs/architecture.md, user errors).
"""


class DraftsmithError(Exception):
    """A user-fixable problem: the message names the file, record or option and what to do."""


class DiskFullError(DraftsmithError):
    """No space left where draftsmith writes: found by its errno (ENOSPC) where the bytes are written
    (`core.fsio`), so a caller that must stop rather than retry -- the online feed -- asks for the type, never
    for words in a message."""
