"""Bad input: each is a clear error naming the problem (or a counted skip for a data row), found
before any worker starts. One test per case; tiny random Llama target (6 layers, 4 heads, vocab 297).

| input | what it gets | test |
|---|---|---|
| ``train.num_workers=64`` on 2 cores | error before Ray starts: keys, 64 CPU needed, cores | \
test_more_workers_than_cores_* |
| ``regenerate.num_workers=64`` on 2 cores | error before Ray starts | \
test_more_regenerate_workers_than_cores_checked_before_ray_starts |
| ``regenerate.num_workers`` > 1 with ``regenerate.backend=openai`` | error pointing at regenerate.concurrency | \
test_regenerate_workers_with_the_openai_backend_is_an_error |
| ``placement.max_inflight_mb`` below one step's features | \
error before the first step naming the key and the MB needed | \
tests/test_memory_bound.py::test_a_budget_smaller_than_one_step_is_refused_before_training |
| workers need GPUs / custom resources the cluster lacks | error naming the resource and the numbers | \
test_resources_table |
| ``ray.num_cpus=64`` (oversubscribe on purpose) | accepted | test_ray_num_cpus_oversubscribes_on_purpose |
| ``train.max_steps=-1`` | error naming the key | test_config_error |
| ``train.max_minutes=-5`` | error naming the key | test_config_error |
| other out-of-range numbers (log_every=0, betas, top_p, lr) | error naming key and value | test_config_error |
| ``model.aux_layer_ids=[26,14,1]`` / ``[1,1,2]`` | error: ascending, no repeats | test_config_error |
| ``model.aux_layer_ids=[1,2]`` | error: exactly 3 | test_config_error |
| ``model.aux_layer_ids=[1,14,29]`` (30 layers) / ``[1,14,99]`` | \
error from config.json, before Ray starts, every placement | \
test_aux_ids_checked_against_the_target, test_every_placement_checks_the_target_before_ray |
| ``draft.vocab_size`` > target vocab | error naming both sizes | test_target_table |
| ``parallel.sp_ulysses`` > draft heads | error naming the key | test_target_table |
| ``parallel.sp_ulysses`` that does not divide the heads | accepted: zero heads padded (exact, \
tests/test_parallel_sp.py) | test_target_table |
| dflash2: bad ``draft.conv_*``/``selector_*``/weights, kernel > block, causal window | names the key | \
test_dflash2_config_error |
| dflash2: conv group vs hidden size, top-k vs vocab, ring SP | names the key, nothing loaded | \
test_dflash2_target_table |
| mtp: bad ``draft.num_speculative_steps``/``step_weight_beta``, ``stitch_target_mtp``, aux ids, vocab, SP | \
names the key | test_mtp_config_error |
| mtp: aux ids other than the target's last layer, heads vs kv heads | names the key, nothing loaded | \
test_mtp_target_table |
| xpress: bad ``draft.refiner_*``/``jacobi_passes``/``consistency_*``/loss weights, no loss term, passes 0 \
with a consistency weight, ce_from_data without CE, a sliding window | names the key | test_xpress_config_error |
| xpress: ring SP | names the key, nothing loaded | test_xpress_target_table |
| offline store captured with other aux ids / max_length | refused by the driver, naming the key | \
test_offline_store_meta_is_checked_by_the_driver |
| YAML syntax error in the config file | names the file, line and column | test_yaml_syntax_error_names_the_file |
| ``lr: 1e-4`` in a YAML file | a float, as on the command line | test_yaml_float_like_the_command_line |
| override that is not valid YAML (``train.betas=[0.9``) | error naming the override | test_config_error |
| truncated target ``model.safetensors`` | error naming the file | test_truncated_target_weights_name_the_file |
| truncated draft ``model.safetensors`` / ``config.json`` (eval, resume) | error naming the file | \
test_truncated_draft_checkpoint_names_the_file |
| corrupt / truncated feature-store shard | names the shard and the capture that redoes it | \
test_corrupt_store_shard_names_the_file |
| data rows: bad JSON, not an object, no turn list, empty conversation, turn not an object, unknown role, non-string \
content, empty content, no assistant turn | counted skips by reason | test_bad_row_is_a_counted_skip |
| over-long row | truncated to data.max_length, counted | test_over_long_row_is_truncated_and_counted |
| ``data prepare``: missing data path, empty file, no usable rows | one ``error:`` line, exit 1 | \
test_data_cli_one_line_error |
| ``eval``: missing model, draft folder that is not a checkpoint | one ``error:`` line, exit 1 | \
test_eval_one_line_error |
| any ``python -m specforge.*`` entry point (ray_train, data, train, eval, regenerate, capture) | \
one ``error:`` line, no traceback, exit 1 | test_every_entry_point_prints_one_error_line |
| unknown key, wrong type | error naming the dotted key | tests/test_config.py |
| ``checkpoint.dir`` / ``train.output_dir`` read-only, or an existing file | \
error naming the key before anything loads | test_unwritable_output_folder_is_refused_before_anything_loads |
| capture / regenerate / training / adapt: ``store.dir``, ``regenerate.output`` or ``rollout.vllm_storage`` \
read-only (hf and vllm) | one ``error:`` line naming the key before the target or its engine starts | \
test_capture_and_regenerate_refuse_an_unwritable_output_before_a_model_or_engine_starts |
| the final save fails anyway (disk turns read-only or full) | saved to a rescue folder the error names, exit 1 | \
test_a_failed_final_save_is_rescued_and_exits_non_zero, test_a_failed_final_save_in_ray_exits_non_zero |
| ``checkpoint.resume=false`` where checkpoints are | moved to ``<checkpoint dir>/previous-<time>``, said, hashes kept \
| test_a_fresh_start_moves_old_checkpoints_aside |
| eval: a draft of another target with the same shape | error (the fingerprint training_state.pt records) unless \
``--allow-mismatch`` | test_eval_refuses_a_draft_of_another_target |
| eval: ``model.aux_layer_ids`` other than the draft's | error unless ``--allow-mismatch``; without the key each draft \
runs on its own layers | test_eval_runs_a_draft_on_its_own_layers |
| eval: a draft shaped for another target (hidden, vocab, layers) | error before the target loads | \
test_eval_refuses_a_draft_shaped_for_another_target |
| eval: ``--num-prompts -3`` (and the other counts) | error naming the flag | test_eval_argument_ranges |
| ``train.max_steps=0`` | error: >= 1 or null | test_config_error_messages_offer_only_valid_fixes |
| ``ray.address`` where no Ray head runs | error within ``parallel.timeout_s`` naming the key | \
test_a_dead_ray_address_fails_within_the_timeout |
| ``train_eagle3.sh`` with a missing config or an unknown key | one ``error:`` line, exit 1 | \
test_the_default_script_reports_a_bad_config_in_one_line |
| truncated ``training_state.pt`` on resume | error naming the file and the fix | \
test_a_truncated_training_state_names_the_file |
| a data file that is not UTF-8 | error naming file, line and the fix | \
test_a_data_file_that_is_not_utf8_names_file_and_line |
| ``--config configs`` (a folder) | "is a directory", the YAML files in it | test_a_config_folder_is_named_as_one |
| a small store with periodic eval | the store's real limit (a tenth), before Ray starts | \
test_a_small_store_with_periodic_eval_names_the_limit |
| ``model.aux_layer_ids=[1,14,14]`` / endpoint without ``http://`` / ``train.lr=0`` | \
a valid suggestion / the URL to use / no null offered | test_config_error_messages_offer_only_valid_fixes |
| ``model.device=cuda`` / ``model.num_gpus=2`` on a machine without CUDA | \
one line naming the key, the torch build and the way out, before anything loads (train, eval, capture, regenerate) | \
test_the_gpu_path_on_a_machine_without_cuda_is_one_error_line |
| a GPU config on a machine without GPUs | one line: the GPUs needed (by worker kind) and found, before the target's \
config, Ray or the CPUs | test_a_gpu_config_without_gpus_names_the_gpus_before_ray_or_the_hub |
| a hub target whose config.json ships in configs/targets/, the hub off or unreachable | \
the shipped copy, as the dry run reads it | test_a_hub_target_config_is_read_from_its_shipped_copy_when_the_hub_is_off |
| a truncated, empty or foreign weights/state file at ``draft.init_from``, ``eval --draft``, ``export --draft``, a \
resumed checkpoint, ``adapt.draft``, the cached vocab file | \
one line naming the file (``specforge/files.py``, the one reader) | \
test_a_broken_weights_file_is_one_error_line_naming_it |
| ``bench_ttt.py`` on a CPU without bf16 | times the precision training runs (``--precision``), names it | \
test_bench_ttt_measures_the_precision_training_runs |
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specforge import compat
from specforge.cli import run_cli
from specforge.config import load_config
from specforge.preflight import check_resources, check_run, needed_resources, ray_resources
from tests.helpers.data import make_tokenizer, rec, write_jsonl
from tests.helpers.ray_run import cfg_overrides, make_cfg
from tests.helpers.tables import algorithm_cfg, assert_row, config_refused, one_error_line

pytestmark = [pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- config keys


@pytest.mark.parametrize("override, pattern", [
    ("train.max_steps=-1", r"'train\.max_steps'=-1 must be >= 1 or null"),
    ("train.max_minutes=-5", r"'train\.max_minutes'=-5\.0 must be > 0"),
    ("train.log_every=0", r"'train\.log_every'=0 must be >= 1"),
    ("train.lr=0", r"'train\.lr'=0\.0 must be > 0"),
    ("train.betas=[0.9,1.5]", r"'train\.betas'.*two values in \[0, 1\)"),
    ("regenerate.top_p=0", r"'regenerate\.top_p'=0\.0 must be in \(0, 1\]"),
    ("model.aux_layer_ids=[26,14,1]", r"'model\.aux_layer_ids'=\[26, 14, 1\].*ascending.*\[1, 14, 26\]"),
    ("model.aux_layer_ids=[1,1,2]", r"'model\.aux_layer_ids'.*without repeats"),
    ("model.aux_layer_ids=[1,2]", r"'model\.aux_layer_ids'=\[1, 2\].*exactly 3"),
    ("model.aux_layer_ids=[-1,2,3]", r"'model\.aux_layer_ids'.*0\.\.L-2"),
    ("train.betas=[0.9", r"override 'train\.betas=\[0\.9' is not valid YAML"),
])
def test_config_error(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_config(None, [override])


def test_yaml_syntax_error_names_the_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  lr: 1e-4\n  betas: [0.9, 0.95\nmodel:\n  dtype: auto\n")
    with pytest.raises(ValueError, match=rf"config file '{f}' is not valid YAML: .* at line \d+, column \d+") as e:
        load_config(f)
    assert "<unicode string>" not in str(e.value)


def test_yaml_float_like_the_command_line(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  lr: 1e-4\n  max_grad_norm: 5E-1\n  weight_decay: 1.0e-2\n  max_steps: 10\n")
    cfg = load_config(f)
    assert cfg.train.lr == load_config(None, ["train.lr=1e-4"]).train.lr == pytest.approx(1e-4)
    assert cfg.train.max_grad_norm == 0.5 and cfg.train.weight_decay == 0.01
    assert cfg.train.max_steps == 10 and isinstance(cfg.train.max_steps, int)  # ints stay ints


# ---------------------------------------------------------------- the config against the target


def test_aux_ids_checked_against_the_target(assets, tmp_path):
    # the target has 6 layers: ids 0..4 (SGLang captures layer id's output at layer id+1)
    for ids in ("[1,2,5]", "[1,2,99]"):
        with pytest.raises(ValueError, match=r"'model\.aux_layer_ids'.*0\.\.4 \(the target has 6 layers\)"):
            check_run(make_cfg(assets, tmp_path, f"model.aux_layer_ids={ids}"))
    check_run(make_cfg(assets, tmp_path, "model.aux_layer_ids=[0,2,4]"))


@pytest.mark.parametrize("placement", ["single", "colocated", "disaggregated", "offline"])
def test_every_placement_checks_the_target_before_ray(assets, tmp_path, placement, monkeypatch):
    import ray

    import specforge.ray_train as rt
    from specforge.train import run

    def no_ray(*a, **k):
        raise AssertionError("Ray started before the config was checked against the target")

    monkeypatch.setattr(rt, "start_ray", no_ray)
    mode = "colocated" if placement == "single" else placement
    cfg = make_cfg(assets, tmp_path, f"placement.mode={mode}", "model.aux_layer_ids=[1,2,99]",
                   f"store.dir={tmp_path / 'features'}")
    was = ray.is_initialized()
    with pytest.raises(ValueError, match=r"'model\.aux_layer_ids'=\[1, 2, 99\]"):
        (run if placement == "single" else rt.fit)(cfg)
    assert ray.is_initialized() == was


@pytest.mark.parametrize("overrides, pattern", [
    (["draft.vocab_size=5000"], r"'draft\.vocab_size'=5000 exceeds the target's vocabulary \(297 tokens\)"),
    (["parallel.sp_ulysses=8", "train.num_workers=8"], r"'parallel\.sp_ulysses'=8 exceeds the draft's 4 attention"),
    (["parallel.sp_ulysses=4", "train.num_workers=4", "draft.num_attention_heads=2"],
     r"'parallel\.sp_ulysses'=4 exceeds the draft's 2"),
    (["parallel.sp_ulysses=3", "train.num_workers=3"], None),  # 4 heads over 3 ranks: padded, exact
])
def test_target_table(assets, tmp_path, overrides, pattern):
    assert_row(lambda: check_run(make_cfg(assets, tmp_path, *overrides)), pattern)



@pytest.mark.parametrize("overrides, pattern", [
    (["draft.conv_kernel_size=0"], r"'draft\.conv_kernel_size'=0 must be >= 1"),
    (["draft.conv_group_size=0"], r"'draft\.conv_group_size'=0 must be >= 1"),
    (["draft.selector_rank=0"], r"'draft\.selector_rank'=0 must be >= 1"),
    (["draft.selector_top_k=0"], r"'draft\.selector_top_k'=0 must be >= 1"),
    (["draft.selector_weight=-1"], r"'draft\.selector_weight'=-1(\.0)? must be >= 0"),
    (["draft.conv_kernel_size=9"], r"'draft\.conv_kernel_size'=9 exceeds 'draft\.block_size'=8"),
    (["draft.sliding_window=16", "draft.sliding_window_non_causal=false"],
     r"'draft\.sliding_window_non_causal'=false with 'draft\.sliding_window'"),
    (["draft.kl_weight=0"], r"'draft\.kl_weight' and 'draft\.ce_weight' are both 0"),
    (["draft.markov_rank=8"], r"'draft\.markov_rank'=8 applies to draft\.algorithm=dspark, not dflash2"),
])
def test_dflash2_config_error(overrides, pattern):
    cfg = config_refused("dflash2", overrides, pattern, [
        "draft.conv_kernel_size=8", "draft.kl_weight=0", "draft.ce_weight=1", "draft.sliding_window=16",
        "draft.selector_weight=0"])
    assert (cfg.draft.conv_kernel_size, cfg.draft.selector_top_k, cfg.draft.sliding_window_non_causal) == (8, 16, True)


@pytest.mark.parametrize("overrides, pattern", [
    (["draft.conv_group_size=32"], r"'draft\.conv_group_size'=32 does not divide the target's hidden size 48"),
    (["draft.selector_top_k=500"], r"'draft\.selector_top_k'=500 exceeds the target's 297 tokens"),
    (["parallel.sp_ring=2", "train.num_workers=2"], r"DFlash2 has no sequence parallelism"),
    (["draft.conv_group_size=24", "draft.selector_top_k=297"], None),
])
def test_dflash2_target_table(assets, tmp_path, overrides, pattern):
    assert_row(lambda: check_run(algorithm_cfg(assets, tmp_path, "dflash2", *overrides)), pattern)

@pytest.mark.parametrize("overrides, pattern", [
    (["draft.num_speculative_steps=0"], r"'draft\.num_speculative_steps'=0 must be >= 1"),
    (["draft.step_weight_beta=0"], r"'draft\.step_weight_beta'=0(\.0)? must be > 0"),
    (["draft.step_weight_beta=-0.5"], r"'draft\.step_weight_beta'=-0\.5 must be > 0"),
    (["draft.stitch_target_mtp=true"], r"'draft\.stitch_target_mtp'=true: the target loader drops"),
    (["model.aux_layer_ids=[1,14,26]"], r"'model\.aux_layer_ids'=\[1, 14, 26\]: an MTP draft reads the target's last"),
    (["draft.vocab_size=8000"], r"'draft\.vocab_size'=8000 applies to draft\.algorithm=eagle3, not mtp"),
    (["parallel.sp_ring=2", "train.num_workers=2"], r"'parallel\.sp_ring'=2: MTP has no sequence parallelism"),
    (["parallel.sp_ulysses=2", "train.num_workers=2"], r"'parallel\.sp_ulysses'=2 .* MTP has no sequence par"),
    (["draft.block_size=4"], r"draft\.block_size"),
])
def test_mtp_config_error(overrides, pattern):
    cfg = config_refused("mtp", overrides, pattern, ["draft.num_speculative_steps=1", "draft.step_weight_beta=2.0",
                                                     "draft.stitch_target_mtp=false", "model.aux_layer_ids=[29]"])
    assert (cfg.draft.num_speculative_steps, cfg.draft.step_weight_beta) == (1, 2.0)


@pytest.mark.parametrize("overrides, pattern", [
    (["model.aux_layer_ids=[2]"], r"'model\.aux_layer_ids'=\[2\]: an MTP draft reads the target's last layer alone"),
    (["draft.num_key_value_heads=5"], r"'draft\.num_key_value_heads'=5 does not divide the"),
    ([], None),
])
def test_mtp_target_table(assets, tmp_path, overrides, pattern):
    cfg = algorithm_cfg(assets, tmp_path, "mtp", *overrides, drop=("model.aux_layer_ids=",))
    assert_row(lambda: check_run(cfg), pattern)


@pytest.mark.parametrize("overrides, pattern", [
    (["draft.refiner_rank=0"], r"'draft\.refiner_rank'=0 must be >= 1"),
    (["draft.refiner_mlp_ratio=0"], r"'draft\.refiner_mlp_ratio'=0 must be >= 1"),
    (["draft.jacobi_passes=-1"], r"'draft\.jacobi_passes'=-1 must be >= 0"),
    (["draft.consistency_passes=-1"], r"'draft\.consistency_passes'=-1 must be >= 0"),
    (["draft.consistency_weight=-0.5"], r"'draft\.consistency_weight'=-0\.5 must be >= 0"),
    (["draft.anchor_weight=-1"], r"'draft\.anchor_weight'=-1(\.0)? must be >= 0"),
    (["draft.ce_weight=-1"], r"'draft\.ce_weight'=-1(\.0)? must be >= 0"),
    (["draft.tv_weight=-1"], r"'draft\.tv_weight'=-1(\.0)? must be >= 0"),
    (["draft.kl_weight=-1"], r"'draft\.kl_weight'=-1(\.0)? must be >= 0"),
    (["draft.loss_gamma=0"], r"'draft\.loss_gamma'=0(\.0)? must be > 0"),
    (["draft.block_size=1"], r"'draft\.block_size'=1 must be >= 2"),
    (["draft.ce_weight=0", "draft.tv_weight=0"], r"'draft\.ce_weight', 'draft\.tv_weight' and 'draft\.kl_weight' "
                                                 r"are all 0"),
    (["draft.consistency_passes=0"], r"'draft\.consistency_passes'=0 with 'draft\.consistency_weight'=0\.3"),
    (["draft.ce_from_data=true", "draft.ce_weight=0"], r"'draft\.ce_from_data'=true with 'draft\.ce_weight'=0"),
    (["draft.sliding_window=16"], r"'draft\.sliding_window'=16 applies to draft\.algorithm=dflash, not xpress"),
    (["draft.selector_rank=8"], r"'draft\.selector_rank'=8 applies to draft\.algorithm=dflash2, not xpress"),
])
def test_xpress_config_error(overrides, pattern):
    cfg = config_refused("xpress", overrides, pattern, [
        "draft.refiner_rank=1", "draft.jacobi_passes=0", "draft.consistency_passes=0", "draft.consistency_weight=0",
        "draft.ce_weight=0", "draft.tv_weight=0", "draft.kl_weight=1", "draft.anchor_weight=0"])
    assert (cfg.draft.refiner_rank, cfg.draft.jacobi_passes, cfg.draft.kl_weight) == (1, 0, 1.0)


@pytest.mark.parametrize("overrides, pattern", [
    (["parallel.sp_ring=2", "train.num_workers=2"], r"XPress has no sequence parallelism"),
    (["parallel.sp_ulysses=2", "train.num_workers=2"], r"XPress has no Ulysses sequence parallelism"),
    (["draft.refiner_rank=4", "draft.block_size=3"], None),
])
def test_xpress_target_table(assets, tmp_path, overrides, pattern):
    assert_row(lambda: check_run(algorithm_cfg(assets, tmp_path, "xpress", *overrides)), pattern)


def test_offline_store_meta_is_checked_by_the_driver(assets, tmp_path):
    from specforge.data.store import FeatureStoreWriter, StoreMeta

    root = tmp_path / "features"
    meta = StoreMeta(target="t", tokenizer="k", vocab_size=297, aux_layer_ids=(0, 1, 2), hidden_size=48,
                     max_length=64, source="rows")
    with FeatureStoreWriter(root, meta) as w:
        w.add(0, torch.arange(5), torch.ones(5), torch.randn(5, 144), torch.randn(5, 48), torch.arange(5))
    offline = ("placement.mode=offline", f"store.dir={root}")
    check_run(make_cfg(assets, tmp_path, *offline, "model.aux_layer_ids=[0,1,2]"))
    with pytest.raises(ValueError, match=r"captured with model\.aux_layer_ids=\(0, 1, 2\), this run has \(1, 2, 3\)"):
        check_run(make_cfg(assets, tmp_path, *offline, "model.aux_layer_ids=[1,2,3]"))
    with pytest.raises(ValueError, match=r"data\.max_length=64, this run has 32"):
        check_run(make_cfg(assets, tmp_path, *offline, "model.aux_layer_ids=[0,1,2]", "data.max_length=32"))


# ---------------------------------------------------------------- resources


@pytest.mark.parametrize("overrides, use_gpu, have, pattern", [
    (["train.num_workers=64"], False, {"CPU": 2.0},
     r"train\.num_workers = 64 workers need 64 CPU \(one per worker\), but this machine has 2 .*ray\.num_cpus"),
    (["placement.mode=disaggregated", "rollout.num_workers=2", "train.num_workers=2"], False, {"CPU": 3.0},
     r"train\.num_workers \+ rollout\.num_workers = 2 \+ 2 workers need 4 CPU"),
    (["train.num_workers=2"], True, {"CPU": 8.0, "GPU": 1.0}, r"need 2 GPU .* has 1"),
    (["train.num_workers=4", "ray.train_resources={train_node: 1}"], False, {"CPU": 8.0, "train_node": 2.0},
     r"need 4 train_node .* has 2"),
    (["train.num_workers=2"], False, {"CPU": 2.0}, None),
])
def test_resources_table(overrides, use_gpu, have, pattern):
    assert_row(lambda: check_resources(load_config(None, overrides), use_gpu, have, "this machine"), pattern)


def test_ray_num_cpus_oversubscribes_on_purpose(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 65.0})  # what start_ray raised it to
    cfg = load_config(None, ["train.num_workers=64"])
    have, where = ray_resources(cfg, started_here=True)
    assert have["CPU"] == (os.cpu_count() or 1) and "cores" in where  # the machine, not the raised count
    if (os.cpu_count() or 1) < 64:
        with pytest.raises(ValueError, match="64 CPU"):
            check_resources(cfg, False, have, where)
    cfg = load_config(None, ["train.num_workers=64", "ray.num_cpus=64"])
    check_resources(cfg, False, *ray_resources(cfg, started_here=True))
    assert needed_resources(cfg, False) == {"CPU": 64.0}
    joined = load_config(None, ["train.num_workers=64", "ray.address=auto"])
    assert ray_resources(joined, started_here=False)[0]["CPU"] == 65.0  # a joined cluster reports itself


def test_more_workers_than_cores_checked_before_ray_starts(assets, tmp_path, monkeypatch, no_ray):
    """Ray prestarts a worker process per CPU it is given: the check must come before ray.init. (``no_ray``:
    a session an earlier module left up would be joined instead; this test would then prove nothing.)"""
    import ray

    import specforge.preflight as pf

    monkeypatch.setattr(pf.os, "cpu_count", lambda: 2)
    with pytest.raises(ValueError, match=r"train\.num_workers = 64 workers need 64 CPU .* this machine \(cores = 2\)"):
        pf.check_placement(make_cfg(assets, tmp_path, "train.num_workers=64"))
    pf.check_placement(make_cfg(assets, tmp_path, "train.num_workers=2"))
    assert not ray.is_initialized()


def test_more_regenerate_workers_than_cores_checked_before_ray_starts(assets, tmp_path, monkeypatch, no_ray):
    import ray

    import specforge.preflight as pf
    from specforge.regenerate import run_ray

    monkeypatch.setattr(pf.os, "cpu_count", lambda: 2)
    cfg = make_cfg(assets, tmp_path, "regenerate.num_workers=64")
    with pytest.raises(ValueError,
                       match=r"regenerate\.num_workers=64 workers need 64 CPU .* this machine \(cores = 2\)"):
        run_ray(cfg, [], tmp_path / "out.jsonl", None)
    assert not ray.is_initialized()


def test_regenerate_workers_with_the_openai_backend_is_an_error():
    from specforge.regenerate import validate

    cfg = load_config(None, ["regenerate.backend=openai", "regenerate.endpoint=http://localhost:1/v1",
                             "regenerate.num_workers=4"])
    with pytest.raises(ValueError, match=r"'regenerate\.num_workers' \(4\) applies only to regenerate\.backend=local.*"
                                         r"regenerate\.concurrency"):
        validate(cfg)
    validate(load_config(None, ["regenerate.backend=openai", "regenerate.endpoint=http://localhost:1/v1"]))


@pytest.mark.slow
def test_more_workers_than_cores_fails_before_any_worker(assets, tmp_path):
    """More train workers than cores, end to end: the CLI exits with one line, and Ray never starts."""
    if (os.cpu_count() or 1) >= 64:
        pytest.skip("this machine has 64 cores")
    out = _cli(["specforge.ray_train", *_base(assets, tmp_path), "train.num_workers=64"], timeout=240)
    assert out.returncode == 1, out.stderr[-2000:]
    one_error_line(out.stderr, "train.num_workers = 64 workers need 64 CPU")
    assert not Path(f"/tmp/sfray-bad-{os.getpid()}").exists()  # the run's ray.temp_dir: Ray never started


# ---------------------------------------------------------------- files


def test_truncated_target_weights_name_the_file(assets, tmp_path):
    from specforge.config import ModelConfig
    from specforge.models.target import load_target

    broken = tmp_path / "target"
    shutil.copytree(assets / "target", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"target weight file '{weights}' cannot be read"):
        load_target(ModelConfig(target_path=str(broken), device="cpu"))


def test_truncated_draft_checkpoint_names_the_file(tmp_path):
    from safetensors.torch import save_file

    from specforge.training.checkpoint import load_draft_folder

    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    weights = tmp_path / "model.safetensors"
    save_file({"fc.weight": torch.zeros(64, 192)}, str(weights))
    assert load_draft_folder(tmp_path)[1]["fc.weight"].shape == (64, 192)
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"'{weights}' cannot be read .*truncated or corrupt draft checkpoint"):
        load_draft_folder(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 6')
    with pytest.raises(ValueError, match=rf"'{tmp_path / 'config.json'}' is not valid JSON"):
        load_draft_folder(tmp_path)


def test_corrupt_store_shard_names_the_file(tmp_path):
    from specforge.data.store import FeatureStore, FeatureStoreWriter, StoreMeta

    meta = StoreMeta(target="t", tokenizer="k", vocab_size=50, aux_layer_ids=(0, 1, 2), hidden_size=8,
                     max_length=16, source="rows")
    with FeatureStoreWriter(tmp_path, meta) as w:
        w.add(0, torch.arange(6), torch.ones(6), torch.randn(6, 24), torch.randn(6, 8), torch.arange(6))
    (shard,) = tmp_path.glob("shard-*.safetensors")
    shard.write_bytes(b"\xff" * 16 + shard.read_bytes()[16:])
    with pytest.raises(ValueError, match=rf"feature store shard {shard} is corrupt \(sha256 differs .* delete it"):
        FeatureStore(tmp_path).read(0)


# ---------------------------------------------------------------- data rows


BAD_ROWS = {
    "bad json": "{broken",
    "record is not an object": [1, 2],
    "no conversations/messages list": {"text": "hi"},
    "empty conversation": {"conversations": []},
    "turn is not an object": {"conversations": ["hi", {"from": "gpt", "value": "x"}]},
    "unknown role": {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]},
    "non-string content": {"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "y"}]},
    "empty content": {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "y"}]},
    "no assistant turn": {"conversations": [{"from": "human", "value": "anyone?"}]},
}
LONG = " ".join(["hello world"] * 200)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from specforge.config import DataConfig
    from specforge.data.prepare import prepare_dataset

    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    good = [rec(f"question {i}", f"answer {i} hello world") for i in range(4)]
    write_jsonl(path, good[:2] + list(BAD_ROWS.values()) + [rec("question", LONG)] + good[2:])
    return prepare_dataset(DataConfig(path=str(path), max_length=64, num_eval=1), make_tokenizer(), cache_dir=None,
                           progress=False)


@pytest.mark.parametrize("reason", list(BAD_ROWS))
def test_bad_row_is_a_counted_skip(prepared, reason):
    stats = prepared.stats
    assert stats.skipped.get(reason) == 1, stats.skipped
    assert f"  {reason}" in stats.table()  # the statistics table lists it by reason


def test_over_long_row_is_truncated_and_counted(prepared):
    stats = prepared.stats
    assert stats.rows_read == 4 + len(BAD_ROWS) + 1 and stats.rows_kept == 5 and stats.truncated == 1
    lengths = list(prepared.train["length"]) + list(prepared.eval["length"])
    assert max(lengths) == 64


# ---------------------------------------------------------------- entry points: one error line


def _base(assets, tmp_path):
    return [f"model.target_path={assets / 'target'}", "model.device=cpu", f"model.cache_dir={tmp_path / 'cache'}",
            f"data.path={assets / 'data.jsonl'}", "data.max_length=64", "data.num_eval=2", "draft.vocab_size=64",
            "train.max_steps=1", "train.eval_every=0", f"train.output_dir={tmp_path / 'run'}", "tracking.wandb=false",
            f"ray.temp_dir=/tmp/sfray-bad-{os.getpid()}"]



@pytest.mark.parametrize("case, data, needle", [
    ("missing data path", "nowhere.jsonl", "does not exist"),
    ("empty file", "empty.jsonl", "no usable conversation among 0 rows"),
    ("no usable rows", "bad.jsonl",
     "no usable conversation among 2 rows (no assistant turn: 1, empty conversation: 1)"),
])
def test_data_cli_one_line_error(assets, tmp_path, capsys, case, data, needle):
    from specforge.data.__main__ import main

    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "bad.jsonl", [BAD_ROWS["no assistant turn"], BAD_ROWS["empty conversation"]])
    args = [a for a in _base(assets, tmp_path) if not a.startswith("data.path=")]
    assert main(["prepare", "--no-progress", *args, f"data.path={tmp_path / data}"]) == 1
    one_error_line(capsys.readouterr().err, needle)


def test_eval_one_line_error(assets, tmp_path, capsys):
    import specforge.eval as ev

    base = _base(assets, tmp_path)
    assert run_cli(lambda: ev.main(["--draft", "prompt-lookup", *base, f"model.target_path={tmp_path / 'nope'}"])) == 1
    one_error_line(capsys.readouterr().err, "model.target_path", "does not exist")
    (tmp_path / "notackpt").mkdir()
    assert run_cli(lambda: ev.main(["--draft", str(tmp_path / "notackpt"), "--num-prompts", "1", *base])) == 1
    one_error_line(capsys.readouterr().err, "is not a draft checkpoint")


def _cli(args, timeout=120, env=None):
    env = dict(os.environ, WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", **(env or {}))
    env.pop("SPECFORGE_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("module", [["specforge.ray_train"], ["specforge.data", "prepare"], ["specforge.train"],
                                    ["specforge.eval", "--draft", "prompt-lookup"], ["specforge.regenerate"],
                                    ["specforge.capture"]], ids=lambda m: m[0])
def test_every_entry_point_prints_one_error_line(assets, tmp_path, module):
    out = _cli([*module, *_base(assets, tmp_path), f"model.target_path={tmp_path / 'missing-model'}"])
    assert out.returncode == 1, out.stderr[-2000:]
    one_error_line(out.stderr, "missing-model", "does not exist")


def test_a_bad_key_is_told_before_torch_is_imported():
    """``python -m specforge.train`` parses its flags and its config before it imports torch: an unknown key is
    one line in ~0.1 s instead of ~3 s. Checked in a fresh interpreter (``sys.modules`` after the call); the
    control: ``specforge.ray_train``, which imports torch and Ray at its top, says the same line with torch
    imported."""
    code = ("import sys\nfrom specforge.cli import run_cli\nfrom specforge.{m} import main\n"
            "rc = run_cli(lambda: main(['train.max_step=3']))\nprint(rc, 'torch' in sys.modules)")
    for module, torch_imported in (("train", False), ("ray_train", True)):
        out = subprocess.run([sys.executable, "-c", code.format(m=module)], cwd=REPO, capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, WANDB_MODE="offline"))
        assert out.stdout.split() == ["1", str(torch_imported)], (module, out.stdout, out.stderr[-2000:])
        one_error_line(out.stderr, "unknown config key 'train.max_step'")


# ---------------------------------------------------------------- nothing lost, nothing silent

# A folder on a read-only mount: root ignores mode bits, so chmod cannot make a folder unwritable here.
READ_ONLY = Path("/sys/fs/specforge-read-only")


def _hashes(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _single(assets, tmp_path, *overrides):
    """A 2-step single-process run of the tiny target; its checkpoint folder."""
    from specforge.train import run

    run(make_cfg(assets, tmp_path / "run", "train.num_workers=1", "train.max_steps=2", *overrides))
    return tmp_path / "run" / "checkpoints"


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_capture_and_regenerate_refuse_an_unwritable_output_before_a_model_or_engine_starts(
        assets, tmp_path, backend, monkeypatch, capsys):
    """``python -m specforge.capture`` with ``store.dir`` on a read-only mount, and ``python -m
    specforge.regenerate`` with its output or store there: one error line naming the key, before the
    target loads or its engine starts (with vLLM that start is minutes on a big target). Control: a
    writable store.dir gets past the check (the target then loads)."""
    import specforge.capture as capture
    import specforge.regenerate as regenerate

    def started(*args, **kw):
        raise AssertionError("the target (or its engine) started before the outputs were checked")

    for module in (capture, regenerate):
        monkeypatch.setattr(module, "load_target", started)
        monkeypatch.setattr(module, "engine_factory", started)
    base = [*cfg_overrides(assets, tmp_path / "run"), f"rollout.backend={backend}", "placement.mode=disaggregated"]
    assert capture.main(["--no-progress", *base, f"store.dir={READ_ONLY / 'store'}"]) == 1
    one_error_line(capsys.readouterr().err, "config key 'store.dir'", "is not writable")
    assert regenerate.main([*base, f"regenerate.output={READ_ONLY / 'out.jsonl'}"]) == 1
    one_error_line(capsys.readouterr().err, "config key 'regenerate.output'", "is not writable")
    assert regenerate.main([*base, f"regenerate.output={tmp_path / 'out.jsonl'}", "regenerate.capture_features=true",
                            f"store.dir={READ_ONLY / 'store'}"]) == 1
    one_error_line(capsys.readouterr().err, "config key 'store.dir'", "is not writable")
    if backend == "vllm":  # where the engine will write its hidden states for us
        ro = [f"store.dir={tmp_path / 'store'}", f"rollout.vllm_storage={READ_ONLY / 'handoff'}"]
        assert capture.main(["--no-progress", *base, *ro]) == 1
        one_error_line(capsys.readouterr().err, "config key 'rollout.vllm_storage'", "is not writable")
        assert regenerate.main([*base, f"regenerate.output={tmp_path / 'out.jsonl'}", *ro]) == 1
        one_error_line(capsys.readouterr().err, "config key 'rollout.vllm_storage'", "is not writable")
        with pytest.raises(ValueError, match="rollout.vllm_storage.*is not writable"):
            check_run(make_cfg(assets, tmp_path, "rollout.backend=vllm", "placement.mode=disaggregated",
                               f"rollout.vllm_storage={READ_ONLY / 'handoff'}",
                               f"rollout.vllm_python={sys.executable}"))
        from specforge.adapt.rounds import check as adapt_check  # lazy: the adapt package's imports

        with pytest.raises(ValueError, match="rollout.vllm_storage.*is not writable"):  # before the draft is read
            adapt_check(make_cfg(assets, tmp_path, "rollout.backend=vllm", f"adapt.dir={tmp_path / 'adapt'}",
                                 f"rollout.vllm_storage={READ_ONLY / 'handoff'}"))
    with pytest.raises(AssertionError, match="started before the outputs were checked"):  # the control
        capture.main(["--no-progress", *base, f"store.dir={tmp_path / 'store'}"])


@pytest.mark.parametrize("key", ["checkpoint.dir", "train.output_dir"])
def test_unwritable_output_folder_is_refused_before_anything_loads(assets, tmp_path, key, monkeypatch):
    import specforge.ray_train as rt

    monkeypatch.setattr(rt, "start_ray", lambda *a, **k: pytest.fail("Ray started before the folders were checked"))
    with pytest.raises(ValueError, match=rf"'{key}'='{READ_ONLY}/run' is not writable"):
        rt.fit(make_cfg(assets, tmp_path, f"{key}={READ_ONLY / 'run'}"))
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match=rf"'{key}'='{tmp_path / 'a-file'}' is a file, not a folder"):
        check_run(make_cfg(assets, tmp_path, f"{key}={tmp_path / 'a-file'}"))
    check_run(make_cfg(assets, tmp_path, f"{key}={tmp_path / 'fresh' / 'deeper'}"))  # negative control: creatable


def test_a_failed_final_save_is_rescued_and_exits_non_zero(assets, tmp_path, monkeypatch, capsys):
    """The disk turns read-only during training (the preflight passed): the trained state goes
    to a rescue folder the error names, and the exit code is 1."""
    import tempfile

    import specforge.preflight as pf
    from specforge.train import main
    from specforge.training.checkpoint import load_draft_folder, load_train_state

    monkeypatch.setattr(pf, "check_outputs", lambda cfg: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    args = cfg_overrides(assets, tmp_path / "run", "train.num_workers=1", "train.max_steps=2",
                         f"checkpoint.dir={READ_ONLY / 'ckpt'}")
    assert run_cli(lambda: main(args)) == 1
    err = capsys.readouterr().err
    one_error_line(err, f"could not write checkpoint step 2 under '{READ_ONLY / 'ckpt'}'", "saved in")
    (rescued,) = (tmp_path / "tmp").glob("specforge-rescue-*/step-000002")
    assert str(rescued) in err and load_train_state(rescued)["step"] == 2
    assert "fc.weight" in load_draft_folder(rescued)[1]


@pytest.mark.slow
@pytest.mark.ray
def test_a_failed_final_save_in_ray_exits_non_zero(assets, tmp_path, monkeypatch, no_ray, _ray_zygote):
    """The run starts its own cluster (its workers inherit this TMPDIR), forking its workers from the suite's
    zygote and without Ray's monitors, as the session's cluster does (alone: 23 -> 20 and 21 CPU-s)."""
    import tempfile

    import specforge.preflight as pf
    from specforge.ray_train import fit
    from specforge.runtime.actors import WorkerError
    from tests.conftest import forking_workers, lean_cluster

    monkeypatch.setattr(pf, "check_outputs", lambda cfg: None)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the Ray worker's rescue folder
    monkeypatch.setattr(tempfile, "tempdir", None)
    (tmp_path / "tmp").mkdir()
    cfg = make_cfg(assets, tmp_path / "run", "train.num_workers=1", "train.max_steps=2", "placement.mode=colocated",
                   f"checkpoint.dir={READ_ONLY / 'ckpt'}", f"ray.temp_dir=/tmp/sfray-save-{os.getpid()}")
    with pytest.raises(WorkerError, match=r"could not write checkpoint step 2 .* saved in '.*specforge-rescue-"):
        with forking_workers(_ray_zygote), lean_cluster():
            fit(cfg)
    assert list((tmp_path / "tmp").glob("specforge-rescue-*/step-000002/model.safetensors"))


def test_a_fresh_start_moves_old_checkpoints_aside(assets, tmp_path, capsys):
    root = _single(assets, tmp_path)
    before = _hashes(root)
    assert "step-000002/model.safetensors" in before
    # the resume refusal's hint, followed in the same folder: another vocab, checkpoint.resume=false
    _single(assets, tmp_path, "draft.vocab_size=32", "checkpoint.resume=false")
    (moved,) = root.glob("previous-*")
    assert f"moved the existing checkpoints of {root} aside to {moved}" in capsys.readouterr().out
    assert _hashes(moved) == before  # every old file kept, byte for byte
    assert (root / "step-000002").is_dir() and _hashes(root / "step-000002") != _hashes(moved / "step-000002")


def test_a_truncated_training_state_names_the_file(assets, tmp_path):
    root = _single(assets, tmp_path)
    state = root / "step-000002" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:200])
    with pytest.raises(ValueError, match=rf"'{state}' cannot be read .*truncated or corrupt checkpoint"):
        _single(assets, tmp_path, "checkpoint.resume=true")


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """A 2-step draft of the tiny target, and a second target of the same shape, other weights."""
    from transformers import LlamaForCausalLM

    from specforge.train import run

    out = tmp_path_factory.mktemp("trained")
    ckpt = run(make_cfg(assets, out / "run", "train.num_workers=1", "train.max_steps=2"))
    other = out / "other-target"
    shutil.copytree(assets / "target", other)
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaForCausalLM.config_class.from_pretrained(other)).save_pretrained(other)
    return ckpt, other


def _eval(assets, tmp_path, *args):
    import specforge.eval as ev

    base = [a for a in _base(assets, tmp_path) if not a.startswith("train.")]
    return run_cli(lambda: ev.main(["--num-prompts", "1", "--max-new-tokens", "4", "--chain", "2", *args,
                                    *base, "model.dtype=float32"]))


def test_eval_refuses_a_draft_of_another_target(assets, tmp_path, trained, capsys):
    ckpt, other = trained
    assert _eval(assets, tmp_path, "--draft", str(ckpt), "--target", str(other)) == 1
    one_error_line(capsys.readouterr().err, f"draft '{ckpt}' was trained with another target", "--allow-mismatch")
    assert _eval(assets, tmp_path, "--draft", str(ckpt), "--target", str(other), "--allow-mismatch") == 0
    assert "evaluating anyway" in capsys.readouterr().err
    assert _eval(assets, tmp_path, "--draft", str(ckpt)) == 0  # negative control: its own target passes
    assert "another target" not in capsys.readouterr().err


def test_eval_runs_a_draft_on_its_own_layers(assets, tmp_path, trained, capsys, monkeypatch):
    import specforge.eval as ev
    from specforge.config import load_config

    ckpt, _ = trained
    own = json.loads((ckpt / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert own == [1, 2, 2]  # the default of a 6-layer target
    assert _eval(assets, tmp_path, "--draft", str(ckpt), "model.aux_layer_ids=[0,2,4]") == 1
    one_error_line(capsys.readouterr().err, "trained on target layers [1, 2, 2]", "asks for [0, 2, 4]")
    # without the key, every draft runs on the layers it was trained on (here a draft of [0, 2, 4])
    cfg = load_config(None, [a for a in _base(assets, tmp_path) if not a.startswith("train.")])
    relabeled = tmp_path / "relabeled"
    shutil.copytree(ckpt, relabeled)
    hf = json.loads((relabeled / "config.json").read_text())
    hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 4]
    (relabeled / "config.json").write_text(json.dumps(hf))
    assert compat.check_drafts([str(ckpt), str(relabeled), "prompt-lookup"], cfg, allow=False) == {
        str(ckpt): [1, 2, 2], str(relabeled): [0, 2, 4]}
    seen = []
    real = ev.speculative_decode
    monkeypatch.setattr(ev, "speculative_decode",
                        lambda t, *a, **k: seen.append(list(t.aux_layer_ids)) or real(t, *a, **k))
    assert _eval(assets, tmp_path, "--draft", str(relabeled)) == 0
    assert seen and all(ids == [0, 2, 4] for ids in seen)


def test_eval_refuses_a_draft_shaped_for_another_target(tmp_path):
    from types import SimpleNamespace

    from specforge.compat import check_draft_shape

    hf = {"hidden_size": 64, "vocab_size": 297, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    ours = SimpleNamespace(hidden_size=64, vocab_size=297, num_hidden_layers=6)
    check_draft_shape("d", hf, ours)  # negative control: the target it was trained for
    for target, needle in ((SimpleNamespace(hidden_size=576, vocab_size=297, num_hidden_layers=6), "hidden size 64"),
                           (SimpleNamespace(hidden_size=64, vocab_size=49152, num_hidden_layers=6), "297 tokens"),
                           (SimpleNamespace(hidden_size=64, vocab_size=297, num_hidden_layers=4), "only 4 layers")):
        with pytest.raises(ValueError, match=needle):
            check_draft_shape("d", hf, target)
    # an MTP draft reads its target's last layer (L-1, past EAGLE-3's L-2): its own target passes, a shallower
    # one is refused
    mtp = {"architectures": ["MTPDraftModel"], "speculators_model_type": "mtp",
           "transformer_layer_config": {"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 297}}
    check_draft_shape("m", mtp, ours)
    with pytest.raises(ValueError, match="fuses target layers \\[5\\], but this target has only 5 layers"):
        check_draft_shape("m", mtp, SimpleNamespace(hidden_size=64, vocab_size=297, num_hidden_layers=5))


@pytest.mark.parametrize("flag, value", [("--num-prompts", "-3"), ("--max-new-tokens", "0"), ("--chain", "0"),
                                         ("--threads", "0")])
def test_eval_argument_ranges(flag, value):
    import specforge.eval as ev

    with pytest.raises(ValueError, match=rf"{flag} must be >= \d+, got {value}"):
        ev._parse_args(["--draft", "prompt-lookup", flag, value])


@pytest.mark.parametrize("flag, value, needle", [
    ("--engine-n-max", "0", "integers >= 1"), ("--engine-n-max", "2,-1", "integers >= 1"),
    ("--engine-n-max", "two", "integers >= 1"), ("--engine-n-max", ",", "integers >= 1"),
    ("--engine-p-min", "1.5", r"probabilities in \[0, 1\]"), ("--engine-p-min", "x", r"probabilities in \[0, 1\]"),
])
def test_engine_values_are_checked_before_a_server_starts(flag, value, needle, monkeypatch):
    """llama-server dies at once on --spec-draft-n-max 0 and the eval could only report a dead
    connection: the value is refused while the arguments are parsed, naming the flag."""
    import specforge.eval as ev
    import specforge.eval.served as se

    monkeypatch.setattr(se, "find_server", lambda *a, **k: pytest.fail("a server was looked for"))
    with pytest.raises(ValueError, match=rf"^{flag} {value}: expected comma-separated {needle}"):
        ev.main(["--draft", "d", "--engine", "llama.cpp", flag, value])
    assert ev._parse_args(["--draft", "d", "--engine-n-max", "1,3", "--engine-p-min", "0,0.5"])  # good values pass


@pytest.mark.parametrize("override, pattern", [
    ("train.max_steps=0", r"'train\.max_steps'=0 must be >= 1 or null"),
    ("train.lr=0", r"'train\.lr'=0\.0 must be > 0$"),  # lr is not optional: the message offers no null
    ("model.aux_layer_ids=[1,14,14]", r"without repeats.*the default: leave the key unset"),
    ("regenerate.endpoint=127.0.0.1:59999", r"'regenerate\.endpoint'.*http\(s\) URL, e\.g\. 'http://127\.0\.0\.1:59999/v1'"),
])
def test_config_error_messages_offer_only_valid_fixes(override, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_config(None, [override])
    load_config(None, ["regenerate.endpoint=http://127.0.0.1:59999/v1", "train.max_steps=null", "train.epochs=1"])


def test_a_config_folder_is_named_as_one(tmp_path):
    (tmp_path / "run.yaml").write_text("train:\n  max_steps: 3\n")
    with pytest.raises(ValueError,
                       match=rf"'{tmp_path}' is a directory; pass a YAML file, one of: {tmp_path / 'run.yaml'}"):
        load_config(tmp_path)


def test_a_dead_ray_address_fails_within_the_timeout(tmp_path, no_ray):
    import socket
    import time

    from specforge.runtime.actors import check_ray_address, start_ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    cfg = load_config(None, [f"ray.address=127.0.0.1:{port}", "parallel.timeout_s=10"])
    t0 = time.monotonic()
    with pytest.raises(ValueError,
                       match=rf"'ray\.address'='127\.0\.0\.1:{port}': no Ray head answers there within 10 s"):
        start_ray(cfg, 1)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match="must be 'auto' or host:port"):
        check_ray_address("nohostport", 1)
    with socket.socket() as s:  # negative control: something listens
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_ray_address(f"127.0.0.1:{s.getsockname()[1]}", 5)


def test_a_small_store_with_periodic_eval_names_the_limit():
    from types import SimpleNamespace

    from specforge.preflight import check_store_eval

    cfg = load_config(None, ["data.num_eval=6", "train.eval_every=10"])
    with pytest.raises(ValueError, match=r"feature store of 6 samples it holds out 0 .*at least 10 samples"):
        check_store_eval(cfg, SimpleNamespace(ids=list(range(6))))
    check_store_eval(cfg, SimpleNamespace(ids=list(range(10))))  # negative control: a tenth is one sample


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_a_data_file_that_is_not_utf8_names_file_and_line(tmp_path, kind):
    from specforge.data.sharegpt import load_conversations

    good = json.dumps(rec("hi", "hello"))
    path = tmp_path / f"rows.{kind}"
    text = (good + "\n" + good.replace("hello", "h\xe4llo") + "\n") if kind == "jsonl" else \
        f"[{good},\n{good.replace('hello', 'h' + chr(0xe4) + 'llo')}]"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"data file '{path}' is not UTF-8 text: byte 0xe4 at line 2.*iconv"):
        load_conversations(path)
    path.write_bytes(text.encode("utf-8"))
    assert len(load_conversations(path)) == 2  # negative control


def _script(*args, timeout=120):
    env = dict(os.environ, SKIP_INSTALL="1", VENV=sys.prefix)
    return subprocess.run(["bash", "scripts/train_eagle3.sh", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, needle", [(["--config", "configs/nope.yaml"], "'configs/nope.yaml' does not exist"),
                                          (["train.max_step=2"], "unknown config key 'train.max_step'")])
def test_the_default_script_reports_a_bad_config_in_one_line(args, needle):
    out = _script(*args)
    assert out.returncode == 1, out.stderr[-2000:]
    one_error_line(out.stderr, needle)


def test_bench_ttt_measures_the_precision_training_runs(monkeypatch):
    import specforge.device as dev

    sys.path.insert(0, str(REPO))
    import benchmarks.bench_ttt as bench

    for fast_bf16, want in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(dev, "cpu_fast_bf16", lambda v=fast_bf16: v)
        assert bench.pick_amp("auto") is want and dev.autocast_dtype("auto", torch.device("cpu")) is want
    assert bench.pick_amp("fp32") is None and bench.pick_amp("bf16") is torch.bfloat16


def test_a_fresh_start_that_fails_a_check_moves_nothing(assets, tmp_path):
    """checkpoint.resume=false moves old checkpoints aside only once every check of the run has
    passed: a run refused on a missing feature store leaves the folder exactly as it was."""
    root = _single(assets, tmp_path)
    before = _hashes(root)
    with pytest.raises(Exception, match=r"(?i)store|features"):
        _single(assets, tmp_path, "checkpoint.resume=false", "placement.mode=offline",
                f"store.dir={tmp_path / 'no-store'}")
    assert not list(root.glob("previous-*")) and _hashes(root) == before


@pytest.mark.parametrize("flag", [True, False])
def test_the_default_script_offers_a_background_llamacpp_build(tmp_path, flag):
    """--with-llamacpp starts the llama.cpp build in the background, at low priority, before the
    draft trains (here a fake ``nice`` records the command instead of building, and a missing data
    file ends the run at once); without the flag nothing is built."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nice").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/nice-args\n')
    (fake / "nice").chmod(0o755)
    env = dict(os.environ, SKIP_INSTALL="1", VENV=sys.prefix, PATH=f"{fake}:{os.environ['PATH']}",
               SPECFORGE_LLAMACPP_DIR=str(tmp_path / "no-llamacpp"))
    args = ["--with-llamacpp"] if flag else []
    out = subprocess.run(["bash", "scripts/train_eagle3.sh", *args, f"data.path={tmp_path / 'missing.jsonl'}",
                          f"train.output_dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0  # the missing data file
    if flag:
        assert "building llama-server in the background (nice 19)" in out.stdout, out.stdout[-2000:]
        assert (tmp_path / "nice-args").read_text().split() == ["-n", "19", "bash", "scripts/install_llamacpp.sh"]
    else:
        assert "background" not in out.stdout and not (tmp_path / "nice-args").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("entry", ["train", "eval", "capture", "regenerate"])
@pytest.mark.parametrize("override, needles", [
    ("model.device=cuda", ("'model.device'='cuda'", "sees no CUDA device", "model.device=auto")),
    ("model.num_gpus=2", ("'model.num_gpus'=2", "needs CUDA", "use 1")),
])
def test_the_gpu_path_on_a_machine_without_cuda_is_one_error_line(assets, tmp_path, capsys, entry, override, needles):
    """A GPU setting where there is no GPU: one line naming the key and the way out, exit 1, nothing trained."""
    import importlib

    main = importlib.import_module(f"specforge.{entry}").main
    args = _base(assets, tmp_path) + ["model.device=auto", override]
    if entry == "eval":
        args = ["--draft", "prompt-lookup", *args]
    assert run_cli(lambda: main(args)) == 1
    one_error_line(capsys.readouterr().err, *needles)
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))


