"""Recipe or HF Llama config -> Megatron-Core `TransformerConfig`, layer spec and `GPTModel`.

The model is built from the HF `config.json` dict that every part shares (`megatron_ext.hf_config`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatron_ext.hf_config import hf_config_from_recipe, normalize_hf_config
from megatron_ext.recipe import Recipe, RecipeError
from megatron_ext.train_setup import TE_BACKEND_VARIABLES


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Rows of the embedding table (`megatron_ext.cost_model.padded_vocab`: a multiple of divisible_by and TP)."""
    from megatron_ext.cost_model import padded_vocab

    return padded_vocab(vocab_size, divisible_by, tensor_parallel)


@dataclass(frozen=True)
class BuildOptions:
    """Everything besides the architecture that decides how the Megatron model is built."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    cp_comm_type: str = "p2p"
    hierarchical_context_sizes: tuple[int, ...] | None = None
    sequence_parallel: bool = False
    device: str = "cpu"
    attention: str = "auto"  # auto | te | sdpa
    sdpa_kernel: str = "auto"  # the torch SDPA kernel of the sdpa backend (attention.SDPA_KERNELS)
    precision: str = "fp32"  # fp32 | bf16
    recompute: str = "none"  # none | selective | full
    recompute_layers: int | None = None  # full only: the first N layers of each stage (block); None: all
    fp8: str | None = None
    fp8_attention: bool = False
    fp8_recipe: str = "delayed"
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 4096
    loss_head: str = "chunked"  # chunked | full (see megatron_ext/loss_head.py)
    loss_chunk_tokens: int = 2048
    packed_sequences: bool = False  # SFT: conversations packed into one sequence (THD attention under TE)

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> "BuildOptions":
        p, rt = recipe.parallel, recipe.runtime
        return cls(
            tensor=p.tensor, pipeline=p.pipeline, context=p.context, cp_comm_type=p.cp_comm_type,
            hierarchical_context_sizes=p.hierarchical_context_sizes, sequence_parallel=p.sequence_parallel,
            device=rt.device, attention=rt.attention, sdpa_kernel=rt.sdpa_kernel, precision=recipe.train.precision,
            recompute=recipe.train.recompute, recompute_layers=recipe.train.recompute_layers, fp8=rt.fp8, fp8_attention=rt.fp8_attention, fp8_recipe=rt.fp8_recipe,
            make_vocab_size_divisible_by=recipe.model.make_vocab_size_divisible_by, seq_length=recipe.train.seq_length,
            loss_head=recipe.train.loss_head, loss_chunk_tokens=recipe.train.loss_chunk_tokens,
            packed_sequences=recipe.train.stage == "sft",
        )

    def _te_attention_refuses_fp32(self) -> str | None:
        """Why TE has no attention backend for this fp32 run, or None. Flash and cuDNN attention take bf16/fp16
        only; TE's unfused backend, the one left in fp32, takes no context parallelism, nor packed (THD) sequences
        before TE 2.11: the first forward raised 'No dot product attention backend is available'."""
        if self.precision != "fp32":
            return None
        if self.context > 1:
            return f"parallel.context = {self.context}"
        if self.packed_sequences:
            import transformer_engine

            version = tuple(int(x) for x in transformer_engine.__version__.split(".")[:2] if x.isdigit())
            if version < (2, 11):
                return f"SFT's packed sequences under transformer_engine {transformer_engine.__version__} (< 2.11)"
        return None

    def use_te(self) -> bool:
        """Transformer Engine spec: asked for, or `auto` on cuda when TE imports and has an attention backend for
        the run's precision and layout. FP8 demands it."""
        from megatron_ext.runtime import te_available

        if self.attention == "te" or self.fp8 is not None:
            field = "runtime.attention = 'te'" if self.attention == "te" else f"runtime.fp8 = {self.fp8!r}"
            if self.device != "cuda" or not te_available():
                raise RecipeError(f"{field} but transformer_engine does not import here (or the device is not "
                                  "cuda); install the [gpu] extra on a GPU machine, or use runtime.attention=sdpa "
                                  "and runtime.fp8=null")
            arch = torch.cuda.get_device_capability()
            here = f"sm{''.join(map(str, arch))}"
            if self.fp8 is not None and arch < (8, 9):
                raise RecipeError(f"{field}: FP8 needs an sm89/sm90+ GPU, this one is {here}; set runtime.fp8=null")
            if self.fp8_attention and arch < (9, 0):  # cuDNN's FP8 attention
                raise RecipeError(f"runtime.fp8_attention = true: FP8 attention needs an sm90+ GPU, this one is {here}; "
                                  "set runtime.fp8_attention=false")
            if self.fp8_attention and self.fp8_recipe == "tensorwise" and arch < (10, 0):
                raise RecipeError(f"runtime.fp8_attention = true with runtime.fp8_recipe = 'tensorwise': TE runs it "
                                  f"only on sm100+, this GPU is {here}; use runtime.fp8_recipe=delayed")
            why = self._te_attention_refuses_fp32()
            if why is not None:
                raise RecipeError(f"{field} with train.precision = 'fp32' and {why}: Transformer Engine attends fp32 "
                                  "only in its unfused backend, which does not take that; use train.precision=bf16, "
                                  "or runtime.attention=sdpa (auto chooses it here)")
            return True
        # auto: TE where it imports, unless it has no fp32 backend for the run (the torch SDPA backend has one)
        return (self.attention == "auto" and self.device == "cuda" and te_available()
                and self._te_attention_refuses_fp32() is None)

    def attention_backend(self) -> str:
        """`te` or `sdpa` (the torch backend; under CP it all-gathers K/V whatever cp_comm_type says)."""
        te = self.use_te()
        if te and self.sdpa_kernel != "auto":
            raise RecipeError(f"runtime.sdpa_kernel = {self.sdpa_kernel!r} chooses the kernel of the torch SDPA backend, "
                              "but this run uses Transformer Engine's attention (runtime.attention = "
                              f"{self.attention!r}); set runtime.attention=sdpa, or runtime.sdpa_kernel=auto")
        return "te" if te else "sdpa"


