"""`python -m draftsmith ...` (and `torchrun ... -m draftsmith train ...`): the same CLI as the console script."""

from draftsmith.cli import main

main()
