"""``rollout.backend=vllm``: the target's hidden states computed by a vLLM engine.

The engine is vLLM's OpenAI server (``vllm serve``), run from vLLM's own venv
(``scripts/install_vllm.sh``: vLLM pins its own transformers), with vLLM's ``extract_hidden_states``
speculative method and our connector (``models/vllm_connector.py``), which writes each request's
hidden states to a shared-memory folder (``/dev/shm``: no disk round trip). A capture sends every
sample of a batch at once as a token-id prompt with ``max_tokens=1`` (vLLM batches them, with its
tensor/expert parallelism inside), reads each file back and deletes it. Why a server and not an
in-process engine: vLLM cannot share our venv; the server is what users already run (so
``rollout.vllm_endpoint`` points at theirs with the same code path), and a crashed engine is a dead
process the rollout worker sees, not a corrupted interpreter.

THE layer-numbering convention (written once, here). Our layer id k (``model.aux_layer_ids``,
SGLang's) is the OUTPUT of decoder layer k, i.e. transformers' ``hidden_states[k + 1]``. vLLM's
``eagle_aux_hidden_state_layer_ids`` count layers done: id j is the residual stream after j layers
(``hidden_states + residual`` at the input of layer j). So ours k = vLLM's k + 1, and vLLM's id
``num_hidden_layers`` is the last layer's output before the final norm, which we also ask for: the
final norm (``TargetModel``'s, applied in this process) gives the last hidden state, the lm_head its
argmax. ``vllm_layer_ids`` is the one function that converts.

Bytes: what vLLM writes per token is (K + 1) x hidden in the model dtype, the same as the
transformers capture keeps; the server's own memory is ``rollout.vllm_*`` (the dry run counts it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from specforge.children import guarded
from specforge.config import engine_start_timeout
from specforge.device import engine_gpu_ids
from specforge.files import check_writable
from specforge.jsonhttp import PORT_TRIES, HttpFailure, free_port, post_json, wait_healthy
from specforge.models import handoff
from specforge.models.arrivals import Arrivals
from specforge.targets import read_config_json, text_config

INSTALL = "bash scripts/install_vllm.sh"
SERVED_NAME = "target"
CONNECTOR = "SpecforgeHiddenStatesConnector"
CONNECTOR_MODULE = "specforge.models.vllm_connector"
REPO_ROOT = Path(__file__).resolve().parents[2]  # where `specforge` imports from in the engine's venv
ENDPOINT_WAIT_S = 10.0  # rollout.vllm_endpoint: how long its /health may take to answer
REQUEST_TIMEOUT_S = 600.0  # one request (a whole batch is in flight at once on a slow CPU)


class EngineError(ValueError):
    """The engine could not start, or stopped answering: the message says why in one line (a ValueError:
    every entry point prints it as its one ``error:`` line)."""


def vllm_layer_ids(our_ids: Sequence[int], num_layers: int) -> list[int]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` for our layer ids, plus the final pre-norm layer."""
    bad = [k for k in our_ids if not 0 <= k < num_layers]
    if bad:
        raise ValueError(f"config key 'model.aux_layer_ids': layer {bad[0]} is not a layer of this target "
                         f"(0..{num_layers - 1})")
    return [k + 1 for k in our_ids] + [num_layers]


def default_python() -> Path:
    return Path(os.environ.get("SPECFORGE_VLLM_PYTHON") or Path("~/.cache/specforge/vllm/bin/python").expanduser())


def engine_python(configured: Optional[str]) -> Path:
    """The vLLM venv's python, or EngineError naming the install script."""
    py = Path(configured).expanduser() if configured else default_python()
    if not py.exists():
        raise EngineError(f"rollout.backend=vllm: vLLM is not installed ({py} does not exist): run {INSTALL} "
                          "(or set rollout.vllm_python to the python of a venv that has vllm)")
    return py


