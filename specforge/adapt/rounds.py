"""Adaptation rounds: served traffic -> store -> bounded fine-tune -> gate -> swap.

One round, its phase written to ``<adapt.dir>/state.json`` before each step so a killed process
resumes the round where it was:

1. ``capture``: the training rows of the ledger (``traffic.Ledger``) into the domain store,
   appended (the store's writer skips the samples it has: a rerun captures only the rest).
2. ``train``: ``python -m specforge.train`` in a child (forked from the fork server) on the domain
   store, a share of the reference store replayed beside it (``store.replay_dir``), starting from
   the live draft (``draft.init_from``), for ``adapt.steps`` steps; its checkpoints make a killed
   round resume exactly (the same command picks up its newest checkpoint).
3. ``gate``: live and candidate decode the same prompts against one greedy reference
   (``specforge.eval``): the newest held-out traffic prompts (acceptance must rise by more than
   ``adapt.min_gain``) and the general held-out prompts (may fall at most ``adapt.gate_margin``).
4. ``swap`` (passed): the candidate is copied to ``drafts/round-N``, a server starts with it, the
   proxy sends new requests there and the old server stops once its requests are answered. A
   failed gate moves the candidate to ``rejected/round-N`` and changes nothing else.

A live server that dies ends the round in progress (the live draft stays; the server is started
again with it, at most ``adapt.server_restarts`` times per run). Every round is one row of
``<adapt.dir>/metrics.jsonl`` (and of wandb / tensorboard, numbers only).
"""

from __future__ import annotations

import dataclasses
import filecmp
import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import yaml

from specforge.adapt.proxy import TrafficProxy
from specforge.adapt.traffic import Ledger
from specforge.capture import capture_store
from specforge.compat import check_drafts
from specforge.config import Config
from specforge.data.heldout import eval_prompts, heldout_rows
from specforge.data.store import (
    INDEX,
    FeatureStore,
    check_replay_meta,
    head_only_capture,
    meta_differences,
    restore_index,
    store_meta,
    store_root,
)
from specforge.data.template import resolve_chat_template, tokenize_conversation
from specforge.device import autocast_dtype, set_threads
from specforge.engines.llamacpp import (
    LlamaServer,
    cached_target_gguf,
    convert_draft,
    find_converter,
    find_server,
)
from specforge.eval import Setting, evaluate_settings
from specforge.files import open_safetensors
from specforge.forkserver import start_module
from specforge.models.target import load_target, resolve_target_path
from specforge.models.vllm_engine import check_storage, engine_factory
from specforge.preflight import check_writable
from specforge.registry import algorithm_of, feature_layers, get_algorithm, load_draft, read_draft_config
from specforge.runtime.plan import replayable_ids
from specforge.tracking import MetricsLogger
from specforge.training.checkpoint import latest_checkpoint
from specforge.training.init_from import check_init_from
from specforge.training.trainer import checkpoint_root

STATE = "state.json"
PHASES = ("idle", "capture", "train", "gate", "swap")
STORE_SOURCE = "adapt-traffic"  # the domain store's meta source: the same for every round's appended rows
STORE_BEFORE = "store-index.before.json"  # in a round's folder: the domain store's index when the round began
RESET = "python -m specforge.adapt --reset"  # the one command that starts an adapt.dir over (moved aside)
# adapt keys a round's fine-tune and gate read: a round in progress whose values changed starts again
ROUND_KEYS = ("steps", "lr", "replay_share", "reference_store", "gate_prompts", "general_prompts", "min_gain",
              "gate_margin", "max_new_tokens", "chain")


def adapt_root(cfg: Config) -> Path:
    return Path(cfg.adapt.dir or Path(cfg.train.output_dir) / "adapt").expanduser().absolute()


def start_draft(cfg: Config) -> Path:
    return Path(cfg.adapt.draft).expanduser() if cfg.adapt.draft else checkpoint_root(cfg) / "latest"


def reference_store(cfg: Config) -> Path:
    path = Path(cfg.adapt.reference_store).expanduser() if cfg.adapt.reference_store else store_root(cfg)
    return path.absolute()


