"""What a process whose target runs in a vLLM engine holds of the target on the host: peak RSS.

    python benchmarks/bench_engine_host.py [--no-readme]

``load_target(..., engine_for=...)`` as a rollout worker (or the capture CLI) calls it, the engine a
stand-in (the engine's own memory is its process's, not ours), each case in a fresh interpreter:

* "converted" (before 2026-11-29): the host copy loaded in the run's dtype, which materializes every
  weight of a checkpoint stored in another dtype;
* "checkpoint dtype" (2026-11-29): the host copy in the checkpoint's own dtype, memory-mapped, only
  the final norm and the embeddings converted (what a colocated train worker, which reads a decoder layer
  and digests the weights, still loads; the capture CLI did until fd80a21);
* "head only" (now: a rollout worker, and since fd80a21 an engine's capture into a store, whose
  fingerprint is read from the checkpoint's files): the module tree on the meta device, only the final
  norm, the output embedding and the input embeddings read from the safetensors.

Targets: the embedded default (SmolLM2-135M-Instruct, stored in fp32) in bf16 (``model.dtype=auto`` on
a CPU with bf16 instructions, and what a GPU run picks) and in fp32; the largest tiny target the tests
ship (``specforge/targets/tiny.py``), saved in fp32, run in bf16. Resident: the process's resident set
after the load less before it (after the imports); peak: its high-water mark (``ru_maxrss``) less the
resident set before the load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import append_section, header_markdown, markdown_table  # noqa: E402

CASE = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1])
import torch
import specforge.models.target as t
from specforge.config import load_config
cfg = load_config(sys.argv[2] or None, json.loads(sys.argv[3]))
def resident_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4


base, base_peak = resident_kib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[4] == "converted":  # the load before: the host copy in the run's dtype too
    run_dtype, real_family_of = t.pick_dtype(cfg.model.dtype, torch.device("cpu")), t.family_of

    class Family:
        def __init__(self, fam):
            self.fam = fam

        def __getattr__(self, name):
            return getattr(self.fam, name)

        def auto_class(self):
            cls = self.fam.auto_class()

            class Converted:
                @staticmethod
                def from_pretrained(path, dtype=None, **kw):
                    return cls.from_pretrained(path, dtype=run_dtype, **kw)

            return Converted

    t.family_of = lambda config: Family(real_family_of(config))
target = t.load_target(cfg.model, torch.device("cpu"), engine_for=lambda *a: "stand-in",
                       head_only=sys.argv[4] == "head only")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
params = sum(p.numel() for p in target.model.parameters())
print(json.dumps({"mib": (resident_kib() - base) / 1024, "peak_mib": (max(peak, base_peak) - base) / 1024,
                  "params": params}))
"""


def largest_tiny(root: Path) -> tuple[str, Path]:
    """The tiny family with the most parameters, saved in fp32 under ``root``."""
    import torch

    from specforge.targets import FAMILIES, tiny
    from tests.helpers.targets import target_folder

    sizes = {}
    for fam in FAMILIES:
        make = getattr(tiny, fam.name, None)
        if make is None:
            continue
        with torch.device("meta"):
            sizes[fam.name] = sum(p.numel() for p in fam.auto_class().from_config(make()).parameters())
    name = max(sizes, key=sizes.get)
    target_folder(name, root)
    return name, root


MODES = ("converted", "checkpoint dtype", "head only")


def run_case(config: str, overrides: list[str], mode: str) -> dict:
    repo = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", CASE, repo, config, json.dumps(overrides), mode],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    from tests.helpers.targets import overrides as tiny_overrides

    default = str(Path(__file__).resolve().parent.parent / "configs" / "smollm2-135m-cpu.yaml")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        name, root = largest_tiny(Path(tmp))
        cases = [("SmolLM2-135M (fp32 file)", default, ["model.dtype=bfloat16", "model.device=cpu"], "bf16"),
                 ("SmolLM2-135M (fp32 file)", default, ["model.dtype=float32", "model.device=cpu"], "fp32"),
                 (f"tiny {name} (fp32 file)", "", [*tiny_overrides(root), "model.dtype=bfloat16"], "bf16")]
        for label, config, over, run_dtype in cases:
            got = [run_case(config, over, mode) for mode in MODES]
            rows.append([label, run_dtype, f"{got[0]['params']:,}", *(f"{g['mib']:.1f}" for g in got),
                         *(f"{g['peak_mib']:.1f}" for g in got)])
    table = markdown_table(["target", "run dtype", "parameters", *(f"resident MiB, {m}" for m in MODES),
                            *(f"peak MiB, {m}" for m in MODES)], rows)
    print(table)
    if not args.no_readme:
        body = (f"`python benchmarks/bench_engine_host.py`: {__doc__.split(chr(10) + chr(10), 1)[1].strip()}\n\n"
                f"{header_markdown()}\n\n{table}")
        append_section("Target on the host beside a vLLM engine", body)


if __name__ == "__main__":
    main()
