"""XPress has no engine: ``python -m specforge.export`` refuses vLLM, SGLang and llama.cpp, each in one
``error:`` line (tests/test_xpress_train.py, on a trained checkpoint), and the algorithm's hook names
why (``NO_ENGINE``). The premise is checked against the engines installed here, so that this test
fails when one of them gains XPress (then write its export):

* vLLM 0.32 (its venv, ``scripts/install_vllm.sh``): its speculators config parser registers no
  ``xpress`` type and its model registry no ``XPressDraftModel``; the same lookups find DFlash2's
  (``dflash2``, ``DFlash2DraftModel``: the positive control, the checks can succeed).
* llama.cpp (build 11434, ``scripts/install_llamacpp.sh``): its converter's architecture table has
  no ``XPressDraftModel`` and has ``DFlash2DraftModel`` (the control).
"""

import json
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(600)]


def test_the_hook_names_why_no_engine_serves_it():
    from specforge.registry import get_algorithm

    algo = get_algorithm("xpress")
    assert algo.engines == () and algo.llamacpp_spec_type is None and algo.gguf_architecture is None
    for engine, why in (("vllm", "vLLM has no XPress model"), ("sglang", "SGLang has no XPress drafting"),
                        ("llama.cpp", "llama.cpp has no XPress drafting")):
        with pytest.raises(ValueError, match=f"^--engine {re.escape(engine)}: {why}") as e:
            algo.export(engine, Path("unused"), Path("unused"), None)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="llama.cpp has no XPress drafting"):
        algo.llamacpp_config({}, {})


VLLM_SCRIPT = r"""
import json
from vllm.model_executor.models.registry import ModelRegistry
from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES
print(json.dumps({"types": sorted(SUPPORTED_SPECULATORS_TYPES),
                  "archs": sorted(a for a in ModelRegistry.get_supported_archs() if "DraftModel" in a)}))
"""


@pytest.mark.usefixtures("vllm_python")
def test_vllm_has_no_xpress_model():
    from specforge.models.vllm_engine import default_python

    python = default_python()
    assert python.exists(), "run bash scripts/install_vllm.sh (scripts/test.sh does)"
    proc = subprocess.run([str(python), "-c", VLLM_SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "dflash2" in got["types"] and "DFlash2DraftModel" in got["archs"], got  # the lookups work
    assert not [t for t in got["types"] if "xpress" in t.lower()], got
    assert not [a for a in got["archs"] if "xpress" in a.lower()], got


def test_llamacpp_converter_has_no_xpress_model():
    from specforge.engines.llamacpp import find_converter

    table = (find_converter().parent / "conversion" / "__init__.py").read_text()
    assert '"DFlash2DraftModel"' in table  # the control: a DFlash-family draft it does convert
    assert "xpress" not in table.lower()
