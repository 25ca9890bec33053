"""megatron_ext.resume pinned where the mutation audit (round 6) found it untested: what counts as a blend for the
epoch count, a train split with no documents, the CPT-only data request, and the folder a stage refusal names."""

from __future__ import annotations

from megatron_ext.recipe import load_recipe
from megatron_ext.resume import plan_resume, stage_refusal, train_split_epochs, train_split_tokens
from tests.conftest import ROOT
from tests.unit.test_data_order import _recipe


def test_one_prefix_with_weights_is_a_blend(token_data):
    """data.weights with one prefix builds Megatron-Core's BlendedDataset (megatron_ext.training_data passes the
    prefixes as a blend whenever weights are set), whose per-dataset request is not the plain one: no epoch count.
    Control: the same prefix unweighted has one."""
    assert train_split_epochs(_recipe(token_data), 120) == 2
    blend = _recipe(token_data, f"data.prefix=[{token_data}]", "data.weights=[1.0]")
    assert train_split_tokens(blend) is None and train_split_epochs(blend, 120) is None


def test_a_train_split_with_no_documents_has_no_epoch_count(token_data):
    """data.split 0.1,99.9,0 gives the train split round(0.001 x 120) = 0 of the 120 documents: no tokens per epoch
    to count with (not a division by zero in the resume decision)."""
    recipe = _recipe(token_data, "data.split=0.1,99.9,0", "train.steps=60")
    assert train_split_tokens(recipe) is None and train_split_epochs(recipe, 120) is None
    saved = {"consumed_samples": 6, "tokens": 3072, "recipe": recipe.to_dict(), "data_samples": 6}
    assert "this run reads 120 samples" in plan_resume(saved, 3, recipe, 1).order_warning


def test_an_sft_resume_has_no_cpt_data_request(token_data, sft_data):
    """`data_samples` is the CPT GPTDataset request; an SFT resume reports none even when the metadata has one.
    Control: the CPT recipe reports it."""
    cpt = _recipe(token_data, "train.steps=3")
    saved = {"consumed_samples": 6, "tokens": 3072, "recipe": cpt.to_dict(), "data_samples": 6}
    assert plan_resume(saved, 3, cpt, 1).data_samples == 6
    sft = load_recipe(ROOT / "recipes/tiny/sft.yaml", [f"data.prefix={sft_data}", "checkpoint.dir=/tmp/unused",
                                                       "parallel.context=1", "train.steps=3"], world_size=1)
    sft_saved = {**saved, "recipe": sft.to_dict()}
    assert plan_resume(sft_saved, 3, sft, 1).data_samples is None


def test_a_stage_refusal_names_the_folder_it_was_given(token_data):
    """`tools/checkpoint.py info DIR --recipe R` passes DIR: the refusal names it, not R's checkpoint.dir."""
    cpt = _recipe(token_data)
    saved = {"recipe": {**cpt.to_dict(), "train": {**cpt.to_dict()["train"], "stage": "sft"}}}
    said = stage_refusal(saved, 2, cpt, root="/data/other_run")
    assert said.startswith("checkpoint.dir = '/data/other_run' holds a sft run") and "init_from=/data/other_run" \
        in said, said
    assert stage_refusal(saved, 2, cpt).startswith("checkpoint.dir = '/tmp/unused' holds")  # the default


def test_default_gradient_buckets_are_the_resuming_runs_dp(token_data):
    """With train.overlap_grad_reduce and no train.ddp_bucket_size, Megatron-Core's DDP makes buckets of
    max(40M, 1M x DP) parameters: a dp_reshardable state saved at DP 64 resumes whole at DP 64 (both 64M), and at
    DP 80 its buckets differ (64M -> 80M): a fresh optimizer state, said in those numbers."""
    recipe = _recipe(token_data, "train.overlap_grad_reduce=true", "train.distributed_optimizer=true")
    assert recipe.train.ddp_bucket_size is None
    saved = {"recipe": recipe.to_dict(), "parallel": {"tensor": 1, "pipeline": 1, "context": 1, "data": 64},
             "consumed_samples": 8, "tokens": 4096}
    assert plan_resume(saved, 2, recipe, 64).full_state
    moved = plan_resume(saved, 2, recipe, 80)
    assert not moved.full_state and ("buckets of 64,000,000 parameters when saved, buckets of 80,000,000 "
                                     "parameters now") in moved.why_not_full, moved.why_not_full


def test_every_model_size_of_the_checkpoint_is_compared(token_data):
    """Each of these sizes sets a weight's shape (head_dim: the QKV and projection rows; tie_word_embeddings: whether
    an output layer is stored): a checkpoint that differs in any one of them does not load into the recipe's model,
    and the resume names that one. Oracle: the recipe's own HF config with that one field changed."""
    from megatron_ext.hf_config import hf_config_from_recipe
    from megatron_ext.resume import architecture_changes

    recipe = _recipe(token_data)
    now = hf_config_from_recipe(recipe)
    assert architecture_changes(now, recipe) == []  # control
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):
        other = not now[key] if isinstance(now[key], bool) else now[key] * 2
        assert architecture_changes({**now, key: other}, recipe) == [f"{key}: {other} -> {now[key]}"], key


def test_the_samples_a_run_reads_count_from_the_saved_position(token_data):
    """After a change of train.global_batch_size the samples read so far are the checkpoint's consumed_samples, not
    step x the new batch: resumed at step 3 with 100 samples read, 7 more steps of 2 read 114 in all, more than the
    order was built for (100); steps x batch (20) would have seen no need."""
    recipe = _recipe(token_data, "train.steps=10", "train.global_batch_size=2")
    saved = {"consumed_samples": 100, "tokens": 51200, "recipe": recipe.to_dict(), "data_samples": 100}
    warning = plan_resume(saved, 3, recipe, 1).order_warning
    assert warning is not None and "this run reads 114 samples, its checkpoint's data order was built for 100" \
        in warning, warning
