"""draftsmith's KV connector for vLLM's `extract_hidden_states` method: finished requests' states go to the store.

vLLM loads this module itself, in its scheduler and worker processes, from
`KVTransferConfig(kv_connector="DraftsmithStoreConnector", kv_connector_module_path=__name__)`
(the probe checked both that method and that field exist). With `extract_hidden_states`, vLLM's target writes
the aux layers of every prompt token into a cache-only attention layer (`cache_only_layers.<N>`), whose KV cache
is laid out [blocks, layers, block_size, H]. This connector:

- scheduler side: when a request carrying a draftsmith sample id finishes, keeps its blocks alive
  (`request_finished` returns True) and passes (sample id, token ids, block ids) to the worker in the next
  step's metadata;
- worker side: gathers the request's rows from that cache (from the first token it does not share with its parent:
  with prefix caching, a cached block holds the states of the request that computed it), copies them to the CPU (a plain synchronous copy:
  no CUDA streams or pinned memory, so CPU and GPU run the same code), hands them to the store sink and reports
  the request done, which frees its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from draftsmith.extract.vllm import sink as sink_module
from draftsmith.extract.vllm.sink import EXTRA_CONFIG_KEY

try:  # connectors that declare SupportsHMA get one block list per KV cache group (hybrid allocator)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM: plain block lists

    class SupportsHMA:  # type: ignore[no-redef]  # a stand-in where vLLM has none
        pass


if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CACHE_LAYER_PREFIX = "cache_only_layers"


@dataclass
class PendingSample:
    req_id: str
    sample_id: int
    token_ids: list[int]
    block_ids: list[int]
    parent: int = -1
    shared: int = 0


@dataclass
class DraftsmithConnectorMetadata(KVConnectorMetadata):
    pending: list[PendingSample] = field(default_factory=list)


def _hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV cache group that holds the extracted hidden states (0 when there is one group)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    try:
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec
    except ImportError:
        return 0
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) <= 1:
        return 0
    for i, g in enumerate(groups):  # several groups, hidden states sharing one: find it by layer name
        if any(CACHE_LAYER_PREFIX in name for name in getattr(g, "layer_names", [])):
            return i
    raise RuntimeError(
        f"draftsmith connector: cannot tell which of {len(groups)} KV cache groups holds the hidden states"
    )


def gather_rows(
    cache: torch.Tensor, block_ids: list[int], num_tokens: int, num_layers: int, start: int = 0
) -> torch.Tensor:
    """Rows start..num_tokens-1 of a request from a hidden-state cache [blocks, L, bs, H] (or [blocks, bs, L, H])."""
    layers_first = cache.shape[1] == num_layers  # [blocks, L, bs, H]
    block_size = cache.shape[2] if layers_first else cache.shape[1]
    pos = torch.arange(start, num_tokens)
    blocks = torch.as_tensor(block_ids, dtype=torch.long)[pos // block_size].to(cache.device)
    offs = (pos % block_size).to(cache.device)
    return cache[blocks, :, offs] if layers_first else cache[blocks, offs]  # [T, L, H]


class DraftsmithStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: never loads KV, saves each finished request's hidden states into the store."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        if kv_cache_config is not None:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        else:  # older vLLM: two-argument constructor
            super().__init__(vllm_config=vllm_config, role=role)  # type: ignore[call-arg]  # older vLLM's signature
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        raw = extra.get(EXTRA_CONFIG_KEY)  # a SinkConfig's dump (driver.engine_kwargs)
        self._config = sink_module.SinkConfig.model_validate(raw) if raw else None
        self._num_layers = len(self._config.spec.layer_ids) if self._config else None
        self._group = _hidden_state_group(kv_cache_config)
        # scheduler side
        self._pending: list[PendingSample] = []
        # worker side
        self._cache: torch.Tensor | None = None
        self._sink: sink_module.StoreSink | None = None
        self._done: set[str] = set()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = [n for n in kv_caches if CACHE_LAYER_PREFIX in n]
        if len(names) != 1:
            raise RuntimeError(
                f"draftsmith connector: expected one {CACHE_LAYER_PREFIX} KV cache (vLLM's "
                f"extract_hidden_states method), found {names or 'none'}"
            )
        self._cache = kv_caches[names[0]]
        dp_rank = getattr(self._vllm_config.parallel_config, "data_parallel_rank", 0)
        assert self._config is not None, "draftsmith connector: no sink config in kv_connector_extra_config"
        config = self._config.for_data_parallel_rank(dp_rank)
        self._sink = sink_module.activate(config, writes=sink_module.is_writer_rank())

    def start_load_kv(self, forward_context: object, **kwargs: object) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object, **kwargs: object) -> None:
        return None  # the states are already in the cache; they are read once the request has finished

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, DraftsmithConnectorMetadata):
                for item in meta.pending:
                    self._save(item)
        done, self._done = self._done, set()
        return done or None, None

    def _save(self, item: PendingSample) -> None:
        assert self._cache is not None and self._sink is not None
        if self._sink.writes:
            num_layers = self._num_layers or self._cache.shape[1]
            states = gather_rows(self._cache, item.block_ids, len(item.token_ids), num_layers, item.shared)
            parts = [self._sink.to_host(list(states.unbind(1)))]
        else:
            parts = []
        self._sink.put(item.sample_id, item.token_ids, parts, item.parent, item.shared)
        self._done.add(item.req_id)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: object, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: object) -> KVConnectorMetadata:
        meta = DraftsmithConnectorMetadata(pending=self._pending)
        self._pending = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        tag = sink_module.read_tag(getattr(request, "kv_transfer_params", None))
        if tag is None or not block_ids:
            return False, None  # not ours (e.g. a plain request), or never scheduled
        token_ids = list(request.prompt_token_ids or [])
        sample_id, parent, shared = tag
        self._pending.append(PendingSample(request.request_id, sample_id, token_ids, list(block_ids), parent, shared))
        return True, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])