@dataclass
class EngineSpec:
    """Everything that decides the engine's command line (a run's ``rollout.*`` keys, resolved)."""

    model_path: str
    layer_ids: list[int]  # vLLM's (``vllm_layer_ids``)
    dtype: torch.dtype
    max_model_len: int
    device: str = "cpu"  # "cpu" or "cuda"
    tp_size: int = 1
    expert_parallel: bool = False
    gpu_memory_utilization: float = 0.85
    cpu_kvcache_gib: float = 1.0
    startup_timeout_s: float = 600.0
    extra_args: list[str] = field(default_factory=list)
    trust_remote_code: bool = False
    python: Optional[str] = None
    gpus: Optional[list[str]] = None  # CUDA_VISIBLE_DEVICES of the engine (device.engine_gpu_ids); None: inherited
    hidden_size: Optional[int] = None  # the target's, from its config.json: sizes the hand-off (None: a hub id)

    def handoff_bytes(self) -> int:
        """What the hand-off folder may hold at once: ``MAX_INFLIGHT`` requests of ``max_model_len`` tokens."""
        if self.hidden_size is None:
            return 0
        return handoff.MAX_INFLIGHT * handoff.request_bytes(self.max_model_len, len(self.served_ids),
                                                            self.hidden_size, self.dtype)

    @property
    def served_ids(self) -> list[int]:
        """The layer ids the engine captures: each once (a small target's default ids repeat a layer,
        or name the last layer, whose output is the final pre-norm state; vLLM captures a repeated id
        once and then fails on the count)."""
        return list(dict.fromkeys(self.layer_ids))

    def command(self, port: int, storage: str, python: str = "python", host: str = "127.0.0.1") -> list[str]:
        spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.served_ids}}}
        kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": storage, "use_synchronization_lock": False}}
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
               "--served-model-name", SERVED_NAME, "--host", host, "--port", str(port),
               "--dtype", str(self.dtype).removeprefix("torch."), "--max-model-len", str(self.max_model_len),
               "--no-enable-prefix-caching", "--skip-tokenizer-init", "--tensor-parallel-size", str(self.tp_size),
               "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
        if self.expert_parallel:
            cmd.append("--enable-expert-parallel")
        if self.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.trust_remote_code:
            cmd.append("--trust-remote-code")
        return cmd + list(self.extra_args)

    def env(self, python: Optional[Path] = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        if self.gpus is not None:  # exactly this worker's GPUs, whatever this process itself sees
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.cpu_kvcache_gib))))
            iomp = intel_openmp(python) if python is not None else None
            if iomp is not None and iomp.exists() and "LD_PRELOAD" not in env:
                env["LD_PRELOAD"] = str(iomp)
            if self.tp_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
                # its automatic binding wants a NUMA node per rank: give each rank its share of our cores
                env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(sorted(os.sched_getaffinity(0)), self.tp_size)
        return env


def intel_openmp(python: Path) -> Path:
    """The Intel OpenMP library vLLM's CPU backend asks to be preloaded: its wheel ships it in the lib/ of the
    venv whose ``python`` runs the engine."""
    return python.parent.parent / "lib" / "libiomp5.so"