def transformer_config(hf_cfg: dict, opts: BuildOptions):
    """Megatron `TransformerConfig` for a Llama-3.1-family HF config."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = normalize_hf_config(hf_cfg)
    use_te = opts.attention_backend() == "te"  # also refuses runtime.sdpa_kernel on the TE path
    if opts.sequence_parallel and not use_te:  # the local spec's torch norms assert it away
        raise RecipeError("parallel.sequence_parallel = true but Transformer Engine is not used (it does not import "
                          "here, or runtime.attention = 'sdpa'); install the [gpu] extra, or set "
                          "parallel.sequence_parallel=false")
    dtype = torch.bfloat16 if opts.precision == "bf16" else torch.float32
    recompute = {}
    if opts.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if opts.recompute_layers is not None:  # the first N layers of each stage; the rest keep activations
            recompute.update(recompute_method="block", recompute_num_layers=opts.recompute_layers)
    elif opts.recompute == "selective":
        recompute = dict(recompute_granularity="selective")
    fused = use_te  # fusions need TE/Apex kernels
    # With the flag TE's linears add their weight gradients straight into DDP's fp32 main_grad; but the output layer
    # is always Megatron's ColumnParallelLinear, which refuses it at build without Apex's fused_weight_gradient_mlp_cuda
    # (NGC images have it, a pip-installed TE stack does not). Without it each linear returns a bf16 weight gradient
    # that DDP adds into main_grad: one more temporary and a bf16 rounding per microbatch.
    from megatron.core.tensor_parallel import layers as tp_layers

    fuse_grad_accumulation = fused and tp_layers._grad_accum_fusion_available
    return TransformerConfig(
        cuda_graph_scope=[],  # = the default "full", which 0.16 warns is deprecated on every rank
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg["head_dim"],
        normalization="RMSNorm",
        layernorm_epsilon=cfg["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.get("initializer_range", 0.02),
        bf16=opts.precision == "bf16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=opts.tensor,
        pipeline_model_parallel_size=opts.pipeline,
        context_parallel_size=opts.context,
        cp_comm_type=opts.cp_comm_type,
        hierarchical_context_parallel_sizes=list(opts.hierarchical_context_sizes)
        if opts.hierarchical_context_sizes else None,
        sequence_parallel=opts.sequence_parallel,
        transformer_impl="transformer_engine" if use_te else "local",
        use_cpu_initialization=opts.device == "cpu",
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=fused,
        persist_layer_norm=fused,
        gradient_accumulation_fusion=fuse_grad_accumulation,
        apply_rope_fusion=False,  # our RoPE tables carry YaRN's attention factor; see rope.py
        calculate_per_token_loss=True,
        fp8=opts.fp8,
        fp8_recipe=opts.fp8_recipe,
        fp8_dot_product_attention=opts.fp8_attention,
        # FP8 attention runs only in cuDNN's FusedAttention (flash-attn is disabled for FP8).
        attention_backend=AttnBackend.fused if opts.fp8_attention else AttnBackend.auto,
        **recompute,
    )


def layer_spec(config, opts: BuildOptions):
    """TE spec when TE is used, else the block of Megatron's local layers with torch SDPA core attention and torch's
    RMSNorm after the last layer."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if config.transformer_impl == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec()
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megatron_ext.attention import TorchSDPAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=TorchSDPAttention, params={"sdpa_kernel": opts.sdpa_kernel})
    # Given a layer spec alone, Megatron picks the final norm when it is imported: TE's where TE imports (a CUDA
    # kernel, which fails on CPU tensors, and an _extra_state key checkpoints written without TE lack), Apex's
    # LayerNorm where only Apex does (it refuses RMSNorm: the build failed). Torch's, as in the layers, everywhere.
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=WrappedTorchNorm)


