"""Scripts run in vLLM's own venv (``scripts/install_vllm.sh``), for the tests that build vLLM's draft model
from our export with vLLM's parser, registry and loader (DFlash2's, DSpark's): the shared prelude and the
run. A script prints its JSON report last and writes its tensors to the result file."""

import json
import subprocess
from pathlib import Path

PRELUDE = r"""
import json, socket, sys
import torch
from safetensors.torch import load_file, save_file
from vllm.config import set_current_vllm_config
from vllm.config.vllm import VllmConfig
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.registry import ModelRegistry
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig


def engine_config(target, out, method, n):
    return EngineArgs(model=target, speculative_config={"model": out, "method": method, "num_speculative_tokens": n},
                      enforce_eager=True, dtype="float32", max_model_len=128,
                      skip_tokenizer_init=True).create_engine_config()


def one_rank():
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1, 1)


def draft_model(vc):  # in set_current_vllm_config(vc), on one rank: (draft model config, class, its name, model)
    one_rank()
    draft = vc.speculative_config.draft_model_config
    cls, resolved = ModelRegistry.resolve_model_cls(draft.hf_config.architectures, model_config=draft)
    return draft, cls, resolved, cls(vllm_config=vc, prefix="")
"""


def run_in_vllm(body: str, args: list, timeout: int = 600) -> tuple[dict, dict]:
    """Run ``PRELUDE + body`` with ``args`` in the vLLM venv; ``(its report, its result tensors)``: the
    result file is the last argument."""
    from safetensors.torch import load_file

    from specforge.models.vllm_engine import default_python

    python = default_python()
    assert python.exists(), "run bash scripts/install_vllm.sh (scripts/test.sh does)"
    proc = subprocess.run([str(python), "-c", PRELUDE + body, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), load_file(Path(args[-1]))


def run_probe(body: str, target_dir: Path, out: Path, n: int, probe: dict, tmp_path: Path) -> tuple[dict, dict]:
    """``run_in_vllm`` of a script reading ``(target, export, num_speculative_tokens, probe file, result
    file)``: ``probe``'s tensors saved for it first."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in probe.items()}, tmp_path / "probe.safetensors")
    return run_in_vllm(body, [target_dir, out, n, tmp_path / "probe.safetensors", tmp_path / "result.safetensors"])


STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def assert_loaded_as_saved(params: dict, saved: dict) -> None:
    """Every parameter of vLLM's draft (``params``: name -> tensor) is the export's tensor (q/k/v and gate/up
    stacked as vLLM stacks them), but the target's embedding / lm_head (none in the file, shared by vLLM's
    proposer) and the unused ``mask_embedding``; and every tensor of the export is one of them."""
    import torch

    used = set()
    for name, got in params.items():
        key = name.removeprefix("model.")
        if key in ("embed_tokens.weight", "mask_embedding") or name == "lm_head.weight":
            continue
        part = next((p for p in STACKED if f".{p}." in key), None)
        names = [key.replace(part, s) for s in STACKED[part]] if part else [key]
        assert torch.equal(got, torch.cat([saved[k] for k in names])), name
        used |= set(names)
    assert used == set(saved), set(saved) - used
