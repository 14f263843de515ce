"""The worker extension vLLM mixes into its worker class (`worker_extension_cls`), reached via `LLM.collective_rpc`.

The driver uses it with every strategy: to install the runner taps (direct and taps strategies, taps.py), to poll
how many requests the sink has received, to flush and close the store writer before vLLM shuts down, and (online
training) to point the sink at the spool's next chunk and finish it. Method names carry a
`draftsmith_` prefix because vLLM refuses an extension that shadows a worker attribute. What crosses is plain data:
the sink's config and tap plan in, its `SinkReport` out, each as `model_dump(mode="json")`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import JsonValue

from draftsmith.extract.vllm import sink as sink_module
from draftsmith.extract.vllm import taps

if TYPE_CHECKING:
    from vllm.config import VllmConfig

EXTENSION = f"{__name__}.DraftsmithWorkerExtension"


class DraftsmithWorkerExtension:
    vllm_config: VllmConfig  # the vLLM Worker this class extends has both
    model_runner: Any  # GPUModelRunner or a subclass, whose methods taps.install replaces

    def draftsmith_install_taps(self, config: dict[str, JsonValue], plan: dict[str, JsonValue]) -> bool:
        """Direct and taps strategies: open the sink (`config`: a SinkConfig's dump) and tap the model runner (see
        taps.install; `plan`: a TapPlan's)."""
        dp_rank = getattr(self.vllm_config.parallel_config, "data_parallel_rank", 0)
        sink_config = sink_module.SinkConfig.model_validate(config).for_data_parallel_rank(dp_rank)
        sink = sink_module.activate(sink_config, writes=sink_module.is_writer_rank())
        taps.install(self.model_runner, sink, taps.TapPlan.model_validate(plan))
        return True

    def draftsmith_progress(self) -> dict[str, JsonValue]:
        sink = sink_module.active()
        return (sink.progress() if sink is not None else sink_module.SinkReport()).model_dump(mode="json")

    def draftsmith_close(self) -> dict[str, JsonValue]:
        return sink_module.deactivate().model_dump(mode="json")

    def draftsmith_open_store(self, path: str) -> bool:
        """Online training: the sink writes the spool's next chunk into the store at `path`."""
        sink = sink_module.active()
        if sink is None:
            return False
        sink.open_store(path)
        return True

    def draftsmith_finish_store(self) -> dict[str, JsonValue]:
        sink = sink_module.active()
        return (sink.finish_store() if sink is not None else sink_module.SinkReport()).model_dump(mode="json")
