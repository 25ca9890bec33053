"""Backend choice at the level of configuration (TE cannot be installed on CPU machines).

Which spec and which TransformerConfig fields each recipe setting produces; the real TE/FP8 runs
are in tests/gpu/.
"""

import sys

import pytest
import torch

from megatron_ext.attention import TorchSDPAttention
from megatron_ext.model import BuildOptions, layer_spec, transformer_config
from megatron_ext.presets import TINY
from megatron_ext.recipe import RecipeError
from megatron_ext.runtime import te_available
from tests.conftest import ROOT


def test_cpu_uses_local_spec_with_sdpa(cpu_parallel_state):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    opts = BuildOptions(device="cpu")
    assert not opts.use_te() and opts.attention_backend() == "sdpa"
    cfg = transformer_config(TINY, opts)
    assert cfg.transformer_impl == "local" and not cfg.bias_activation_fusion and not cfg.apply_rope_fusion
    block = layer_spec(cfg, opts)
    assert len(block.layer_specs) == TINY["num_hidden_layers"] and block.layer_norm is WrappedTorchNorm
    assert block.layer_specs[0].submodules.self_attention.submodules.core_attention.module is TorchSDPAttention


def test_sdpa_model_final_norm_is_torch_rmsnorm_where_apex_or_te_imports(cpu_parallel_state, monkeypatch):
    """Megatron picks a layer spec's final norm at import time: TE's where TE imports, Apex's FusedLayerNorm where
    only Apex does. The sdpa model names torch's, so it builds and runs on the CPU of a node with TE or Apex. The
    Apex case is Megatron's own state when Apex imports (its FusedLayerNorm refuses RMSNorm: the build failed)."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer import transformer_block

    from megatron_ext.model import build_model

    monkeypatch.setattr(transformer_block, "LayerNormImpl", FusedLayerNorm)
    model = build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    assert type(model.decoder.final_layernorm) is torch.nn.RMSNorm
    assert [k for k in model.state_dict() if "final_layernorm" in k] == ["decoder.final_layernorm.weight"]


@pytest.mark.skipif(te_available(), reason="checks the error when Transformer Engine is missing")
@pytest.mark.parametrize("opts, field", [
    (BuildOptions(device="cpu", attention="te"), "runtime.attention = 'te'"),
    (BuildOptions(device="cuda", fp8="hybrid"), "runtime.fp8 = 'hybrid'"),
])
def test_te_demands_fail_clearly_without_te(opts, field):
    with pytest.raises(RecipeError, match=f"{field}.*transformer_engine does not import"):
        opts.use_te()


@pytest.fixture
def pretend_te(monkeypatch):
    """Make the choice logic see TE and an sm90 GPU, to check the config it builds."""
    monkeypatch.setattr("megatron_ext.runtime.te_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))


def test_te_attention_needs_a_backend_for_fp32(pretend_te, monkeypatch):
    """TE attends fp32 only in its unfused backend, which takes no CP (nor packed sequences before TE 2.11): auto
    picks the torch SDPA backend there, an explicit te is one error; bf16 and fp32 without CP keep TE."""
    import types

    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.10.0+abc"))
    assert BuildOptions(device="cuda", precision="fp32").use_te()
    assert BuildOptions(device="cuda", precision="bf16", context=2).use_te()
    assert BuildOptions(device="cuda", precision="bf16", packed_sequences=True).use_te()
    assert not BuildOptions(device="cuda", precision="fp32", context=2).use_te()
    assert BuildOptions(device="cuda", precision="fp32", context=2).attention_backend() == "sdpa"
    assert not BuildOptions(device="cuda", precision="fp32", packed_sequences=True).use_te()
    with pytest.raises(RecipeError, match=r"runtime.attention = 'te' with train.precision = 'fp32' and "
                                          r"parallel.context = 2: .* use train.precision=bf16"):
        BuildOptions(device="cuda", precision="fp32", context=2, attention="te").use_te()
    with pytest.raises(RecipeError, match=r"SFT's packed sequences under transformer_engine 2.10.0\+abc \(< 2.11\)"):
        BuildOptions(device="cuda", precision="fp32", packed_sequences=True, attention="te").use_te()
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.11.0"))
    assert BuildOptions(device="cuda", precision="fp32", packed_sequences=True).use_te()


def test_te_fp32_under_cp_is_refused_at_load():
    from megatron_ext.recipe import load_recipe

    with pytest.raises(RecipeError, match=r"runtime.attention = 'te' with train.precision = 'fp32' and "
                                          r"parallel.context = 2"):
        load_recipe(ROOT / "recipes/tiny/cpt.yaml", ["runtime.device=cuda", "runtime.attention=te",
                                                     "train.precision=fp32", "parallel.context=2"], world_size=2)
    assert load_recipe(ROOT / "recipes/tiny/cpt.yaml", ["runtime.device=cuda", "runtime.attention=auto",
                                                        "train.precision=fp32", "parallel.context=2"], world_size=2)
    from megatron_ext.model import BuildOptions as B

    sft = load_recipe(ROOT / "recipes/tiny/sft.yaml", [], world_size=1)
    assert B.from_recipe(sft).packed_sequences and not B.from_recipe(
        load_recipe(ROOT / "recipes/tiny/cpt.yaml", [], world_size=2)).packed_sequences


@pytest.mark.parametrize("recipe_fp8, fp8_recipe", [("hybrid", "delayed"), ("e4m3", "tensorwise")])
def test_te_fp8_config_fields(pretend_te, monkeypatch, recipe_fp8, fp8_recipe):
    from megatron.core.transformer.enums import AttnBackend

    if fp8_recipe == "tensorwise":  # TE runs FP8 attention with current scaling on sm100 only
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    opts = BuildOptions(device="cuda", fp8=recipe_fp8, fp8_attention=True, fp8_recipe=fp8_recipe,
                        context=4, cp_comm_type="p2p", precision="bf16")
    assert opts.use_te() and opts.attention_backend() == "te"
    cfg = transformer_config(TINY, opts)
    assert cfg.transformer_impl == "transformer_engine"
    assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_dot_product_attention) == (recipe_fp8, fp8_recipe, True)
    assert cfg.attention_backend == AttnBackend.fused  # FP8 attention only exists in cuDNN fused attention
    assert cfg.context_parallel_size == 4 and cfg.cp_comm_type == "p2p"
    assert cfg.bias_activation_fusion
    assert not cfg.apply_rope_fusion  # fused RoPE would drop YaRN's attention factor
    assert cfg.params_dtype == torch.bfloat16 and cfg.bf16


@pytest.mark.parametrize("arch, fp8_recipe, message", [
    ((9, 0), "tensorwise", r"fp8_recipe = 'tensorwise': TE runs it only on sm100\+, this GPU is sm90; use "
                           r"runtime\.fp8_recipe=delayed"),
    ((8, 9), "delayed", r"runtime\.fp8_attention = true: FP8 attention needs an sm90\+ GPU, this one is sm89"),
])
def test_fp8_attention_that_te_cannot_run_here_is_refused(pretend_te, monkeypatch, arch, fp8_recipe, message):
    """TE turns its flash and unfused backends off for FP8 attention, and cuDNN's FP8 attention needs sm90 (current
    scaling: sm100): the first forward found no backend (a ValueError from TE)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: arch)
    opts = BuildOptions(device="cuda", fp8="hybrid", fp8_attention=True, fp8_recipe=fp8_recipe, precision="bf16")
    with pytest.raises(RecipeError, match=message):
        opts.use_te()
    assert BuildOptions(device="cuda", fp8="hybrid", fp8_recipe=fp8_recipe, precision="bf16").use_te()  # FP8 linears