def cpu_binding(cores: Sequence[int], ranks: int) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``ranks`` engine ranks an equal share of
    ``cores`` (at least one each; ranks beyond the cores share them round-robin)."""
    per = max(1, len(cores) // ranks)
    shares = [cores[(i * per) % len(cores):][:per] for i in range(ranks)]
    return "|".join(",".join(map(str, share)) for share in shares)


# The engine runs under a guard (``children.guarded``) in a new session: when the process that started it
# goes (even by SIGKILL, or Ray's kill of an actor's children), or close() signals the guard's front, or the
# server itself dies, the guard kills the engine's whole process group at once (vLLM's server catches
# SIGTERM and, while it starts, neither exits nor stops its engine core and workers, which an orphaned
# server leaves running) and removes the shared memory vLLM's processes left in /dev/shm (its message
# queues; Intel OpenMP's registration files).


class VllmEngine:
    """A vLLM server this process started (``spec``), or one the user runs (``endpoint``). The engine
    writes each request's hidden states under ``storage_root`` (default: shared memory); this process
    reads them from the path each answer names, so any folder both see at the same path will do."""

    def __init__(self, spec: EngineSpec, endpoint: Optional[str] = None, log_dir: Optional[str] = None,
                 storage_root: Optional[str] = None):
        self.spec = spec
        self.proc: Optional[subprocess.Popen] = None
        self.storage: Optional[str] = None
        self.log_path: Optional[Path] = None
        self.arrivals = Arrivals()  # the request threads sleep until their file is renamed into place
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # submit's request threads
        self._swept = False  # a user's engine's folder: swept of stale files at the first answer
        if endpoint is not None:  # the user's engine: it answers now or the run stops here
            self.url = endpoint.rstrip("/")
            self._wait_ready(deadline=time.monotonic() + ENDPOINT_WAIT_S)
            return
        python = engine_python(spec.python)
        logs = Path(log_dir) if log_dir else Path(tempfile.gettempdir()) / "specforge-vllm-logs"  # kept after close
        logs.mkdir(parents=True, exist_ok=True)
        root, note = handoff.pick_folder(spec.handoff_bytes(), storage_root)
        if note:
            print(note, file=sys.stderr, flush=True)
        handoff.sweep(root)  # the folders of engines whose owner is gone (a killed worker never closed its own)
        deadline = time.monotonic() + spec.startup_timeout_s
        for attempt in range(PORT_TRIES):
            self.storage = handoff.engine_folder(root)
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.log_path = logs / f"vllm-{port}.log"
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(guarded(spec.command(port, self.storage, str(python))),
                                             env=spec.env(python), stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.storage,
                                             start_new_session=True)
            try:
                self._wait_ready(deadline=deadline)
                return
            except EngineError:
                taken = attempt + 1 < PORT_TRIES and self._port_was_taken()
                if not taken:
                    self.close()
                    raise
                self._stop()  # the port another process took between our pick and vLLM's bind: pick again
            except BaseException:
                self.close()
                raise

    def _port_was_taken(self) -> bool:
        """Whether the engine exited because its port was in use (its log says so)."""
        if self.proc is None or self.proc.poll() is None or self.log_path is None or not self.log_path.exists():
            return False
        return "Address already in use" in self.log_path.read_text(errors="replace")

    # ------------------------------------------------------------------ life

    def _why_dead(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "no log"
        lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        causes = [ln for ln in lines if re.search(r"\b\w*(Error|Exception): ", ln) and " WARNING " not in ln]
        # (the root cause comes first)
        errors = [ln for ln in lines if "error" in ln.lower()]
        line = causes[0] if causes else (errors or lines or ["empty log"])[-1]
        if "ValidationError" in line:  # pydantic puts the reason on a line of its own below the count
            line += ": " + next((ln for ln in lines[lines.index(line) + 1:] if ln.startswith("Value error")), "")
        return line[-300:] + f" (log: {self.log_path})"

    def _wait_ready(self, deadline: float) -> None:
        state = wait_healthy(f"{self.url}/health", deadline,
                             exited=lambda: self.proc is not None and self.proc.poll() is not None)
        if state == "exited":
            raise EngineError(f"rollout.backend=vllm: the vLLM engine for {self.spec.model_path} exited "
                              f"({self.proc.returncode}) while starting: {self._why_dead()}")
        if state == "timeout" and self.proc is None:
            raise EngineError(f"config key 'rollout.vllm_endpoint'={self.url!r}: no vLLM engine answers at "
                              f"{self.url}/health; start one (python -m specforge.capture --config ... "
                              "--vllm-command PORT prints the command) or unset rollout.vllm_endpoint")
        if state == "timeout":
            raise EngineError(f"rollout.backend=vllm: the vLLM engine did not become ready within "
                              f"{self.spec.startup_timeout_s:g} s (rollout.vllm_startup_timeout_s, by default "
                              f"parallel.setup_timeout_s): {self._why_dead()}")

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def close(self) -> None:
        """Stop the server and every process it started (its own process group: vLLM's engine core
        and workers outlive a server that exits on SIGTERM unless the group goes too)."""
        self._stop()
        if getattr(self, "arrivals", None) is not None:
            self.arrivals.close()
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _stop(self) -> None:
        """The server's process group and its hand-off folder go (the client's watcher stays)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(Exception):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                with contextlib.suppress(Exception):
                    self.proc.wait(timeout=30)
            with contextlib.suppress(Exception):
                os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=10)
        self.proc = None
        if self.storage is not None:
            shutil.rmtree(self.storage, ignore_errors=True)
            self.storage = None

    def __del__(self):
        try:  # at interpreter exit the module's globals (contextlib too) may be gone already
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ capture

    def _post(self, body: dict) -> dict:
        try:
            return post_json(f"{self.url}/v1/completions", body, REQUEST_TIMEOUT_S)
        except HttpFailure as e:
            if e.code is not None:
                why = f"{e.code}: {e.detail}"
                if e.code >= 500 and self.proc is not None:  # the engine failed: its log says why
                    why = self._why_dead()
                raise EngineError(f"rollout.backend=vllm: the engine failed a request ({why})") from None
            raise EngineError(f"rollout.backend=vllm: the vLLM engine at {self.url} stopped answering ({e.detail}); "
                              f"{self._why_dead() if self.proc is not None else 'the endpoint is down'}") from None

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int,
                 stop_ids: Sequence[int]) -> tuple[list[int], str]:
        """One completion of the token ids ``ids``: (output ids, "stop" | "length"). The stop token,
        when one ends it, is the output's last id (as ``models.generate`` returns it)."""
        out = self._post({"model": SERVED_NAME, "prompt": list(map(int, ids)), "max_tokens": int(max_new_tokens),
                          "temperature": float(temperature), "top_p": float(top_p), "seed": int(seed),
                          "stop_token_ids": sorted(map(int, stop_ids)), "include_stop_str_in_output": True,
                          "skip_special_tokens": False, "return_token_ids": True, "detokenize": False,
                          "kv_transfer_params": {handoff.DISCARD: True}})  # its states are not wanted
        self._discard((out.get("kv_transfer_params") or {}).get("hidden_states_path"))
        choice = out["choices"][0]
        tokens = [int(t) for t in (choice.get("token_ids") or [])]
        return tokens, "length" if choice.get("finish_reason") == "length" else "stop"

    def _discard(self, path: Optional[str]) -> None:
        """A generation's hidden states, where an engine wrote them all the same (a user's endpoint started
        with an older connector): not needed."""
        if path is None:
            return
        self.arrivals.wait(path, 30, self.alive)
        with contextlib.suppress(Exception):
            os.remove(path)

    def _one(self, ids: list[int]) -> torch.Tensor:
        out = self._post({"model": SERVED_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0.0})
        path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
        if path is None:
            raise EngineError("rollout.backend=vllm: the engine returned no hidden states: it was not started with "
                              f"the {CONNECTOR} connector and extract_hidden_states (start it with the command "
                              "`python -m specforge.capture --config ... --vllm-command` prints)")
        if self.proc is None and not self._swept:  # a user's engine: its fixed folder outlives every client
            self._swept = True
            handoff.sweep_stale(os.path.dirname(path), 2 * REQUEST_TIMEOUT_S)
        # the connector writes it in the step after the request finished (renamed into place when complete)
        if not self.arrivals.wait(path, REQUEST_TIMEOUT_S, self.alive):
            raise EngineError(f"rollout.backend=vllm: the engine never wrote {path}: {self._why_dead()}")
        try:
            data, meta = handoff.read(path)
        except handoff.HandoffFailed as e:  # told at once: the connector could not write this request's file
            raise EngineError(f"rollout.backend=vllm: the engine could not write a request's hidden states into "
                              f"{os.path.dirname(path)} ({e}): give the hand-off room (config key "
                              "'rollout.vllm_storage': a folder with more free space)") from None
        finally:
            with contextlib.suppress(Exception):
                os.remove(path)
        if data["token_ids"].tolist() != ids:
            raise EngineError("rollout.backend=vllm: the engine's hidden states belong to other tokens than sent")
        self._check_origin(meta)
        hs, served = data["hidden_states"], self.spec.served_ids
        if hs.shape[1] != len(served):
            raise EngineError(f"rollout.backend=vllm: the engine captures {hs.shape[1]} layers, this run needs "
                              f"{len(served)} (vLLM ids {served}): start it with the command `python -m "
                              "specforge.capture --config ... --vllm-command PORT` prints for this config")
        if served != self.spec.layer_ids:
            hs = hs[:, [served.index(j) for j in self.spec.layer_ids]]
        return hs

    def _check_origin(self, meta: dict) -> None:
        """The file's header names the engine's model and captured layers (the connector writes them from
        the engine's own config): another engine's states (an endpoint started for another config) are
        refused in one line, never trained on."""
        served = ",".join(map(str, self.spec.served_ids))
        start = ("start it with the command `python -m specforge.capture --config ... --vllm-command PORT` prints "
                 "for this config")
        if "layer_ids" not in meta or "model" not in meta:
            raise EngineError(f"rollout.backend=vllm: the engine at {self.url} does not say which model and layers "
                              f"its hidden states are (its connector is not this version's): {start}")
        if meta["layer_ids"] != served or not handoff.same_model(meta["model"], self.spec.model_path):
            raise EngineError(f"rollout.backend=vllm: the engine at {self.url} captures layers [{meta['layer_ids']}] "
                              f"of {meta['model']}; this run needs layers [{served}] (vLLM ids) of "
                              f"{self.spec.model_path}: {start}")

    @property
    def computes_apart(self) -> bool:
        """Whether the engine computes on devices of its own (GPUs), not on the cores this process reads
        and stores on: only then does overlapping its next batch with our work pay."""
        return self.spec.device == "cuda"

    def submit(self, rows: Sequence[list[int]]) -> list[concurrent.futures.Future]:
        """Ask for ``rows``' hidden states now; their futures, in order. Requests go out through one pool
        of ``handoff.MAX_INFLIGHT`` threads (the window the hand-off folder is sized for): a caller that
        submits its next batch before reading this one keeps the engine busy while it reads."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=handoff.MAX_INFLIGHT,
                                                               thread_name_prefix="vllm-request")
        return [self._pool.submit(self._one, list(map(int, r))) for r in rows]

    def hidden_states(self, rows: Sequence[list[int]]) -> list[torch.Tensor]:
        """Per row: ``[T, K + 1, H]`` (our K layers, then the final pre-norm), all rows in flight at once."""
        return [f.result() for f in self.submit(rows)]


SERVER_STORAGE = "/dev/shm/specforge-vllm"


def server_command(spec: EngineSpec, port: int, storage: str = SERVER_STORAGE, host: str = "127.0.0.1") -> str:
    """The shell command that starts an engine for ``spec`` by hand (``rollout.vllm_endpoint``), listening
    on ``host``. The hidden states come back through ``storage``: shared memory on the same host, or a
    folder the engine's host and ours both mount at that path (another host also needs the model and
    this repository, for the connector, at the paths the command names)."""
    python = engine_python(spec.python)
    cmd = spec.command(port, storage, str(python), host)
    env = spec.env(python)
    env = " ".join(f"{k}={shlex.quote(env[k])}" for k in ("PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")
                   if k in env)
    return env + " " + " ".join(shlex.quote(c) for c in cmd)


def spec_for(cfg, model_path: str, num_layers: int, our_ids: Sequence[int], dtype: torch.dtype,
             device: torch.device) -> EngineSpec:
    """The engine a run's config asks for (``cfg``: the run ``Config``)."""
    r = cfg.rollout
    return EngineSpec(model_path=model_path, layer_ids=vllm_layer_ids(our_ids, num_layers), dtype=dtype,
                      max_model_len=cfg.data.max_length + 1, device=device.type, tp_size=r.tp_size,
                      expert_parallel=r.expert_parallel, gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                      cpu_kvcache_gib=r.vllm_cpu_kvcache_gib, startup_timeout_s=engine_start_timeout(cfg),
                      extra_args=list(r.vllm_args), trust_remote_code=cfg.model.trust_remote_code,
                      python=r.vllm_python, hidden_size=_hidden_size(model_path))


