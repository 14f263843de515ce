"""The worker extension vLLM mixes into its worker class (`worker_extension_cls`), reached via `LLM.collective_rpc`.

The driver uses it with every strategy: to install the runner taps (direct and taps strategies, taps.py), to poll
how many requests the sink has received, to flush and close the store writer before vLLM shuts down, and (online
training) to point the sink at the spool's next chunk and finish it. Method names carry a
`draftsmith_` prefix because vLLM refuses an extension that shadows a worker attribute.
"""

from __future__ import annotations

from typing import Any

from draftsmith.extract.vllm import sink as sink_module
from draftsmith.extract.vllm import taps

EXTENSION = f"{__name__}.DraftsmithWorkerExtension"


class DraftsmithWorkerExtension:
    vllm_config: Any  # the vLLM Worker this class extends has both
    model_runner: Any

    def draftsmith_install_taps(self, config: dict[str, Any], plan: dict[str, Any]) -> bool:
        """Direct and taps strategies: open the sink and tap the model runner (see taps.install)."""

        dp_rank = getattr(self.vllm_config.parallel_config, "data_parallel_rank", 0)
        config = sink_module.for_data_parallel_rank(config, dp_rank)
        sink = sink_module.activate(config, writes=sink_module.is_writer_rank())
        taps.install(self.model_runner, sink, taps.TapPlan.model_validate(plan))
        return True

    def draftsmith_progress(self) -> dict[str, Any]:
        sink = sink_module.active()
        return sink.progress() if sink is not None else {"received": 0, "error": None, "writes": False}

    def draftsmith_close(self) -> dict[str, Any]:
        return sink_module.deactivate()

    def draftsmith_open_store(self, path: str) -> bool:
        """Online training: the sink writes the spool's next chunk into the store at `path`."""
        sink = sink_module.active()
        if sink is None:
            return False
        sink.open_store(path)
        return True

    def draftsmith_finish_store(self) -> dict[str, Any]:
        sink = sink_module.active()
        return sink.finish_store() if sink is not None else {"received": 0, "error": None, "samples_written": 0}