@pytest.mark.parametrize("apex", [True, False])
def test_gradient_accumulation_fusion_only_with_apex_kernel(pretend_te, monkeypatch, apex):
    from megatron.core.tensor_parallel import layers

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", apex)
    cfg = transformer_config(TINY, BuildOptions(device="cuda", precision="bf16"))
    assert cfg.transformer_impl == "transformer_engine" and cfg.gradient_accumulation_fusion is apex
    # the local spec never: on the CPU of a node where Apex imports its fused kernel is CUDA's, and auto is the torch
    # SDPA backend on a CPU even where TE imports (pins mutants: the fusion without TE; auto = TE off cuda)
    for opts in (BuildOptions(device="cpu"), BuildOptions(device="cuda", precision="bf16", attention="sdpa")):
        assert opts.attention_backend() == "sdpa"
        local = transformer_config(TINY, opts)
        assert local.transformer_impl == "local" and not local.gradient_accumulation_fusion


def test_te_config_builds_the_output_layer_without_apex(pretend_te, cpu_parallel_state):
    """GPTModel's output layer is Megatron's ColumnParallelLinear whatever the spec; without Apex (as here and on a
    pip-installed TE stack) it refuses gradient_accumulation_fusion at build. Control: the flag forced on."""
    import dataclasses

    from megatron.core.tensor_parallel import ColumnParallelLinear, layers

    assert not layers._grad_accum_fusion_available  # no Apex on this machine
    cfg = dataclasses.replace(transformer_config(TINY, BuildOptions(device="cuda", precision="bf16")),
                              use_cpu_initialization=True)

    def output_layer(config):
        return ColumnParallelLinear(TINY["hidden_size"], TINY["vocab_size"], config=config,
                                    init_method=torch.nn.init.zeros_, bias=False, gather_output=False)

    output_layer(cfg)
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        output_layer(dataclasses.replace(cfg, gradient_accumulation_fusion=True))