@dataclass
class State:
    round: int = 0  # the round in progress, or the last one finished
    phase: str = "idle"
    live: str = ""  # the live draft's folder
    offset: int = 0  # bytes of the traffic file read
    trained_rows: int = 0  # training rows when the last round started
    gate: Optional[dict] = None  # the gate's result in the round in progress
    restarts: int = 0  # live servers restarted after dying
    skipped: dict = field(default_factory=dict)  # malformed traffic rows by reason, over the whole run
    duplicates: int = 0
    start_source: str = ""  # the folder drafts/start was copied from
    rows_before: int = 0  # trained_rows before the round in progress began (restored when it is undone)
    round_inputs: str = ""  # digest of what the round in progress computes from (its config, ROUND_KEYS)

    @classmethod
    def load(cls, root: Path) -> "State":
        path = root / STATE
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"adapt state {path} is not valid JSON ({e}); "
                             "restore it or point adapt.dir elsewhere") from None
        return cls(**{k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def save(self, root: Path) -> None:
        tmp = root / (STATE + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        os.replace(tmp, root / STATE)


class ServerDied(RuntimeError):
    pass


def config_errors(cfg: Config) -> list[str]:
    """The adapt keys alone, before anything loads."""
    a, out = cfg.adapt, []
    for key, value, ok, want in (
        ("min_rows", a.min_rows, a.min_rows >= 1, ">= 1"),
        ("holdout_share", a.holdout_share, 0 < a.holdout_share < 1, "in (0, 1)"),
        ("steps", a.steps, a.steps >= 1, ">= 1"),
        ("lr", a.lr, a.lr > 0, "> 0"),
        ("replay_share", a.replay_share, 0 <= a.replay_share < 1, "in [0, 1)"),
        ("gate_prompts", a.gate_prompts, a.gate_prompts >= 1, ">= 1"),
        ("general_prompts", a.general_prompts, a.general_prompts >= 1, ">= 1"),
        ("gate_margin", a.gate_margin, a.gate_margin >= 0, ">= 0"),
        ("max_new_tokens", a.max_new_tokens, a.max_new_tokens >= 1, ">= 1"),
        ("chain", a.chain, a.chain >= 1, ">= 1"),
        ("n_max", a.n_max, a.n_max >= 1, ">= 1"),
        ("drain_timeout_s", a.drain_timeout_s, a.drain_timeout_s > 0, "> 0"),
        ("poll_s", a.poll_s, a.poll_s > 0, "> 0"),
        ("port", a.port, 0 <= a.port < 65536, "in [0, 65535]"),
    ):
        if not ok:
            out.append(f"adapt.{key}={value!r}: must be {want}")
    if a.rounds is not None and a.rounds < 1:
        out.append(f"adapt.rounds={a.rounds!r}: must be >= 1 (or null: until interrupted)")
    if not a.serve and not a.traffic:
        out.append("adapt.traffic is not set and adapt.serve=false: name the traffic JSONL to adapt on, "
                   "or set adapt.serve=true to record it through the proxy")
    return out


def start_changed(cfg: Config, root: Path, state: State) -> bool:
    """Whether the start draft (``adapt.draft``) holds other files than ``drafts/start``, the copy the
    rounds began from (False when either is missing: nothing to compare)."""
    src, start = start_draft(cfg), root / "drafts" / "start"
    if not state.live or not (src / "config.json").is_file() or not (start / "config.json").is_file():
        return False
    names = sorted({p.name for p in src.resolve().iterdir() if p.is_file()}
                   | {p.name for p in start.iterdir() if p.is_file()})
    return any(not ((src / n).is_file() and (start / n).is_file() and filecmp.cmp(src / n, start / n, shallow=False))
               for n in names)


def traffic_path(cfg: Config, root: Path) -> Path:
    return Path(cfg.adapt.traffic).expanduser() if cfg.adapt.traffic else root / "traffic.jsonl"


def check(cfg: Config):
    """Everything that can be checked before any work (a capture, a fine-tune, a GGUF conversion, a
    server): one error naming the key and the fix. Returns the target when a check loaded it (the
    reference store's meta compares its weights), for the rounds to use; else None."""
    if errs := config_errors(cfg):
        raise ValueError("; ".join(errs))
    a = cfg.adapt
    if a.traffic and not a.serve and not Path(a.traffic).expanduser().is_file():
        raise ValueError(f"adapt.traffic={a.traffic!r}: no such file; name the JSONL of served traffic")
    root = adapt_root(cfg)
    check_writable("adapt.dir", root)
    check_storage(cfg)  # where a round's engine writes its hidden states (rollout.backend=vllm)
    state = State.load(root)
    start = root / "drafts" / "start"
    changed = start_changed(cfg, root, state)
    if changed and state.live != str(start):
        raise ValueError(f"adapt.draft={str(start_draft(cfg))!r} is not the draft {str(root)!r} started from (its "
                         f"copy: {str(start)!r}), and rounds have replaced that one (live: {state.live!r}): "
                         "set adapt.draft "
                         f"back to continue them, or start over from the new draft with `{RESET}` and the same "
                         f"arguments (it moves {str(root)!r} aside)")
    if state.live and not changed:
        _check_draft(cfg, Path(state.live), f"the live draft of adapt.dir={str(root)!r}",
                     f"restore that folder, or start over with `{RESET}`")
        live = Path(state.live)
    else:
        live = start_draft(cfg)
        _check_draft(cfg, live, "adapt.draft",
                     "set adapt.draft to a draft folder of this config (a run's checkpoints/latest)")
    check_drafts([str(live)], cfg, False)
    target = _check_reference(cfg, root) if a.replay_share > 0 else None
    if a.serve:
        if get_algorithm(cfg.draft.algorithm).llamacpp_spec_type is None:
            raise ValueError(f"adapt.serve=true: llama.cpp cannot serve draft.algorithm={cfg.draft.algorithm}; "
                             "set adapt.serve=false and name adapt.traffic")
        find_server()
        find_converter()
        _check_port(a.host, a.port)
    elif state.phase == "idle":  # a round in progress resumes on the rows it read
        _check_traffic(cfg, root, state)
    return target


def _check_draft(cfg: Config, path: Path, what: str, fix: str) -> None:
    """``path`` is a draft the rounds can fine-tune: what the round's ``draft.init_from`` will check."""
    if not (path / "config.json").is_file():
        raise ValueError(f"{what}: no draft checkpoint at {str(path)!r} (no config.json); train one first "
                         f"(bash scripts/train_eagle3.sh) or {fix}")
    probe = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, init_from=str(path)),
                                checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
    try:
        check_init_from(probe)
    except ValueError as e:
        why = (str(e).replace(f"config key 'draft.init_from'={str(path)!r}", "it")
               .replace("config key 'draft.init_from': ", ""))
        raise ValueError(f"{what}={str(path)!r} cannot start a round's fine-tune ({why}); {fix}") from None
    for f in sorted(path.glob("*.safetensors")):  # the headers only: a truncated or foreign file, named now
        with open_safetensors(f, f"{what}'s weights file", fix):
            pass


def _check_reference(cfg: Config, root: Path):
    """The reference store replayed beside the traffic: a store of this config's target, aux layers and
    data.max_length (every meta field but the samples' source, as the round's replay compares them)."""
    ref = reference_store(cfg)
    if not (ref / INDEX).is_file():
        raise ValueError(f"adapt.reference_store: no feature store at {str(ref)!r}; fill one "
                         "(python -m specforge.capture with this config) or set adapt.replay_share=0")
    store = FeatureStore(ref)
    target = load_target(cfg.model, layers=lambda n: feature_layers(cfg, n))
    want = store_meta(cfg, target, source="", like=store.meta.target)
    diffs = meta_differences(store.meta, want, "the store", "this config", ignore=("source",))
    if diffs:
        raise ValueError(f"adapt.reference_store={str(ref)!r} holds features of another setup than this config: "
                         f"{'; '.join(diffs)}; name the store captured with this model.target_path, "
                         "model.aux_layer_ids "
                         "and data.max_length (the one the live draft was trained on), or set adapt.replay_share=0")
    if not replayable_ids(store):
        raise ValueError(f"adapt.reference_store={str(ref)!r} holds {len(store.ids)} samples, none of which may be "
                         "replayed (its last min(8, a tenth) are held out); fill it or set adapt.replay_share=0")
    if (root / "store" / INDEX).is_file():
        check_replay_meta(FeatureStore(root / "store", allow_partial=True), store)
    return target


def _check_port(host: str, port: int) -> None:
    """The proxy's port is free (before the GGUF conversions and the server, not after them)."""
    if not port:
        return  # any free one
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the proxy's server binds
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            raise ValueError(f"adapt.port={port}: {host}:{port} cannot be bound ({e.strerror or e}); another process "
                             "holds it: choose another adapt.port, or 0 for any free port") from None


def _check_traffic(cfg: Config, root: Path, state: State) -> None:
    """The traffic (adapt.serve=false) can start a round: enough new usable rows, and a held-out slice
    the gate can measure on (rows go to it by content hash: it is known before anything runs)."""
    a = cfg.adapt
    ledger = Ledger(root, a.holdout_share)
    path = traffic_path(cfg, root)
    got = ledger.preview(path, state.offset)
    new = ledger.counts["train"] - state.trained_rows + got.train
    if new < a.min_rows:
        raise ValueError(f"adapt.traffic={str(path)!r}: {new} new usable training row(s) ({got.summary()}), fewer than "
                         f"adapt.min_rows={a.min_rows}: no round can run; add served chat completions (rows "
                         "{\"messages\": [...], \"completion\": \"...\"}, or ShareGPT / messages rows "
                         "with the assistant turns) or lower adapt.min_rows")
    if ledger.counts["gate"] + got.gate == 0:
        usable = ledger.counts["train"] + got.train
        raise ValueError(f"adapt.holdout_share={a.holdout_share:g}: none of the {usable} usable traffic rows "
                         "falls in the held-out slice the gate measures on (a row's slice follows from its content); "
                         "raise adapt.holdout_share or add traffic")


# ---------------------------------------------------------------- the live server


class LlamaServers:
    """Starts llama-server for a draft folder (converted to GGUF once, into ``<adapt.dir>/gguf``)."""

    def __init__(self, cfg: Config, root: Path):
        self.cfg, self.root = cfg, root
        self.target_dir = resolve_target_path(cfg.model)
        self.target_gguf = cached_target_gguf(self.target_dir)

    def start(self, draft: Path):
        gguf = self.root / "gguf" / f"{draft.name}.gguf"
        if not gguf.is_file():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            convert_draft(draft, self.target_dir, gguf)
        server = LlamaServer(self.target_gguf, gguf, n_max=self.cfg.adapt.n_max, threads=self.cfg.adapt.threads)
        return server.__enter__()


def alive(server) -> bool:
    return server is None or server.proc.poll() is None


# ---------------------------------------------------------------- one adapt run


class Adapter:
    """The rounds of one ``adapt.dir``. ``servers``: what starts a server for a draft folder
    (``.start(path)`` -> an object with ``url``, ``proc`` and ``stop()``); None: llama-server."""

    def __init__(self, cfg: Config, servers=None, log: Callable[[str], None] = print, target=None):
        self.cfg, self.a, self.log = cfg, cfg.adapt, log
        self.root = adapt_root(cfg)
        self.root.mkdir(parents=True, exist_ok=True)
        self.state = State.load(self.root)
        self.ledger = Ledger(self.root, self.a.holdout_share)
        self.servers = servers
        self.server = self.proxy = None
        self._target = target  # check() loaded it already when it compared the reference store
        self.traffic = traffic_path(cfg, self.root)
        self.rounds_done = 0
        self._tracker = None

    # -- lifecycle

    def __enter__(self) -> "Adapter":
        dst = self.root / "drafts" / "start"
        changed = start_changed(self.cfg, self.root, self.state)
        if changed and self.state.live != str(dst):
            raise ValueError(f"adapt.draft changed after rounds replaced the start draft; see `{RESET}`")
        if not self.state.live or changed:  # a copy of the draft, so nothing outside adapt.dir moves it
            src = start_draft(self.cfg).resolve()
            if changed:  # no round replaced the start draft yet: the rounds begin from the new one
                self.log(f"adapt: adapt.draft changed ({src}); the start draft {dst} is replaced by it")
                if self.state.phase != "idle":
                    self._undo_round("its start draft changed", consumed=False)
            _copy_draft(src, dst)
            self.state.live, self.state.start_source = str(dst), str(src)
            self.state.save(self.root)
            self.log(f"adapt: live draft {dst} (copied from {src})")
        if self.a.serve:
            if self.servers is None:
                self.servers = LlamaServers(self.cfg, self.root)
            self.server = self.servers.start(Path(self.state.live))
            self.proxy = TrafficProxy(self.server.url, self.traffic, self.a.host, self.a.port).__enter__()
            self.log(f"adapt: serving {self.state.live} behind {self.proxy.url} "
                     f"(OpenAI API; traffic -> {self.traffic})")
        return self

    def __exit__(self, *exc) -> None:
        if self.proxy is not None:  # no new requests; the ones in flight are answered before the server goes
            self.proxy.close()
            try:
                self.proxy.drain(self.proxy.upstream, self.a.drain_timeout_s)
            except TimeoutError as e:
                self.log(f"adapt: {e}; stopping the server anyway")
        if self.server is not None:
            self.server.stop()
        if self._tracker is not None:
            self._tracker.close()

    def run(self) -> int:
        """Rounds until ``adapt.rounds`` are done, or (no server) the traffic has too few new rows."""
        if self.state.phase != "idle" and self.state.round_inputs != self._inputs():
            self._undo_round("its inputs changed (the config of its fine-tune or gate)", consumed=False)
        while self.a.rounds is None or self.rounds_done < self.a.rounds:
            if self.state.phase == "idle":
                got = self.ledger.ingest(self.traffic, self.state.offset)
                self._count(got)
                if self.ledger.counts["train"] - self.state.trained_rows < self.a.min_rows:
                    if not self.a.serve:
                        self.log(f"adapt: {self.ledger.counts['train'] - self.state.trained_rows} new training rows in "
                                 f"{self.traffic}, fewer than adapt.min_rows={self.a.min_rows}; stopping")
                        break
                    self._keep_serving()
                    time.sleep(self.a.poll_s)
                    continue
                self.state.round += 1
                self.state.rows_before, self.state.trained_rows = self.state.trained_rows, self.ledger.counts["train"]
                self.state.phase, self.state.gate = "capture", None
                self._snapshot_store()
                self.state.round_inputs = self._inputs()
                self.state.save(self.root)
            self.round()
            self.rounds_done += 1
        return self.rounds_done

    def _count(self, got) -> None:
        self.state.offset = got.offset
        for why, n in got.skipped.items():
            self.state.skipped[why] = self.state.skipped.get(why, 0) + n
        self.state.duplicates += got.duplicates
        if got.skipped:  # at once; new rows are summed up when a round starts
            self.log(f"adapt: traffic: {got.summary()}")
        self.state.save(self.root)

    def _keep_serving(self) -> None:
        """A live server that died is started again with the live draft (bounded)."""
        if alive(self.server):
            return
        if self.state.restarts >= self.a.server_restarts:
            raise RuntimeError(f"adapt: the live server died {self.state.restarts + 1} times "
                               f"(adapt.server_restarts={self.a.server_restarts}); its log:\n{_log_tail(self.server)}")
        self.state.restarts += 1
        self.state.save(self.root)
        self.log(f"adapt: the live server died (code {self.server.proc.returncode}); "
                 f"starting it again with {self.state.live}")
        self.server.stop()
        self.server = self.servers.start(Path(self.state.live))
        self.proxy.switch(self.server.url)

    # -- one round

    def round(self) -> dict:
        n, t0 = self.state.round, time.time()
        rdir = self._rdir()
        row = {"round": n, "live_before": self.state.live, "train_rows": self.ledger.counts["train"],
               "gate_rows": self.ledger.counts["gate"], "skipped_rows": sum(self.state.skipped.values()),
               "duplicate_rows": self.state.duplicates, "replay_share": self.a.replay_share}
        self.log(f"adapt: round {n} ({self.state.phase}): {row['train_rows']} training rows, "
                 f"{row['gate_rows']} held out, {row['skipped_rows']} malformed skipped, "
                 f"{row['duplicate_rows']} duplicates")
        try:
            if self.state.phase == "capture":
                self._server_check()
                self.capture()
                self._set_phase("train")
            if self.state.phase == "train":
                self._server_check()
                self.train(rdir)
                self._set_phase("gate")
            candidate = _newest(rdir)
            if self.state.phase == "gate":
                self._server_check()
                self.state.gate = self.gate(Path(self.state.live), candidate)
                self._set_phase("swap")
            gate = self.state.gate
            row.update(gate)
            if gate["passed"]:
                row.update(self.swap(candidate, n))
                row["status"] = "swapped"
            else:
                aside = self.root / "rejected" / f"round-{n:04d}"
                _copy_draft(candidate, aside)
                row.update(status="rejected", candidate=str(aside))
                self.log(f"adapt: round {n}: gate failed ({gate['why']}); the live draft stays {self.state.live}, "
                         f"the candidate is kept at {aside}")
        except ServerDied as e:
            row.update(status="server died", why=str(e))
            self.log(f"adapt: round {n} ended: {e}; the live draft stays {self.state.live}")
            self._keep_serving()
        except Exception as e:  # noqa: BLE001 -- any failure: undo the round, say so, end the run
            steps = _steps(rdir)
            self._undo_round(f"{type(e).__name__}", consumed=True)
            row.update(status="failed", why=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                       live=self.state.live, steps=steps, minutes=round((time.time() - t0) / 60, 2))
            self._record(row)
            raise RuntimeError(f"{e}\nadapt: round {n} failed and was undone (the live draft {self.state.live} and the "
                               "domain store are as before it); fix the cause and run the same command again: the "
                               "next round reads the traffic anew") from e
        row.update(live=self.state.live, steps=_steps(rdir), minutes=round((time.time() - t0) / 60, 2))
        self.state.phase, self.state.gate = "idle", None
        self.state.save(self.root)
        self._record(row)
        return row

    def _rdir(self) -> Path:
        return self.root / "rounds" / f"round-{self.state.round:04d}"

    def _inputs(self) -> str:
        """Digest of what the round in progress computes from: its fine-tune's config and the gate's keys."""
        cfg = self.round_config(self._rdir())
        cfg.pop("tracking", None)
        cfg["adapt"] = {k: cfg["adapt"].get(k) for k in ROUND_KEYS}
        return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _snapshot_store(self) -> None:
        """The domain store's index as the round begins (``_undo_round`` puts it back)."""
        rdir = self._rdir()
        _set_aside(rdir)  # a folder of an earlier attempt at this number: never resumed
        rdir.mkdir(parents=True)
        index = self.root / "store" / INDEX
        (rdir / STORE_BEFORE).write_text(json.dumps({"index": index.read_text() if index.is_file() else None}))

    def _undo_round(self, why: str, consumed: bool) -> None:
        """The round in progress never happened: the domain store as it began (its index back, shards
        written since removed), its folder set aside, the rows it took counted as new again, the
        live draft untouched. ``consumed``: its number stays used (a failed round has its metrics row)."""
        n, rdir = self.state.round, self._rdir()
        snap = rdir / STORE_BEFORE
        if snap.is_file():
            before = json.loads(snap.read_text())["index"]
            restore_index(self.root / "store", None if before is None else before.encode())
        _set_aside(rdir)
        for leftover in (self.root / "drafts" / f"round-{n:04d}", self.root / "drafts" / f"round-{n:04d}.tmp"):
            if leftover.exists() and str(leftover) != self.state.live:
                shutil.rmtree(leftover)
        self.state.trained_rows = self.state.rows_before
        self.state.phase, self.state.gate, self.state.round_inputs = "idle", None, ""
        if not consumed:
            self.state.round -= 1
        self.state.save(self.root)
        self.log(f"adapt: round {n} undone ({why}): the live draft stays {self.state.live}; the domain store is as "
                 "before it" + ("" if consumed else "; it starts again from its first phase"))

    def _set_phase(self, phase: str) -> None:
        self.state.phase = phase
        self.state.save(self.root)

    def _server_check(self) -> None:
        if not alive(self.server):
            raise ServerDied(f"the live server exited (code {self.server.proc.returncode})")

    def target(self):
        """The transformers target the gate decodes with, on the configured devices (kept across rounds;
        with the hf backend the capture's too)."""
        if self._target is None:
            set_threads(self.cfg.train.num_threads)
            self._target = load_target(self.cfg.model, layers=lambda n: feature_layers(self.cfg, n))
        return self._target

    def capture(self) -> None:
        """The ledger's training rows into the domain store (sample id = row; stored ones skipped), through
        the engine the config names: with rollout.backend=vllm a vLLM engine started for the capture and
        stopped after it (the round's fine-tune and the gate need its GPUs), else ``target()``."""
        import datasets  # lazy: heavy (datasets)

        datasets.disable_progress_bars()  # its "Saving the dataset" bars, every round
        data = dataclasses.replace(self.cfg.data, path=str(self.ledger.train_path), num_eval=0, max_samples=None,
                                   join_parts=False)
        cfg = dataclasses.replace(self.cfg, data=data,
                                  store=dataclasses.replace(self.cfg.store, dir=str(self.root / "store")))
        if self.cfg.rollout.backend != "vllm":
            capture_store(cfg, progress=False, target=self.target(), source=STORE_SOURCE)
            return
        set_threads(self.cfg.train.num_threads)
        engine = load_target(self.cfg.model, layers=lambda n: feature_layers(self.cfg, n),
                             engine_for=engine_factory(self.cfg), head_only=head_only_capture(self.root / "store"))
        try:
            capture_store(cfg, progress=False, target=engine, source=STORE_SOURCE)
        finally:
            engine.engine.close()

    def round_config(self, rdir: Path) -> dict:
        a, cfg = self.a, self.cfg.to_dict()
        cfg["draft"]["init_from"] = self.state.live
        cfg["placement"]["mode"] = "offline"
        cfg["store"].update(dir=str(self.root / "store"))
        if a.replay_share > 0:
            cfg["store"].update(replay_dir=str(reference_store(self.cfg)), replay_share=a.replay_share)
        cfg["train"].update(output_dir=str(rdir), max_steps=a.steps, epochs=None, lr=a.lr, eval_every=0,
                            warmup_steps=min(self.cfg.train.warmup_steps, a.steps // 10))
        cfg["checkpoint"].update(dir=None, resume=True,
                                 every_steps=max(1, min(self.cfg.checkpoint.every_steps or a.steps, a.steps // 4 or 1)))
        for key in cfg["draft"]:  # a from-scratch warmup (e.g. TTT step 0 alone first) is not redone on a trained draft
            if key.endswith("warmup_steps"):
                cfg["draft"][key] = 0
        run = self.cfg.tracking.run_name or "adapt"
        cfg["tracking"]["run_name"] = f"{run}-round-{self.state.round}"
        return cfg

    def train(self, rdir: Path) -> None:
        rdir.mkdir(parents=True, exist_ok=True)
        path = rdir / "config.yaml"
        path.write_text(yaml.safe_dump(self.round_config(rdir), sort_keys=False))
        log = rdir / "train.log"
        self.log(f"adapt: round {self.state.round}: fine-tuning {self.a.steps} steps from {self.state.live} "
                 f"(log: {log})")

        # forked from the fork server (its torch and transformers imported once: ~5 CPU-s a round less than
        # a fresh interpreter); the child goes when adapt does (a killed adapt resumes the round itself)
        proc = start_module("specforge.train", ["--config", str(path)], str(log))
        try:
            while proc.poll() is None:
                if not alive(self.server):
                    proc.terminate()
                    proc.wait(timeout=60)
                    raise ServerDied(f"the live server exited (code {self.server.proc.returncode}) while the "
                                     f"round trained; its checkpoints stay in {rdir}")
                time.sleep(min(self.a.poll_s, 1.0))
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
            raise
        if proc.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"adapt: round {self.state.round}'s fine-tune failed (exit {proc.returncode}); "
                               f"its log {log}:\n{tail}")

    def gate(self, live: Path, candidate: Path) -> dict:
        """Acceptance of the live draft and the candidate on the same prompts and greedy references."""
        target, a = self.target(), self.a
        cap = 384
        template = resolve_chat_template(target.tokenizer, self.cfg.model.chat_template)
        recent = self.ledger.gate_rows()
        rows = []
        for messages in reversed(recent):  # the newest first
            ids, mask, _ = tokenize_conversation(target.tokenizer, messages, self.cfg.data.max_length, template)
            rows.append({"input_ids": ids, "loss_mask": mask})
        domain = eval_prompts(rows, a.gate_prompts, cap)
        general = eval_prompts(heldout_rows(self.cfg, target.tokenizer), a.general_prompts, cap)
        if not domain:
            raise RuntimeError(f"adapt: no held-out traffic prompt of at most {cap} tokens to gate on "
                               f"({len(recent)} held-out rows); raise adapt.holdout_share or send more traffic")
        dtype = autocast_dtype(self.cfg.train.precision, target.device) or None
        settings = []
        for path in (live, candidate):
            draft = load_draft(str(path), target).to(target.device)
            settings.append(Setting(str(path), algorithm_of(read_draft_config(str(path))).proposer(draft, dtype)))
        out = {}
        for name, prompts in (("domain", domain), ("general", general)):
            reps = evaluate_settings(target, settings, prompts, a.max_new_tokens, a.chain, progress=False)
            out[f"{name}_live"] = round(reps[0].acceptance_length, 4)
            out[f"{name}_candidate"] = round(reps[1].acceptance_length, 4)
            out[f"{name}_prompts"] = len(prompts)
        rise = out["domain_candidate"] - out["domain_live"]
        fall = out["general_live"] - out["general_candidate"]
        why = []
        if rise <= a.min_gain:
            why.append(f"domain acceptance {out['domain_live']:.3f} -> {out['domain_candidate']:.3f} did not rise by "
                       f"more than adapt.min_gain={a.min_gain:g}")
        if fall > a.gate_margin:
            why.append(f"general acceptance fell {out['general_live']:.3f} -> {out['general_candidate']:.3f}, more "
                       f"than adapt.gate_margin={a.gate_margin:g}")
        out.update(passed=not why, why="; ".join(why))
        self.log(f"adapt: round {self.state.round} gate: domain {out['domain_live']:.3f} -> "
                 f"{out['domain_candidate']:.3f} "
                 f"({len(domain)} prompts), general {out['general_live']:.3f} -> {out['general_candidate']:.3f} "
                 f"({len(general)} prompts): {'passed' if not why else 'failed'}")
        return out

    def swap(self, candidate: Path, n: int) -> dict:
        """The candidate becomes the live draft; with a server, requests move to a new one, none dropped."""
        new = self.root / "drafts" / f"round-{n:04d}"
        if Path(self.state.live).resolve() != new.resolve():
            _copy_draft(candidate, new)
        out = {"candidate": str(new)}
        if self.server is not None:
            t0 = time.time()
            try:
                server = self.servers.start(new)
            except (ValueError, OSError) as e:  # the candidate's server would not start: nothing swapped
                aside = self.root / "rejected" / f"round-{n:04d}"
                shutil.rmtree(aside, ignore_errors=True)
                shutil.move(str(new), aside)
                raise ServerDied(f"the candidate's server did not start ({str(e).splitlines()[0]}); "
                                 f"the candidate is kept at {aside}") from None
            old = self.server
            self.proxy.switch(server.url)
            self.server = server
            out["in_flight_at_switch"] = self.proxy.in_flight(old.url)
            try:
                out["drain_s"] = round(self.proxy.drain(old.url, self.a.drain_timeout_s), 3)
            except TimeoutError as e:
                self.log(f"adapt: {e}; stopping the old server anyway")
            old.stop()
            out["swap_s"] = round(time.time() - t0, 3)
        self.state.live = str(new)
        self.state.save(self.root)
        self.log(f"adapt: round {n}: live draft is now {new}"
                 + (f" (served behind {self.proxy.url})" if self.proxy else ""))
        return out

    def _record(self, row: dict) -> None:
        with open(self.root / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), **row}) + "\n")
        if self._tracker is None:
            tracking = dataclasses.replace(self.cfg.tracking, jsonl=False,
                                           run_name=self.cfg.tracking.run_name or "adapt")
            self._tracker = MetricsLogger(tracking, self.root, self.cfg.to_dict())
        nums = {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}
        nums["passed"] = float(row.get("status") == "swapped")
        self._tracker.log(row["round"], nums, kind="adapt")


def _copy_draft(src: Path, dst: Path) -> None:
    """A draft folder's files (links followed) into ``dst``, written aside and renamed into place."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(Path(src).resolve(), tmp, symlinks=False)
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, dst)


def _set_aside(rdir: Path) -> None:
    """A round's folder that will not be resumed, renamed ``<name>.undone-<time>`` (nothing deleted)."""
    if rdir.exists():
        shutil.move(str(rdir), str(rdir.with_name(f"{rdir.name}.undone-{time.strftime('%Y%m%d-%H%M%S')}")))


def _newest(rdir: Path) -> Path:
    path = latest_checkpoint(rdir / "checkpoints")
    if path is None:
        raise RuntimeError(f"adapt: the round's fine-tune left no checkpoint in {rdir / 'checkpoints'}")
    return path


def _steps(rdir: Path) -> int:
    """The newest checkpoint's step (its folder is ``step-N``); 0 without one."""
    path = latest_checkpoint(rdir / "checkpoints")
    digits = "".join(c for c in path.name if c.isdigit()) if path else ""
    return int(digits) if digits else 0


def _log_tail(server) -> str:
    return server.log_tail() if hasattr(server, "log_tail") else ""