BROKEN = {"truncated": lambda b: b[:100], "empty": lambda b: b"",
          "foreign": lambda b: b"<html>not a tensor file</html>\n"}


@pytest.mark.parametrize("how", list(BROKEN))
@pytest.mark.parametrize("entry", ["init_from", "eval", "export", "resume", "adapt", "vocab"])
def test_a_broken_weights_file_is_one_error_line_naming_it(assets, tmp_path, trained, capsys, entry, how):
    """Every weights/state file a user can name goes through ``specforge.files``: truncated, empty or
    foreign, each entry point prints one error line naming the file (not safetensors' traceback,
    "invalid header length")."""
    import specforge.eval as ev
    from specforge import export
    from specforge import train as local
    from specforge.adapt.__main__ import main as adapt_main

    ckpt, _ = trained
    draft = tmp_path / "draft"
    shutil.copytree(ckpt, draft)
    broken = draft / "model.safetensors"
    base = [a for a in _base(assets, tmp_path) if not a.startswith("train.")] + ["model.dtype=float32"]
    out = [f"train.output_dir={tmp_path / 'run'}", "train.num_workers=1", "train.max_steps=1", "train.precision=fp32"]
    if entry == "init_from":
        call = lambda: local.main([*base, *out, f"draft.init_from={draft}"])  # noqa: E731
    elif entry == "eval":
        call = lambda: ev.main(["--draft", str(draft), "--num-prompts", "1", *base])  # noqa: E731
    elif entry == "export":
        call = lambda: export.main(["--draft", str(draft), "--engine", "sglang", "--out", str(tmp_path / "x"),  # noqa: E731
                                    "--target", str(assets / "target")])
    elif entry == "resume":
        shutil.copytree(ckpt.parent, tmp_path / "run" / "checkpoints", symlinks=True)
        broken = (tmp_path / "run" / "checkpoints" / ckpt.name / "training_state.pt")
        call = lambda: local.main([*base, *out, "train.max_steps=2", "checkpoint.resume=true"])  # noqa: E731
    elif entry == "adapt":
        traffic = tmp_path / "traffic.jsonl"
        traffic.write_text("")
        call = lambda: adapt_main([*base, f"adapt.dir={tmp_path / 'a'}", f"adapt.draft={draft}", "adapt.serve=false",  # noqa: E731
                                   f"adapt.traffic={traffic}", "adapt.replay_share=0"])
    else:  # the run's cached draft-vocab file
        local.main([*base, *out])
        (broken,) = (tmp_path / "cache" / "vocab").glob("*.safetensors")
        call = lambda: local.main([*base, *out, f"train.output_dir={tmp_path / 'run2'}"])  # noqa: E731
    broken.write_bytes(BROKEN[how](broken.read_bytes()))
    capsys.readouterr()
    assert run_cli(call) == 1
    err = capsys.readouterr().err
    one_error_line(err, f"'{broken}'", "cannot be read", "a truncated, empty or foreign file")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without GPUs")