def test_te_bf16_without_fp8_keeps_auto_backend(pretend_te):
    from megatron.core.transformer.enums import AttnBackend

    cfg = transformer_config(TINY, BuildOptions(device="cuda", precision="bf16", cp_comm_type="a2a+p2p",
                                                 context=4, hierarchical_context_sizes=(2, 2)))
    assert cfg.fp8 is None and cfg.attention_backend == AttnBackend.auto
    assert cfg.hierarchical_context_parallel_sizes == [2, 2]


@pytest.mark.skipif(te_available(), reason="checks the error when Transformer Engine is missing")
def test_sequence_parallel_without_te_is_a_recipe_error():
    """runtime.attention auto on a GPU whose TE does not import: the local spec, whose torch norms assert
    sequence_parallel away; one line instead."""
    with pytest.raises(RecipeError, match="parallel.sequence_parallel = true but Transformer Engine is not used"):
        transformer_config(TINY, BuildOptions(device="cuda", tensor=2, sequence_parallel=True))


def test_recompute_settings():
    full = transformer_config(TINY, BuildOptions(recompute="full"))
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    assert transformer_config(TINY, BuildOptions(recompute="selective")).recompute_granularity == "selective"
    block = transformer_config(TINY, BuildOptions(recompute="full", recompute_layers=1))
    assert (block.recompute_granularity, block.recompute_method, block.recompute_num_layers) == ("full", "block", 1)
    assert transformer_config(TINY, BuildOptions()).recompute_granularity is None


