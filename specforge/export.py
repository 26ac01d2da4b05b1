"""Export a trained draft for the engine that will serve it.

    python -m specforge.export --draft runs/x/checkpoints/step-000400 --engine sglang --out served/sglang
    python -m specforge.export --draft runs/x/checkpoints --engine vllm --out served/vllm [--target HF]
    python -m specforge.export --draft runs/x/checkpoints --engine llama.cpp --out served/gguf \
        [--target HF_FOLDER] [--outtype f32|bf16|f16|q8_0]

``--draft`` is a checkpoint folder (``step-*``) or a checkpoint root (its ``latest``). Its config.json
names its algorithm; every engine starts from the checkpoint validated by that algorithm
(``check_checkpoint``), and the algorithm writes each engine's format (its ``export`` hook, in
``specforge/algorithms/<name>/export.py``); each engine's own contract is in docs/ENGINES.md:

* EAGLE-3: ``sglang`` = the checkpoint's config.json + model.safetensors, copied (no resume state);
  ``vllm`` = the ``speculators`` format, written by speculators' own converter, told our aux layer
  ids (renumbered) and residual convention.
* DFlash: z-lab's ``DFlashDraftModel`` folder, which SGLang (``--speculative-algorithm DFLASH``)
  and vLLM (``"method": "dflash"``) serve as it is (``--num-speculative-tokens`` defaults to the
  block size - 1).
* ``llama.cpp``: a GGUF written by llama.cpp's own converter (``engines/llamacpp.py``) from a staged
  copy whose config.json the algorithm writes (``llamacpp_config``).

``--target`` (vllm, llama.cpp; checked against the draft for sglang) is the target's HF folder or hub
id; default: the embedded default target (SmolLM2-135M-Instruct, converted once into the cache), the
one ``python -m specforge.train`` uses without a config. A checkpoint records its target's shape and
weights fingerprint, not its path, so a draft of another target needs ``--target``. The export checks
vocab, hidden size and layer count against the target (``specforge.compat``) and, for the default,
the fingerprint too; the error names what differs. ``--out`` must be new or empty (``--force``
replaces it); the export is written next to it and renamed into place, so a failed export leaves
nothing behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from specforge.compat import check_draft_shape, check_target_weights
from specforge.config import EMBEDDED_TARGET, ModelConfig
from specforge.engines import llamacpp, refusal_line
from specforge.engines.llamacpp import OUTTYPES  # what llama.cpp's converter writes itself
from specforge.registry import algorithm_of, read_draft_config
from specforge.seam import ExportRequest, Format

ENGINES = ("sglang", "vllm", "llama.cpp")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one ``error:`` line (cli.run_cli), not usage + message
        raise ValueError(f"{message} (see python -m specforge.export --help)")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = _Parser(prog="python -m specforge.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="checkpoint folder (step-*) or checkpoint root (uses latest)")
    ap.add_argument("--engine", required=True, help=f"one of {', '.join(ENGINES)}")
    ap.add_argument("--out", required=True, help="output folder (new or empty; --force replaces it)")
    ap.add_argument("--target", default=None, help="target HF folder or hub id (default: the embedded default)")
    ap.add_argument("--outtype", default=None, help="llama.cpp only: f32 (default) | bf16 | f16 | q8_0")
    ap.add_argument("--num-speculative-tokens", type=int, default=None,
                    help="vllm only: proposal length (EAGLE-3: written to the config, default 3; DFlash: "
                         "in the printed serve command, default block size - 1)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    args = ap.parse_args(argv)
    if args.engine not in ENGINES:
        raise ValueError(f"--engine {args.engine!r} is not supported; choose one of {', '.join(ENGINES)}")
    if args.outtype is not None and args.engine != "llama.cpp":
        raise ValueError(f"--outtype applies to --engine llama.cpp only (the {args.engine} export keeps "
                         "the checkpoint's torch_dtype)")
    if args.outtype is not None:
        if args.outtype not in OUTTYPES:
            raise ValueError(f"--outtype {args.outtype!r} is not supported; choose one of {', '.join(OUTTYPES)}")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens is {args.num_speculative_tokens}, expected at least 1")
    if args.num_speculative_tokens is not None and args.engine != "vllm":
        raise ValueError("--num-speculative-tokens applies to --engine vllm only (SGLang and llama.cpp "
                         "take the draft length as a server flag)")
    return args


# ---------------------------------------------------------------- target and output folder


def resolve_target(target: Optional[str]) -> tuple[str, Any]:
    """(HF folder or hub id, its transformers config); None = the embedded default target."""
    from specforge.models.target import (  # lazy: keeps specforge.export torch-free
        load_target_config,
        resolve_target_path,
    )

    cfg = ModelConfig(target_path=target or EMBEDDED_TARGET)
    try:
        return resolve_target_path(cfg), load_target_config(cfg)
    except ValueError as e:
        raise ValueError(f"--target: {str(e).replace('model.target_path ', '')}") from None


def check_target(draft: Path, target: str, target_config: Any, given: bool) -> None:
    """The draft belongs with this target (``specforge.compat``): its shape always; without
    ``--target`` also the weights fingerprint its training_state.pt records (the default target is
    small; a given one is the user's explicit choice and may be too large to load here)."""
    try:
        check_draft_shape(draft, read_draft_config(draft), target_config)
        if not given:
            note = check_target_weights(draft, _load_weights(target), allow=False)
            if note:
                print(f"note: {note}", file=sys.stderr)
    except ValueError as e:
        which = f"--target {target!r}" if given else f"no --target: the default target {target!r}"
        raise ValueError(f"{which}: " + str(e).replace("evaluate it with", "export it for")
                         .replace("(model.target_path / --target)", "(pass it as --target)")) from None


def _load_weights(target: str):
    import torch  # lazy: keeps specforge.export torch-free
    from transformers import AutoModelForCausalLM  # lazy: heavy (transformers)

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)


