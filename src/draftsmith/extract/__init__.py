"""The extract stage: run the target over a prepared set and fill a hidden-state store.

`run(cfg)` is in stage.py; backends hf.py and vllm/; the store (the stage's artefact) is the store/ package.
This package imports nothing itself: importing one of its modules loads neither the stage nor its torch.
"""
