"""Every Triton kernel of ours compiles for a Hopper GPU (sm_90) here, on a CPU with no GPU.

The CPU tests run the kernels in Triton's interpreter, which checks their arithmetic but not what
only the compiler refuses: a kernel that read a plain float global (``LN2`` in ``losses_triton.py``)
passed every interpreter test and failed on the first lent H200 (2026-11-30). ``triton.compile`` of
the kernel's source for a ``cuda`` target needs no device (Triton's front end, its passes and the
bundled ptxas), so each kernel is compiled here for every constexpr variant our launches use, with the
argument types they pass. In a subprocess: the interpreter tests may have imported the kernels with
``TRITON_INTERPRET=1``, which replaces the jit functions; a fresh Triton cache, so nothing is read back.
Control: a kernel reading a plain float global fails to compile the same way; with the global a
``tl.constexpr`` it compiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed (Linux wheels only)")

SCRIPT = textwrap.dedent('''
    import json, sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    TARGET = GPUTarget("cuda", 90, 32)  # an H100 / H200

    def build(fn, signature, constexprs):
        try:
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET)
            return "ok"
        except Exception as e:  # the compiler's own error, reported by name and its last line
            return type(e).__name__ + ": " + (str(e).strip().splitlines() or [""])[-1][:300]

    def signature(fn, types):
        return {p.name: types[p.name] for p in fn.params if p.name not in CONSTEXPRS}

    CONSTEXPRS = ("BLOCK_N", "KIND", "G_BF16")
    results = {}
    if sys.argv[1] == "ours":
        from specforge.kernels import losses_triton, soft_ce_triton
        assert not losses_triton.INTERPRETED and not soft_ce_triton.INTERPRETED
        # the types the launches pass (soft_ce_triton.launch, losses_triton.launch): bf16 logits, fp32
        # teacher rows and statistics, int64 indices, int32 sizes (Triton's for a Python int < 2^31)
        common = {"z_ptr": "*bf16", "stride_z": "i32", "t_ptr": "*fp32", "stride_t": "i32", "tidx_ptr": "*i64",
                  "pred_ptr": "*i64", "accp_ptr": "*fp32", "stride_g": "i32", "N": "i32", "ce_ptr": "*fp32",
                  "loss_ptr": "*fp32", "nla_eps": "fp32", "lk_eta": "fp32", "verify_ptr": "*i64"}
        for g_bf16 in (True, False):
            types = {**common, "g_ptr": "*bf16" if g_bf16 else "*fp32"}
            k = soft_ce_triton.soft_ce_rows_kernel
            results[f"soft_ce g_bf16={g_bf16}"] = build(k, signature(k, types), {"BLOCK_N": 1024, "G_BF16": g_bf16})
            k = losses_triton.loss_rows_kernel
            for kind, code in losses_triton.CODES.items():
                results[f"{kind} g_bf16={g_bf16}"] = build(k, signature(k, types),
                                                           {"BLOCK_N": 1024, "KIND": code, "G_BF16": g_bf16})
    else:  # the control: the same one-line kernel with its global plain, then a constexpr
        HALF = 0.5
        HALF_C = tl.constexpr(0.5)

        @triton.jit
        def plain(x_ptr, BLOCK_N: tl.constexpr):
            offs = tl.arange(0, BLOCK_N)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs) * HALF)

        @triton.jit
        def constant(x_ptr, BLOCK_N: tl.constexpr):
            offs = tl.arange(0, BLOCK_N)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs) * HALF_C)

        for name, fn in (("plain", plain), ("constexpr", constant)):
            results[name] = build(fn, {"x_ptr": "*fp32"}, {"BLOCK_N": 128})
    print(json.dumps(results))
''')


def compile_in_subprocess(which: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile, never read a cached kernel back
    script = tmp_path / "compile.py"
    script.write_text(SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH", "")) if x)
    run = subprocess.run([sys.executable, str(script), which], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_kernel_of_ours_compiles_for_sm90_on_the_cpu(tmp_path):
    results = compile_in_subprocess("ours", tmp_path)
    assert len(results) == 2 * 7, results  # soft CE and the six other kinds, G in bf16 and fp32
    assert all(v == "ok" for v in results.values()), {k: v for k, v in results.items() if v != "ok"}


def test_the_compile_check_catches_a_global_the_interpreter_accepts(tmp_path):
    results = compile_in_subprocess("control", tmp_path)
    assert results["constexpr"] == "ok", results
    assert results["plain"].startswith("CompilationError") and "global variable" in results["plain"], results
