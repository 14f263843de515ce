"""Conversations in, token ids and assistant loss masks out: readers, chat rendering, prepare, draft vocabulary."""
