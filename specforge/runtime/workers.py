"""The Ray worker roles: a rollout worker runs the frozen target, a train worker runs THE train step.

    RolloutWorker   target only; per step ONE batched forward over the union of the samples of
                    the DP groups it serves, then p2p sends of each train rank's features.
    TrainWorker     the draft (FSDP2 over the train ranks when there are several); in colocated
                    mode it also holds the target and computes its own features in memory.

Workers are given the run ``Config`` and paths (data cache, vocab file), never data or tensors;
they answer with ``StepReport`` records. Every rank joins one communicator (rollout ranks first,
the data plane) and every rank creates the train-only group (``dist.new_group`` is collective
over the world, so all ranks call it, in the same order).
Legend: B batch, T tokens, H target hidden, N draft vocab.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from specforge.config import Config
from specforge.device import pick_device, set_threads
from specforge.runtime.actors import DistributedWorker
from specforge.runtime.contracts import StepPlan, StepReport
from specforge.runtime.dataplane import (
    FeatureBatch,
    ObjectStoreTransport,
    P2PTransport,
    Prefetcher,
    SendHandle,
    SendWindow,
    torch_dtype,
)
from specforge.train.batch import TrainBatch, collate


@dataclass(frozen=True)
class Layout:
    """Who is who in the communicator (metadata only)."""

    mode: str  # "colocated" | "disaggregated"
    rollout_ranks: tuple[int, ...]  # empty when colocated
    train_ranks: tuple[int, ...]
    vocab_path: str
    mailbox: Optional[str] = None  # object-store transport: name of the mailbox actor


def micro_batches(plan: StepPlan, dp_rank: int, batch_size: int) -> list[list[int]]:
    """This DP rank's samples of the step, ``batch_size`` at a time (training order)."""
    ids = list(plan.group_samples[dp_rank])
    return [ids[s : s + batch_size] for s in range(0, len(ids), batch_size)]


def _open_data(cfg: Config):
    """Re-open the driver's memory-mapped token cache (a cache hit: nothing is re-tokenized)."""
    from specforge.data.prepare import prepare_dataset
    from specforge.models.target import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    data = prepare_dataset(cfg.data, tokenizer, chat_template=cfg.model.chat_template,
                           cache_dir=cfg.model.cache_dir, progress=False)
    return tokenizer, data


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0


def _transport(cfg: Config, layout: Layout, device: torch.device):
    if cfg.placement.transport == "object_store":
        return ObjectStoreTransport(layout.mailbox, cfg.parallel.timeout_s, rank=dist.get_rank())
    return P2PTransport(device=device)


# ------------------------------------------------------------------------------ rollout


class RolloutWorker(DistributedWorker):
    """The frozen target. ``rollout_step`` returns once the sends are posted, so the worker can
    run ahead of training; its ``SendWindow`` bounds the bytes in flight (backpressure)."""

    def __init__(self, cfg: Config):
        super().__init__(cfg.train.num_threads)
        self.cfg = cfg
        self.forwards = 0  # target forwards so far (one per step, however many DP groups)

    def setup(self, layout: Layout) -> int:
        from specforge.models.target import load_target

        cfg = self.cfg
        set_threads(cfg.train.num_threads)
        self.rank = dist.get_rank()
        dist.new_group(list(layout.train_ranks), timeout=timedelta(seconds=cfg.parallel.timeout_s))
        self.tokenizer, self.data = _open_data(cfg)
        self.target = load_target(cfg.model, pick_device(cfg.model.device))
        self.transport = _transport(cfg, layout, self.target.device)
        self.window = SendWindow(int(cfg.placement.max_inflight_mb * 2**20))
        return self.rank

    def rollout_step(self, plan: StepPlan) -> StepReport:
        from specforge.models.target import capture

        ids = plan.batch_of(self.rank)
        t0 = time.perf_counter()
        feats, forwards = {}, 0
        if ids:
            feats = self._forward(ids, capture, torch_dtype(plan.feature_spec.fields[0].dtype))
            forwards = 1
        t1 = time.perf_counter()
        handle = self.transport.send_step(plan, feats, my_rank=self.rank)
        t2 = time.perf_counter()
        # The window holds the features alive until their sends are out (isend reads them).
        kept = SendHandle(handle.wait, handle.nbytes)
        kept.features = feats
        self.window.push(kept)
        t3 = time.perf_counter()
        self.forwards += forwards
        return StepReport(
            self.rank, plan.step,
            metrics={"forwards": float(forwards), "samples": float(len(ids)),
                     "tokens": float(sum(int(f["input_ids"].shape[0]) for f in feats.values())),
                     "inflight_bytes": float(self.window.inflight_bytes)},
            timings_ms={"forward": (t1 - t0) * 1e3, "send_post": (t2 - t1) * 1e3, "send_wait": (t3 - t2) * 1e3},
            bytes_sent=handle.nbytes,
        )

    @torch.no_grad()
    def _forward(self, ids: Sequence[int], capture, hidden_dtype: torch.dtype) -> dict[int, dict[str, torch.Tensor]]:
        """ONE right-padded target forward over ``ids``; per-sample full-length wire tensors."""
        rows = self.data.train[list(ids)]
        rows = [{"input_ids": a, "loss_mask": b} for a, b in zip(rows["input_ids"], rows["loss_mask"])]
        input_ids_BT, loss_mask_BT, attn_BT = collate(rows, _pad_id(self.tokenizer))
        f = capture(self.target, input_ids_BT, attn_BT, self.cfg.model.argmax_chunk_tokens)
        out = {}
        for b, sid in enumerate(ids):
            n = len(rows[b]["input_ids"])
            out[sid] = {
                "aux_hidden": f.aux_hidden_BT3H[b, :n].to(hidden_dtype),
                "last_hidden": f.last_hidden_BTH[b, :n].to(hidden_dtype),
                "target_ids": f.target_ids_BT[b, :n],
                "input_ids": input_ids_BT[b, :n],
                "loss_mask": loss_mask_BT[b, :n].to(torch.int8),
            }
        return out

    def forward_only(self, plan: StepPlan) -> StepReport:
        """Benchmark probe: the rollout stage alone (the batched forward, nothing sent)."""
        from specforge.models.target import capture

        ids = plan.batch_of(self.rank)
        t0 = time.perf_counter()
        feats = self._forward(ids, capture, torch_dtype(plan.feature_spec.fields[0].dtype)) if ids else {}
        tokens = float(sum(int(f["input_ids"].shape[0]) for f in feats.values()))
        return StepReport(self.rank, plan.step, metrics={"tokens": tokens}, timings_ms={"forward": (time.perf_counter() - t0) * 1e3})

    def drain(self) -> int:
        """Wait for every send to leave (end of the run)."""
        self.window.drain()
        return self.forwards


