"""Checks of a run in the driver, before any worker starts (every placement and the single process).

``check_run`` holds the config against the target's config.json (no weights are read) and, in
offline mode, against the feature store's meta: a mistake there otherwise surfaces minutes later
inside a Ray worker, or not at all (a checkpoint SGLang cannot serve). ``check_memory`` (the Ray
driver) holds each device's predicted peak against one GPU's memory: an out-of-memory otherwise
shows in step 1, after the workers started. ``check_resources`` holds the CPUs/GPUs (and custom
resources) the placement's workers request against what the Ray cluster, or this machine, has:
more workers than cores starts them all and thrashes instead of failing. All raise a
``ValueError`` naming the config keys and the numbers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

import torch

from specforge import memory
from specforge.config import Config
from specforge.data.store import INDEX, FeatureStore, check_replay_meta, store_root
from specforge.device import pick_device, wants_gpu
from specforge.dryrun import memory_plan
from specforge.files import check_writable
from specforge.models.target import load_target_config, resolve_target_path
from specforge.models.vllm_engine import check_storage, engine_python, vllm_layer_ids
from specforge.parallel.dims import ParallelDims
from specforge.registry import bound_algorithm
from specforge.runtime.loop import check, single_process
from specforge.runtime.plan import EVAL_SAMPLES, replayable_ids, store_split
from specforge.targets import check_capture_engine, check_packing, check_target, read_config_json, text_config
from specforge.training.init_from import check_init_from
from specforge.training.trainer import checkpoint_root


def check_single_process(cfg: Config) -> tuple[Config, bool]:
    """Every check of ``python -m specforge.train`` (``specforge.train.run``) before anything loads, in one
    call: ``(the single process's config, whether it trains on a GPU)``."""
    check(cfg)
    pick_device(cfg.model.device)  # model.device=cuda without CUDA: said first, before the target's config is read
    check_run(cfg)  # the config against the target's config.json, before the target loads
    local = single_process(cfg)
    check_memory(local)  # the single process's predicted peak against one GPU (none: no check)
    use_gpu = pick_device(cfg.model.device).type == "cuda"
    check_target_gpus(local, use_gpu)
    return local, use_gpu


def check_placement(cfg: Config) -> None:
    """Every check of the Ray driver before ``start_ray``, in one call: what no placement runs yet
    (``runtime.loop.check``), ``check_run``, and when this process is about
    to start Ray itself, the workers against this machine. (Ray prestarts a worker process per
    CPU it is given, so checking after it started would be too late.) A run that needs GPUs this
    machine lacks is told so first, in seconds: before the target's config is read, before the CPUs."""
    check(cfg)
    local = before_local_ray(cfg)
    if local is not None:
        check_gpus(cfg, *local)
    check_run(cfg)
    check_memory(cfg)
    if local is not None:
        check_resources(cfg, *local)


def check_gpus(cfg: Config, use_gpu: bool, have: Mapping[str, float], where: str) -> None:
    """The GPUs the workers need against those ``where`` has (only where the run wants GPUs)."""
    need = needed_resources(cfg, use_gpu).get("GPU", 0.0)
    if need > have.get("GPU", 0.0) + 1e-9:
        counts = actor_counts(cfg)
        who = ", ".join(f"{n} {kind} worker(s) x {gpus_per_worker(cfg, kind)}" for kind, n in counts.items() if n)
        found = have.get("GPU", 0.0)
        raise ValueError(f"config key 'model.device'={cfg.model.device!r}: this run needs {need:g} GPU(s) ({who}), but "
                         f"{where} has {found:g}{'' if found else ' (torch sees no CUDA device)'}; run it where the "
                         "GPUs are (or join their Ray cluster: ray.address), lower the worker counts, or train on the "
                         "CPU with model.device=cpu")


def check_memory(cfg: Config) -> None:
    """Each device's predicted peak (``specforge/memory.py``: the terms ``--dry-run`` prints) against
    one GPU's memory (``ray.gpu_memory_gib``, else this machine's GPU when the run uses GPUs): a
    ValueError naming the device, both figures and the keys that shrink it. A CPU run on this
    machine: every process's peak together against its available memory (a sample too long for it
    fails here, not in step 1). A driver off the GPU nodes without the key: no check."""
    available, where = memory.available_bytes(cfg)
    if available is not None:
        memory.check_fits(memory_plan(cfg), available, where, cfg, bound_algorithm(cfg))
        return

    if not wants_gpu(cfg.model.device) and not cfg.ray.address:  # every process on this machine's memory
        memory.check_host_fits(memory_plan(cfg), memory.host_available_bytes(), cfg, bound_algorithm(cfg))


def before_local_ray(cfg: Config) -> Optional[tuple[bool, dict[str, float], str]]:
    """When this process is about to start Ray itself (none running, no ``ray.address``): whether
    the workers will use GPUs, and this machine's resources with who has them; else None (a Ray we
    join is checked after joining, against what it reports)."""
    import ray  # lazy: heavy (ray)

    if ray.is_initialized() or cfg.ray.address:
        return None

    use_gpu = wants_gpu(cfg.model.device)
    return (use_gpu, *machine_resources(cfg))


def check_run(cfg: Config) -> None:
    """The config against the target (config.json only) and, offline, the store's meta; the
    ``draft.init_from`` folder's config-level facts first."""
    check_init_from(cfg)

    full = load_target_config(cfg.model)
    target = text_config(full)  # an image-text target: its language model
    algo = bound_algorithm(cfg)
    layers = algo.feature_layers(target.num_hidden_layers)
    check_target(read_config_json(resolve_target_path(cfg.model)) or full, layers)  # the family table's checks
    if cfg.rollout.pack_tokens is not None:
        check_packing(full)
    if cfg.rollout.backend == "vllm" and cfg.placement.mode != "offline":
        check_capture_engine(full, cfg.rollout.tp_size)  # a family vLLM does not serve, heads over TP
        vllm_layer_ids(layers, target.num_hidden_layers)  # a layer the engine cannot capture
        if cfg.rollout.vllm_endpoint is None:
            engine_python(cfg.rollout.vllm_python)  # vLLM not installed: said before any worker starts
            check_storage(cfg)
    algo.check(target)
    heads = cfg.draft.num_attention_heads or target.num_attention_heads
    ParallelDims.from_config(cfg).check_heads(heads)
    check_outputs(cfg)
    if cfg.placement.mode == "offline":
        check_store(cfg, layers, target)


def check_outputs(cfg: Config) -> None:
    """The folders a training run writes (metrics, checkpoints) can be written, before anything
    trains: a save that fails after training would otherwise lose the run."""
    check_writable("train.output_dir", cfg.train.output_dir)
    key = "checkpoint.dir" if cfg.checkpoint.dir else "train.output_dir (its checkpoints/ folder)"
    check_writable(key, checkpoint_root(cfg))


def check_store(cfg: Config, layers: list[int], target) -> None:
    """What the store's meta says that the config can contradict without loading weights (the
    workers compare the target's weight fingerprint too)."""
    root = store_root(cfg)
    check_replay(cfg)
    if not (root / INDEX).is_file():
        return  # prepare_offline names the missing store and how to fill it
    meta = FeatureStore(root).meta
    for key, want, got in (("model.aux_layer_ids", tuple(layers), meta.aux_layer_ids),
                           ("data.max_length", cfg.data.max_length, meta.max_length),
                           ("model.target_path (hidden size)", target.hidden_size, meta.hidden_size)):
        if want != got:
            raise ValueError(f"feature store {root} was captured with {key}={got}, this run has {want}; "
                             f"recapture (python -m specforge.capture) or set {key.split(' ')[0]} to match")
    check_store_eval(cfg, FeatureStore(root))


def check_replay(cfg: Config) -> None:
    """``store.replay_dir``: a complete feature store, not the run's own, with samples to replay and
    the meta of the run's store (every field but the samples' source)."""
    if cfg.store.replay_dir is None:
        return
    key, ref = f"config key 'store.replay_dir'={cfg.store.replay_dir!r}", Path(cfg.store.replay_dir).expanduser()
    if not (ref / INDEX).is_file():
        raise ValueError(f"{key} is not a feature store ({INDEX} missing there); name a folder that "
                         "python -m specforge.capture (or regenerate) wrote, or unset the key")
    own = store_root(cfg)
    if ref.resolve() == own.resolve():
        raise ValueError(f"{key} is the run's own store (store.dir / train.output_dir/features); replay another "
                         "store (the one the draft was trained on before) or unset the key")
    ref_store = FeatureStore(ref)
    if cfg.store.replay_share > 0 and not replayable_ids(ref_store):
        raise ValueError(f"{key} holds {len(ref_store.ids)} samples, none of which may be replayed (its last "
                         "min(8, a tenth) are held out); fill it or set store.replay_share=0")
    if (own / INDEX).is_file():
        check_replay_meta(FeatureStore(own, allow_partial=True), ref_store)


def check_store_eval(cfg: Config, store) -> None:
    """Periodic eval offline holds out the store's last samples (``plan.store_split``: at most a
    tenth of them); too few for one per DP group is refused here, before Ray starts."""
    dp = ParallelDims.from_config(cfg).dp
    held = len(store_split(store, cfg)["eval"])
    if cfg.train.eval_every and min(held, EVAL_SAMPLES) < dp:
        raise ValueError(
            f"config key 'train.eval_every'={cfg.train.eval_every}: periodic eval needs {dp} held-out sample(s) "
            f"(one per data-parallel group), but from a feature store of {len(store.ids)} samples it holds out "
            f"{held} (the last min(data.num_eval={cfg.data.num_eval}, {EVAL_SAMPLES}, a tenth of the store)); "
            f"fill the store with at least {10 * dp} samples or set train.eval_every=0")


# ---------------------------------------------------------------- resources


def actor_counts(cfg: Config) -> dict[str, int]:
    """Workers of the placement by kind (the driver spawns exactly these)."""
    rollout = cfg.rollout.num_workers if cfg.placement.mode == "disaggregated" else 0
    return {"rollout": rollout, "train": cfg.train.num_workers}


def gpus_per_worker(cfg: Config, kind: str) -> int:
    """GPUs one worker of ``kind`` gets on GPUs: the target's ``model.num_gpus`` where the worker
    runs the target (a rollout worker; a colocated train worker), else 1."""
    runs_target = kind == "rollout" or (kind == "train" and cfg.placement.mode == "colocated")
    if not runs_target:
        return 1
    return cfg.rollout.tp_size if cfg.rollout.backend == "vllm" else cfg.model.num_gpus


def needed_resources(cfg: Config, use_gpu: bool) -> dict[str, float]:
    """One bundle per worker: 1 CPU, its GPUs when on GPUs, plus the kind's custom resources."""
    counts = actor_counts(cfg)
    need: dict[str, float] = {"CPU": float(sum(counts.values()))}
    if use_gpu:
        need["GPU"] = float(sum(n * gpus_per_worker(cfg, kind) for kind, n in counts.items()))
    for kind, extra in (("rollout", cfg.ray.rollout_resources), ("train", cfg.ray.train_resources)):
        for name, amount in extra.items():
            need[name] = need.get(name, 0.0) + amount * counts[kind]
    return need


def check_target_gpus(cfg: Config, use_gpu: bool) -> None:
    """A target split over ``model.num_gpus`` GPUs on workers that will not get GPUs: refused by the
    driver, before the data is prepared or a worker starts (a worker would refuse it at its load)."""
    if cfg.model.num_gpus > 1 and not use_gpu and cfg.placement.mode != "offline":
        raise ValueError(f"config key 'model.num_gpus'={cfg.model.num_gpus}: splitting the target over GPUs needs "
                         f"CUDA, and this run's workers get none (model.device={cfg.model.device!r}); use 1")


def check_resources(cfg: Config, use_gpu: bool, have: Mapping[str, float], where: str) -> None:
    """ValueError unless ``have`` (``where`` says whose) holds every worker's bundle."""
    check_target_gpus(cfg, use_gpu)
    counts = actor_counts(cfg)
    keys = "train.num_workers" + (" + rollout.num_workers" if counts["rollout"] else "")
    check_bundles(needed_resources(cfg, use_gpu), have, where,
                  f"config keys {keys} = {' + '.join(str(n) for n in counts.values() if n)} workers",
                  split=cfg.model.num_gpus > 1)


def check_workers(key: str, n: int, use_gpu: bool, have: Mapping[str, float], where: str, gpus: int = 1) -> None:
    """The same check for ``n`` workers of one kind, each 1 CPU (+ ``gpus`` GPUs), set by config ``key``."""
    check_bundles({"CPU": float(n), **({"GPU": float(n * gpus)} if use_gpu else {})}, have, where,
                  f"config key {key}={n} workers", split=gpus > 1)


def check_bundles(need: Mapping[str, float], have: Mapping[str, float], where: str, who: str,
                  split: bool = False) -> None:
    for name, amount in need.items():
        if amount > have.get(name, 0.0) + 1e-9:
            hint = " (set ray.num_cpus to oversubscribe the cores on purpose)" if name == "CPU" else ""
            per = "model.num_gpus per worker that runs the target" if name == "GPU" and split else "one per worker"
            raise ValueError(f"{who} need {amount:g} {name} ({per}), but {where} has "
                             f"{have.get(name, 0.0):g}{hint}")


def machine_resources(cfg: Config) -> tuple[dict[str, float], str]:
    """This machine's cores (``ray.num_cpus`` if set: oversubscribing on purpose) and GPUs."""
    cores = cfg.ray.num_cpus or os.cpu_count() or 1
    have = {"CPU": float(cores), "GPU": float(torch.cuda.device_count() if torch.cuda.is_available() else 0)}
    return have, f"this machine ({'ray.num_cpus' if cfg.ray.num_cpus else 'cores'} = {cores})"


def ray_resources(cfg: Config, started_here: bool) -> tuple[dict[str, float], str]:
    """What the workers can get: a Ray we joined reports its cluster; a Ray we started here has
    this machine's cores (``ray.num_cpus`` if set), whatever CPU count it was started with."""
    import ray  # lazy: heavy (ray)

    have = dict(ray.cluster_resources())
    if started_here and not cfg.ray.address:
        mine, where = machine_resources(cfg)
        return {**have, "CPU": mine["CPU"]}, where
    return have, f"the Ray cluster ({cfg.ray.address or 'already running'})"