def test_a_gpu_config_without_gpus_names_the_gpus_before_ray_or_the_hub(tmp_path):
    """The GPUs needed and found, in one line before anything else (the hub, the config copy, the
    CPUs): not the hub client's connection error, which names neither the model nor the GPUs."""
    env = {"HF_HUB_OFFLINE": "1", "RAY_ADDRESS": ""}
    out = _cli(["specforge.ray_train", "--config", "configs/llama3.1-8b-instruct.yaml",
                f"train.output_dir={tmp_path / 'run'}"], env=env)
    assert out.returncode == 1, out.stderr[-2000:]
    one_error_line(out.stderr, "'model.device'='cuda'", "GPU(s)", "has 0", "torch sees no CUDA device")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_hub_target_config_is_read_from_its_shipped_copy_when_the_hub_is_off(monkeypatch):
    import huggingface_hub.constants

    from specforge.config import ModelConfig
    from specforge.models.target import load_target_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, when first imported (earlier in a suite): without this the
    # control below went to the network and waited out its retries (~23 s) instead of failing offline
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    config = load_target_config(ModelConfig(target_path="meta-llama/Llama-3.1-8B-Instruct"))
    assert config.hidden_size == 4096 and config.num_hidden_layers == 32
    with pytest.raises(ValueError, match="model.target_path 'someone/not-shipped'"):  # negative control: no copy
        load_target_config(ModelConfig(target_path="someone/not-shipped"))
