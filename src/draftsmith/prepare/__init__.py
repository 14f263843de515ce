"""The prepare stage: conversations -> a prepared data set (token ids, assistant loss masks, token counts).

`run(cfg)` is in stage.py; the prepared set (the stage's artefact) is read and written only by dataset.py.
"""

from draftsmith.prepare.stage import run

__all__ = ["run"]