def test_fp8_sm80_rejected(monkeypatch):
    monkeypatch.setattr("megatron_ext.runtime.te_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(RecipeError, match="FP8 needs an sm89/sm90\\+ GPU, this one is sm80"):
        BuildOptions(device="cuda", fp8="hybrid").use_te()




def test_models_of_both_attention_backends_build_in_one_process(monkeypatch, cpu_parallel_state):
    """Megatron-Core sets NVTE_{FLASH,FUSED,UNFUSED}_ATTN at each build and asserted on the values an earlier build
    left: a model with FP8 attention (the fused backend) after one without failed, e.g. tests/gpu/test_te_backends
    on a TE machine. The variables of a build are forgotten at the next."""
    import os

    from megatron_ext.model import build_model
    from megatron_ext.train_setup import TE_BACKEND_VARIABLES

    for key in TE_BACKEND_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    for fp8_attention, values in ((False, ["1", "1", "1"]), (True, ["0", "1", "0"]), (False, ["1", "1", "1"])):
        build_model(TINY, BuildOptions(device="cpu", seq_length=32, fp8_attention=fp8_attention))
        assert [os.environ.get(k) for k in TE_BACKEND_VARIABLES] == values


def test_a_backend_variable_changed_since_the_build_is_not_forgotten(monkeypatch, cpu_parallel_state):
    """Only the values a build set are forgotten at the next build: one changed since (not the build's) stays, and
    Megatron refuses it by name. Pins mutant: every variable deleted whatever its value."""
    import os

    from megatron_ext.model import build_model
    from megatron_ext.train_setup import TE_BACKEND_VARIABLES

    for key in TE_BACKEND_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    with pytest.raises(AssertionError, match="NVTE_FLASH_ATTN set to 0, but expected 1"):
        build_model(TINY, BuildOptions(device="cpu", seq_length=32))
    assert os.environ["NVTE_FLASH_ATTN"] == "0"


def _attention_ops(model, tokens) -> set[str]:
    """The aten SDPA kernels a forward and backward of `model` ran (profiler op names)."""
    with torch.profiler.profile() as prof:
        model(tokens, torch.arange(tokens.shape[1])[None], None, labels=tokens).sum().backward()
    return {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}


def test_sdpa_kernel_is_forced_and_computes_the_same(cpu_parallel_state):
    """runtime.sdpa_kernel reaches every layer's SDPA call: with math forced the profiler sees torch's math kernel
    where SDPA's own choice on the CPU is its flash kernel (the control), and the losses agree."""
    from megatron_ext.model import build_model

    tokens = torch.randint(3, 512, (1, 64))
    losses, ops = {}, {}
    for kernel in ("auto", "math", "flash"):
        opts = BuildOptions(device="cpu", seq_length=64, sdpa_kernel=kernel)
        block = layer_spec(transformer_config(TINY, opts), opts)
        spec = block.layer_specs[0].submodules.self_attention.submodules.core_attention
        assert spec.module is TorchSDPAttention and spec.params == {"sdpa_kernel": kernel}
        torch.manual_seed(0)
        model = build_model(TINY, opts)
        ops[kernel] = _attention_ops(model, tokens)
        with torch.no_grad():
            losses[kernel] = model(tokens, torch.arange(64)[None], None, labels=tokens)
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert ops["auto"] == ops["flash"] == {flash, flash + "_backward"}
    assert "aten::_scaled_dot_product_attention_math" in ops["math"] and ops["math"].isdisjoint(ops["auto"])
    torch.testing.assert_close(losses["math"], losses["auto"], atol=1e-5, rtol=0)
    torch.testing.assert_close(losses["flash"], losses["auto"], atol=0, rtol=0)


def test_sdpa_kernel_that_cannot_run_says_so(cpu_parallel_state):
    """A kernel torch lacks for the inputs (the memory-efficient one on the CPU): after the retry with K/V repeated
    to every query head (for kernels that refuse grouped K/V), one error naming the setting."""
    from megatron.core.transformer.enums import AttnMaskType

    opts = BuildOptions(device="cpu", seq_length=64, sdpa_kernel="efficient")
    attention = TorchSDPAttention(transformer_config(TINY, opts), 1, AttnMaskType.causal, "self",
                                  sdpa_kernel="efficient")
    q, kv = torch.randn(16, 1, 4, 16), torch.randn(16, 1, 2, 16)
    with pytest.raises(RuntimeError, match=r"runtime.sdpa_kernel = 'efficient': torch has no such kernel .* use "
                                           r"runtime.sdpa_kernel=auto"):
        attention(q, kv, kv)
    assert attention._expand_kv  # the grouped call was refused first, then the repeated one


def test_sdpa_kernel_is_refused_where_it_cannot_apply(pretend_te):
    from megatron_ext.recipe import load_recipe

    base = {"model": {"preset": "tiny"}, "train": {"seq_length": 64, "steps": 1, "lr": 1e-3},
            "cluster": {"gpus_per_node": 1}}
    with pytest.raises(RecipeError, match="runtime.sdpa_kernel = 'cudnn': torch has no such kernel on the CPU"):
        load_recipe(raw={**base, "runtime": {"device": "cpu", "sdpa_kernel": "cudnn"}})
    with pytest.raises(RecipeError, match="runtime.sdpa_kernel = 'flash' chooses the kernel of the torch SDPA"):
        load_recipe(raw={**base, "runtime": {"device": "cuda", "attention": "te", "sdpa_kernel": "flash"}})
    # attention auto is TE where it imports: refused in the recipe (before a job starts) and again at the build
    with pytest.raises(RecipeError, match="runtime.sdpa_kernel = 'cudnn' chooses .* runtime.attention = 'auto'"):
        load_recipe(raw={**base, "runtime": {"device": "cuda", "sdpa_kernel": "cudnn"}})
    with pytest.raises(RecipeError, match="runtime.sdpa_kernel = 'cudnn' chooses .* Transformer Engine's attention"):
        transformer_config(TINY, BuildOptions(device="cuda", sdpa_kernel="cudnn"))
    # under CP the chunks' lower-right causal bias runs mask-free in flash alone (a dense chunk x keys mask otherwise)
    cp = {**base, "parallel": {"context": 2}, "cluster": {"gpus_per_node": 2}}
    for kernel in ("cudnn", "efficient", "math"):
        with pytest.raises(RecipeError, match=f"runtime.sdpa_kernel = '{kernel}' with parallel.context = 2"):
            load_recipe(raw={**cp, "runtime": {"device": "cuda", "attention": "sdpa", "sdpa_kernel": kernel}})
    load_recipe(raw={**cp, "runtime": {"device": "cuda", "attention": "sdpa", "sdpa_kernel": "flash"}})  # controls
    load_recipe(raw={**base, "runtime": {"device": "cuda", "attention": "sdpa", "sdpa_kernel": "cudnn"}})


def _core_attention(**kwargs) -> TorchSDPAttention:
    """The sdpa backend's core attention of the tiny model (4 query heads, 2 KV heads, head dim 16), causal."""
    from megatron.core.transformer.enums import AttnMaskType

    return TorchSDPAttention(transformer_config(TINY, BuildOptions(device="cpu")), 1, AttnMaskType.causal, "self",
                             **kwargs)


def _sdpa_reference(q, kv, **kwargs):
    """Oracle: torch SDPA over `[s, b, heads, d]` tensors (torch's own GQA grouping), back to `[s, b, nh * d]`."""
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), *(kv.permute(1, 2, 0, 3),) * 2, is_causal=True,
                                         enable_gqa=True, **kwargs)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def test_core_attention_takes_megatrons_softmax_scale_and_no_dropout_in_eval():
    """Megatron's SelfAttention passes softmax_scale (config.softmax_scale) and may pass attention_dropout: the scale
    given is the one used (default 1/sqrt(head dim)), and an eval-mode forward drops nothing. An unknown sdpa_kernel
    is refused at build, not at the first forward. Pins mutants: the scale argument ignored, dropout in eval."""
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(16, 1, 4, 16, generator=gen), torch.randn(16, 1, 2, 16, generator=gen)
    torch.testing.assert_close(_core_attention()(q, kv, kv), _sdpa_reference(q, kv, scale=0.25))
    scaled = _core_attention(softmax_scale=0.7)(q, kv, kv)
    torch.testing.assert_close(scaled, _sdpa_reference(q, kv, scale=0.7))
    assert (scaled - _sdpa_reference(q, kv, scale=0.25)).abs().max() > 1e-3  # control: the scale shows
    dropping = _core_attention(attention_dropout=0.5).eval()
    torch.testing.assert_close(dropping(q, kv, kv), _sdpa_reference(q, kv, scale=0.25))
    with pytest.raises(ValueError, match="sdpa_kernel 'fast': expected one of"):
        _core_attention(sdpa_kernel="fast")


