"""The KV-transfer connector our vLLM engines load (``kv_connector_module_path``): it runs INSIDE the
vLLM server process, in vLLM's own venv (``scripts/install_vllm.sh``), and imports nothing of
specforge. With vLLM's ``extract_hidden_states`` speculative method, the hidden states of the
layers we ask for are cached per token beside the KV cache; when a request finishes this connector
writes them (``[tokens, layers, hidden]``, the model dtype, plus ``token_ids``) to
``<shared_storage_path>/<request id>.safetensors`` and vLLM returns that path in the response's
``kv_transfer_params["hidden_states_path"]``. ``specforge.models.vllm_engine`` reads and deletes it.
Of specforge it imports ``models/handoff.py`` only (torch and safetensors): how a file is written and
how a failed write is told.

What it changes in vLLM's reference ``ExampleHiddenStatesConnector``:

* On a CPU the reference cannot run (pinned host memory, CUDA streams and events): the rows are
  gathered from the cache and written synchronously in the engine step that extracts them.
  On a GPU the reference's asynchronous device-to-host copy and writer threads stay as they are.
* A file appears complete or not at all (written under a temporary name, then renamed), so a client
  waits for the path alone (the rename wakes it: ``specforge.models.arrivals``), without the
  reference's lock files (``use_synchronization_lock: false``). A write that fails leaves no ``.part``
  and puts the error at the path (``handoff.save_atomically``): the client raises it at once, and
  the engine goes on.
* ``shared_storage_path`` is a shared-memory folder (``/dev/shm``) where it holds the requests in
  flight: nothing round-trips through a disk (``handoff.pick_folder``).
"""

from __future__ import annotations

import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from specforge.models.handoff import DISCARD, origin, save_atomically  # torch and safetensors only

_ORIGIN: dict = {}  # what every file's header names (SpecforgeHiddenStatesConnector.__init__)


class _Done:
    """Stands in for the reference's CUDA event where nothing is in flight (the CPU path)."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class SpecforgeHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's hidden-states connector, working on a CPU too, writing each file atomically, each file
    naming the model the engine serves and the layers it captures (from the engine's own config)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spec = vllm_config.speculative_config.draft_model_config.hf_config
        global _ORIGIN  # the writer thread's static method reads it (one engine per process)
        _ORIGIN = origin(vllm_config.model_config.model, spec.eagle_aux_hidden_state_layer_ids)

    def request_finished(self, request, block_ids):
        """A request that asked for no hidden states (``kv_transfer_params: {"specforge_discard": true}``:
        a generation, whose states the client would only delete) is not saved: nothing is copied, written
        or returned; its blocks are freed at once. Every other request as vLLM's reference connector does."""
        if (request.kv_transfer_params or {}).get(DISCARD):
            self._request_filenames.pop(request.request_id, None)
            return False, None
        return super().request_finished(request, block_ids)

    @staticmethod
    def _write_tensors(tensors, event, filename, lock_fd) -> None:  # the GPU path's writer thread
        try:
            event.synchronize()
            save_atomically(tensors, filename, _ORIGIN)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is not None and self._kv_cache.device.type == "cuda":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None, "the hidden-states cache was never registered"
        dev = self._kv_cache.device  # the CPU here: the slots index the cache where it lives
        blocks = torch.tensor(pending.block_ids, dtype=torch.long, device=dev)
        slots = (torch.arange(self._block_size, dtype=torch.long, device=dev)[None, :]
                 + blocks[:, None] * self._block_size).flatten()
        num_tokens = int(pending.token_ids.shape[0])
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens)  # a gather: already a copy
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        save_atomically({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename, _ORIGIN)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