# ------------------------------------------------------------------------------ training


class _TTTObjective(torch.nn.Module):
    """The FSDP2 root: ``ttt_loss`` reads the draft's weights directly (no ``draft.forward``), and
    FSDP2 unshards / reduce-scatters only around a module's forward, so the loss IS the forward."""

    def __init__(self, draft: torch.nn.Module):
        super().__init__()
        self.draft = draft

    def forward(self, batch, teacher_NH, ttt_length, decay, num_valid_global=None):
        from specforge.train.ttt import ttt_loss

        return ttt_loss(self.draft, batch, teacher_NH, ttt_length, decay, num_valid_global=num_valid_global)

    def loss_fn(self, _draft, batch, teacher_NH, ttt_length, decay, num_valid_global=None):
        return self(batch, teacher_NH, ttt_length, decay, num_valid_global=num_valid_global)


def shard_draft(draft: torch.nn.Module, train_ranks: Sequence[int], cfg: Config, group=None) -> Optional[_TTTObjective]:
    """FSDP2 over the train ranks (to be replaced by ``specforge.parallel.apply_fsdp``).

    Returns the sharded root (call its ``loss_fn`` instead of ``ttt_loss``), or None with one
    train rank (no wrapping at all). Gradients are SUMMED over DP (divide factor 1): the loss is
    already normalized by the global valid-token count. Mixed precision: bf16 params with fp32
    reductions only for bf16 on a GPU; on CPU params stay fp32 and DraftTrainer's autocast runs
    the compute (as in the single-process trainer).
    """
    if len(train_ranks) == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from specforge.device import autocast_dtype

    device = next(draft.parameters()).device
    mesh = DeviceMesh.from_group(group, device.type) if group is not None else DeviceMesh(device.type, list(train_ranks))
    mp = MixedPrecisionPolicy()
    if device.type == "cuda" and autocast_dtype(cfg.train.precision, device) == torch.bfloat16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = _TTTObjective(draft)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    root.set_gradient_divide_factor(1.0)
    # Plain SUM collectives: with a factor FSDP2 otherwise uses PREMUL_SUM, which gloo lacks.
    root.set_force_sum_reduction_for_comms(True)
    return root


_TRAIN_KEYS = ("fc.", "midlayer.", "norm.weight", "lm_head.weight", "d2t", "t2d")


def export_keys(draft, full_state: dict) -> dict[str, torch.Tensor]:
    """``export_state_dict``'s key filter applied to a gathered full state dict."""
    keep = {k: v for k, v in full_state.items() if k.startswith(_TRAIN_KEYS)}
    if draft.embedding_trainable and "embed_tokens.weight" in full_state:
        keep["embed_tokens.weight"] = full_state["embed_tokens.weight"]
    return keep