def start_output(out: Path, draft: Path, force: bool) -> Path:
    """A fresh temp folder beside ``out``, after refusing an ``out`` that must not be replaced."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; pass a folder path")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {str(out)!r} exists and is not empty; "
                         "choose a new folder or pass --force to replace it")
    here, there = out.resolve(), draft.resolve()
    if here == there or here in there.parents:
        raise ValueError(f"--out {str(out)!r} holds the checkpoint being exported; choose another folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))


def finish_output(tmp: Path, out: Path) -> None:
    """Rename the finished export into place (an old ``out`` is removed only after that)."""
    from specforge.training.checkpoint import make_readable  # lazy: keeps specforge.export torch-free

    make_readable(tmp)
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- per engine


def export_engine(args: argparse.Namespace, draft: Path, tmp: Path) -> str:
    """Write the export for ``args.engine`` into ``tmp``; returns the command that serves it. The
    checkpoint is checked first (its algorithm's ``check_checkpoint``: a bad one is named before any
    target loads), then the target, then the algorithm's own export (``llama.cpp``: its converter)."""
    draft_config = read_draft_config(draft)
    algo = algorithm_of(draft_config, repr(str(draft)))
    if args.engine not in algo.engines:
        raise ValueError(f"--engine {args.engine}: {refusal_line(algo, args.engine)}")
    if args.engine == "vllm" and importlib.util.find_spec("speculators") is None:  # before any target loads
        raise ValueError("--engine vllm: the vLLM format is written by speculators' converter, which is not "
                         "installed: pip install speculators==0.9.0 (bash scripts/install.sh installs it)")
    algo.check_checkpoint(draft)
    if args.engine == "sglang" and args.target is None:  # SGLang reads the folder alone: no target needed
        return algo.export(args.engine, draft, tmp, ExportRequest(Path(args.out), None))
    target, target_config = resolve_target(args.target)
    check_target(draft, target, target_config, given=args.target is not None)
    if args.engine == "llama.cpp":
        return export_gguf(args, draft, tmp, target, draft_config, algo)
    req = ExportRequest(Path(args.out), target, target_config, args.num_speculative_tokens)
    return algo.export(args.engine, draft, tmp, req)


def export_gguf(args: argparse.Namespace, draft: Path, tmp: Path, target: str, draft_config: dict, algo: Format) -> str:
    if not Path(target).is_dir():
        raise ValueError(f"--target {target!r} is not a local folder: llama.cpp's converter reads the target's "
                         "HF folder (config, tokenizer, embedding); download it and pass --target <folder>")
    outtype = args.outtype or "f32"
    name = f"draft-{outtype}.gguf"
    llamacpp.convert_draft(draft, target, tmp / name, outtype=outtype)
    n_max = algo.tokens_per_round(draft_config)
    return (f"llama-server -m <target.gguf> -md {Path(args.out) / name} --spec-type {algo.llamacpp_spec_type} "
            f"--spec-draft-n-max {n_max}")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from specforge.engines.sglang import resolve_checkpoint  # lazy: keeps specforge.export torch-free

    draft, out = resolve_checkpoint(args.draft), Path(args.out)
    tmp = start_output(out, draft, args.force)
    try:
        serve = export_engine(args, draft, tmp)
        finish_output(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported {draft} for {args.engine} to {out}\nserve it with: {serve}")
    return 0


if __name__ == "__main__":
    from specforge.cli import run_cli

    sys.exit(run_cli(main))