# Megatron-Core sets TE's NVTE_*_ATTN variables from the attention backend at every model build, and stops at other
# values already there: those of an earlier build in this process (the tests, the evaluation engine) are forgotten.
# A user's own are refused before the run starts (train_setup.check_setup).
_BACKEND_SET_BY_A_BUILD: dict[str, str] = {}


def _forget_attention_backend_variables() -> None:
    for key, value in _BACKEND_SET_BY_A_BUILD.items():
        if os.environ.get(key) == value:
            del os.environ[key]
    _BACKEND_SET_BY_A_BUILD.clear()


def build_model(hf_cfg: dict, opts: BuildOptions, *, pre_process: bool | None = None,
                post_process: bool | None = None):
    """A Megatron `GPTModel` for this rank (TP/PP shard) of the HF Llama architecture `hf_cfg`.

    Parallel state must be initialised. RoPE comes from `megatron_ext.rope` and follows `hf_cfg`. With
    `opts.loss_head == 'chunked'` the training loss never materialises all logits (`megatron_ext.loss_head`).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.loss_head import chunked_loss_gpt_model_class
    from megatron_ext.rope import attach_rotary_embedding

    if opts.loss_head not in ("chunked", "full"):
        raise RecipeError(f"train.loss_head = {opts.loss_head!r}: expected 'chunked' or 'full'")
    if opts.loss_chunk_tokens < 1:
        raise RecipeError(f"train.loss_chunk_tokens = {opts.loss_chunk_tokens}: must be >= 1, e.g. 2048")

    cfg = normalize_hf_config(hf_cfg)
    config = transformer_config(cfg, opts)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model_class = chunked_loss_gpt_model_class() if opts.loss_head == "chunked" else GPTModel
    _forget_attention_backend_variables()
    model = model_class(
        config=config,
        transformer_layer_spec=layer_spec(config, opts),
        vocab_size=padded_vocab_size(cfg["vocab_size"], opts.make_vocab_size_divisible_by, opts.tensor),
        max_sequence_length=max(opts.seq_length, cfg.get("max_position_embeddings") or 0),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(cfg["tie_word_embeddings"]),
        position_embedding_type="rope",
        rotary_base=cfg["rope_theta"],
        rotary_percent=cfg.get("partial_rotary_factor", 1.0),
    )
    _BACKEND_SET_BY_A_BUILD.update({k: os.environ[k] for k in TE_BACKEND_VARIABLES if k in os.environ})
    if opts.loss_head == "chunked":
        model.loss_chunk_tokens = opts.loss_chunk_tokens
    if config.params_dtype != torch.float32:
        # The local spec's norms are torch modules created in fp32 (Megatron-LM's Float16Module casts them with
        # every other parameter); with bf16 activations torch's fused RMSNorm then falls back to an unfused
        # path. TE's norms already follow params_dtype. The optimizer keeps fp32 main weights either way.
        for module in model.modules():
            if isinstance(module, torch.nn.RMSNorm):
                module.to(config.params_dtype)
    attach_rotary_embedding(model, cfg)
    if opts.device == "cuda":
        # Megatron's linear and embedding layers allocate on the GPU, but the local spec's norms
        # (`WrappedTorchNorm`) are built on the host whatever the device (TE's are on the GPU); the DDP
        # buffers of the distributed optimizer would move them, nothing else does (evaluation, the plain
        # optimizer). Megatron-LM's `get_model` moves every model the same way.
        model.cuda(torch.cuda.current_device())
    return model


def build_model_from_recipe(recipe: Recipe, **kwargs):
    """`build_model` for the recipe's architecture and layout."""
    return build_model(hf_config_from_recipe(recipe), BuildOptions.from_recipe(recipe), **kwargs)