def started_spec(cfg, model_path: str, num_layers: int, our_ids: Sequence[int], dtype: torch.dtype,
                 device: torch.device) -> EngineSpec:
    """``spec_for`` of an engine this process starts: on a GPU, with exactly this worker's GPUs
    (``device.engine_gpu_ids``). A user's endpoint or a printed command takes none of ours."""
    spec = spec_for(cfg, model_path, num_layers, our_ids, dtype, device)
    if device.type == "cuda":
        spec = dataclasses.replace(spec, gpus=engine_gpu_ids(cfg.rollout.tp_size))
    return spec


def _hidden_size(model_path: str) -> Optional[int]:
    config = read_config_json(model_path)
    return None if config is None else text_config(config).get("hidden_size")




def check_storage(cfg) -> None:
    """``rollout.vllm_storage``, where engines this process starts will write: a folder it can write, said
    before any model or engine starts (its room is checked at the engine's start, ``handoff.pick_folder``)."""
    r = cfg.rollout
    if r.backend == "vllm" and r.vllm_endpoint is None and r.vllm_storage is not None:
        check_writable("rollout.vllm_storage", r.vllm_storage)


def engine_factory(cfg, log_dir: Optional[str] = None):
    """``load_target``'s ``engine_for`` for a run (``cfg``: the run ``Config``): None with the hf backend,
    else a function that starts (or joins, ``rollout.vllm_endpoint``) the engine for a loaded target."""
    if cfg.rollout.backend != "vllm":
        return None

    def start(model_path: str, num_layers: int, our_ids: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> VllmEngine:
        if cfg.rollout.vllm_endpoint is not None:  # the user's engine, on the GPUs the user gave it
            return VllmEngine(spec_for(cfg, model_path, num_layers, our_ids, dtype, device),
                              endpoint=cfg.rollout.vllm_endpoint, log_dir=log_dir)
        return VllmEngine(started_spec(cfg, model_path, num_layers, our_ids, dtype, device), log_dir=log_dir,
                          storage_root=cfg.rollout.vllm_storage)

    return start


def die_with_engine(engine: Optional[VllmEngine], err: Exception) -> None:
    """A rollout worker whose engine died exits, so the driver replaces it as it replaces any dead
    rollout worker (a new worker starts a new engine; the train ranks resume at a consistent step)."""
    print(f"error: {err}; this rollout worker exits so that it is replaced", file=sys.stderr, flush=True)
    if engine is not None:
        engine.close()
    os._exit(3)