class _PlanQueue:
    """The plans a ``Prefetcher`` may post receives for; refilled call by call (a generator
    could not resume after running dry)."""

    def __init__(self):
        self._q: collections.deque[StepPlan] = collections.deque()
        self.last = -1

    def push(self, plans: Sequence[StepPlan]) -> None:
        for p in plans:
            if p.step > self.last:
                self._q.append(p)
                self.last = p.step

    def __iter__(self):
        return self

    def __next__(self) -> StepPlan:
        if not self._q:
            raise StopIteration
        return self._q.popleft()


class TrainWorker(DistributedWorker):
    """A DP rank of the draft. Runs ``DraftTrainer.step`` unchanged; features come from the
    in-process target (colocated) or from the data plane (disaggregated)."""

    def __init__(self, cfg: Config):
        super().__init__(cfg.train.num_threads)
        self.cfg = cfg

    def setup(self, layout: Layout) -> int:
        """Build groups, the draft and its trainer; resume from the newest checkpoint. Returns
        the step to start from."""
        from specforge.data.vocab import load_draft_vocab
        from specforge.models.target import load_target
        from specforge.train.trainer import DraftTrainer, build_draft, teacher_weight

        cfg = self.cfg
        set_threads(cfg.train.num_threads)
        self.layout, self.rank = layout, dist.get_rank()
        self.group = dist.new_group(list(layout.train_ranks), timeout=timedelta(seconds=cfg.parallel.timeout_s))
        self.dp_rank = layout.train_ranks.index(self.rank)
        self.device = pick_device(cfg.model.device)
        self.colocated = layout.mode == "colocated"
        self.tokenizer, self.data = _open_data(cfg) if self.colocated else (None, None)
        vocab = load_draft_vocab(layout.vocab_path)
        # The draft needs the target's embedding and lm_head (teacher rows of the draft vocab).
        # Disaggregated: load the target once, copy them, drop it. On a GPU that briefly costs a
        # whole target's memory per train rank; at scale read just those two tensors instead.
        target = load_target(cfg.model, self.device)
        if self.tokenizer is None:
            self.tokenizer = target.tokenizer
        draft = build_draft(cfg, target, vocab).to(self.device)
        teacher = teacher_weight(target, vocab)
        self.target = target if self.colocated else None
        del target
        self.draft = draft
        self.root = shard_draft(draft, layout.train_ranks, cfg, self.group)
        loss_fn = self.root.loss_fn if self.root is not None else None
        self.trainer = DraftTrainer(draft, teacher, cfg, self.device, **({"loss_fn": loss_fn} if loss_fn else {}))
        if not self.colocated:
            self.transport = _transport(cfg, layout, self.device)
            self.plans = _PlanQueue()
            self.prefetcher = Prefetcher(self.transport, self.plans, int(cfg.placement.max_inflight_mb * 2**20), my_rank=self.rank)
        self.saved_step = -1
        return self._resume()

    # ---------------------------------------------------------------- one step

    def train_step(self, plan: StepPlan, upcoming: Sequence[StepPlan] = (), save: bool = False) -> StepReport:
        t0 = time.perf_counter()
        wait0, recv0 = self._wait_and_bytes()
        batches = self._local_batches(plan) if self.colocated else self._received_batches(plan, upcoming)
        t1 = time.perf_counter()
        wait1, recv1 = self._wait_and_bytes()
        metrics = self._step(batches)
        t2 = time.perf_counter()
        if save:
            self.save()
        timings = {"features": (t1 - t0) * 1e3, "train": metrics.pop("train_ms"), "train_wait": wait1 - wait0,
                   "step": (t2 - t0) * 1e3}
        metrics["tokens_local"] = metrics.pop("tokens")
        return StepReport(self.rank, plan.step, metrics=metrics, timings_ms=timings, bytes_recv=recv1 - recv0)

    def _step(self, batches: list[TrainBatch]) -> dict[str, float]:
        """THE train step, with the loss normalized by the valid count of ALL train ranks."""
        from specforge.train.trainer import count_valid

        self._last_batches = batches
        L = self.cfg.draft.ttt_length
        local = torch.tensor([sum(count_valid(mb, self.draft.t2d, L) for mb in batches)], dtype=torch.float64)
        num_valid = int(self._all_reduce(local).item())
        return self.trainer.step(batches, num_valid_global=num_valid, all_reduce_counts=self._all_reduce)

    def train_repeat(self, reps: int) -> StepReport:
        """Benchmark probe: the train stage alone, on the last step's already-received features."""
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            m = self._step(self._last_batches)
            times.append((time.perf_counter() - t0) * 1e3)
        return StepReport(self.rank, -1, metrics={"tokens_local": m["tokens"]}, timings_ms={f"train_{i}": t for i, t in enumerate(times)})

    def _wait_and_bytes(self) -> tuple[float, int]:
        if self.colocated:
            return 0.0, 0
        return self.prefetcher.wait_ms, self.prefetcher.bytes_recv

    def _local_batches(self, plan: StepPlan) -> list[TrainBatch]:
        from specforge.train.trainer import local_batches

        out = []
        for ids in micro_batches(plan, self.dp_rank, self.cfg.train.batch_size):
            rows = [self.data.train[i] for i in ids]
            out += local_batches(self.target, rows, len(rows), self.cfg.model.argmax_chunk_tokens)
        return out

    def _received_batches(self, plan: StepPlan, upcoming: Sequence[StepPlan]) -> list[TrainBatch]:
        self.plans.push([plan, *upcoming])  # step k+1's receives get posted before step k runs
        got_plan, fbs = next(self.prefetcher)
        assert got_plan.step == plan.step, (got_plan.step, plan.step)
        pad = _pad_id(self.tokenizer)
        return [batch_from_features([fbs[s] for s in ids], pad)
                for ids in micro_batches(plan, self.dp_rank, self.cfg.train.batch_size)]

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if len(self.layout.train_ranks) > 1:
            t = t.to(self.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.cpu()

    # ---------------------------------------------------------------- checkpoints

    def save(self) -> Optional[str]:
        """Gather the full draft to train rank 0, which writes ONE SGLang-loadable folder plus
        the train state (full optimizer state) for resume. Collective over the train ranks."""
        from specforge.train.checkpoint import save_checkpoint
        from specforge.train.trainer import checkpoint_root

        tr = self.trainer
        if tr.step_count == self.saved_step or tr.step_count == 0:
            return None
        if self.root is None:
            weights, state = self.draft.export_state_dict(), tr.train_state()
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

            # cpu_offload=True would keep the gathered tensors on GLOBAL rank 0 only, which is a
            # rollout rank when disaggregated; so every train rank gathers (the draft is one layer
            # + lm_head, cheap next to the target) and train rank 0 keeps a CPU copy.
            opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
            full = _to_cpu(get_model_state_dict(self.root, options=opts))
            optim = _to_cpu(get_optimizer_state_dict(self.root, tr.optimizer, options=opts))
            weights = export_keys(self.draft, {k.removeprefix("draft."): v for k, v in full.items()})
            state = {**tr.train_state(), "optimizer": optim, "full_optimizer_state": True}
        self.saved_step = tr.step_count
        if self.dp_rank != 0:
            return None
        path = save_checkpoint(checkpoint_root(self.cfg), tr.step_count, self.draft.config.to_hf_config(),
                               weights, state, self.cfg.checkpoint.keep_last)
        return str(path)

    def _resume(self) -> int:
        from specforge.train.checkpoint import latest_checkpoint, load_draft_folder, load_train_state
        from specforge.train.trainer import checkpoint_root

        ck = latest_checkpoint(checkpoint_root(self.cfg)) if self.cfg.checkpoint.resume else None
        if ck is None:
            return 0
        weights, state = load_draft_folder(ck)[1], load_train_state(ck)
        if self.root is None:
            self.draft.load_export_state_dict(weights)
            self.trainer.load_train_state(state)
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

            opts = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self.root, {f"draft.{k}": v for k, v in weights.items()}, options=opts)
            set_optimizer_state_dict(self.root, self.trainer.optimizer, state["optimizer"], options=opts)
            self.trainer.scheduler.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"])
            self.trainer.step_count = int(state["step"])
        self.saved_step = self.trainer.step_count
        return self.trainer.step_count


def _to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree


def batch_from_features(fbs: Sequence[FeatureBatch], pad_id: int) -> TrainBatch:
    """Right-pad received samples into one micro-batch (copies: the receive buffer is reused)."""
    T = max(fb.stop - fb.start for fb in fbs)

    def stack(name: str, fill, dtype=None) -> torch.Tensor:
        first = fbs[0][name]
        out = torch.full((len(fbs), T, *first.shape[1:]), fill, dtype=dtype or first.dtype, device=first.device)
        for b, fb in enumerate(fbs):
            out[b, : fb[name].shape[0]] = fb[name]
        return out

    return TrainBatch(
        input_ids_BT=stack("input_ids", pad_id, torch.long),
        loss_mask_BT=stack("loss_mask", 0, torch.long),
        aux_hidden_BT3H=stack("aux_hidden", 0),
        last_hidden_BTH=stack("last_hidden", 0),
        target_ids_BT=stack("target_ids", 0, torch.long),
    )


def checkpoint_step(path: str | Path) -> int:
    return int(Path(path).name.split("-")[1])