def test_forced_kernel_with_kv_repeated_keeps_each_query_heads_kv_head():
    """Where a forced kernel refuses grouped K/V (enable_gqa), K/V are repeated to every query head: query heads 0
    and 1 keep KV head 0, heads 2 and 3 KV head 1 (torch's and HF's grouping), not 0, 1, 0, 1. `_expand_kv` is the
    state the backend sets after such a refusal (no CPU kernel refuses enable_gqa). Pins mutant: repeat for
    repeat_interleave."""
    gen = torch.Generator().manual_seed(1)
    q, kv = torch.randn(16, 1, 4, 16, generator=gen), torch.randn(16, 1, 2, 16, generator=gen)
    attention = _core_attention(sdpa_kernel="math")
    attention._expand_kv = True
    torch.testing.assert_close(attention(q, kv, kv), _sdpa_reference(q, kv))


def test_forced_kernel_passes_on_an_error_that_is_not_a_missing_kernel():
    """Only torch's 'no kernel' refusal becomes the runtime.sdpa_kernel error; another failure (here K/V of another
    dtype than Q) is torch's own, not blamed on the setting. Pins mutant: every RuntimeError reworded."""
    q, kv = torch.randn(16, 1, 4, 16), torch.randn(16, 1, 4, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="same dtype") as e:
        _core_attention(sdpa_kernel="math")(q, kv, kv)
    assert "runtime.sdpa_kernel" not in str(e.value)
