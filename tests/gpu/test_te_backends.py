"""Real Transformer Engine paths (TE spec, FP8 linear layers, FP8 attention): skipped without CUDA + TE."""

import pytest
import torch

from megatron_ext.runtime import te_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not te_available(), reason="needs transformer_engine (pip install -e '.[gpu]')"),
]


def _logits(opts, cfg, tokens):
    from megatron_ext.model import build_model

    torch.manual_seed(0)
    model = build_model(cfg, opts).cuda()
    return model, model(tokens, torch.arange(tokens.shape[1], device="cuda")[None], None)


def test_te_spec_matches_sdpa_on_same_weights(gpu_state):
    from megatron_ext.model import BuildOptions
    from megatron_ext.presets import TINY

    tokens = torch.randint(0, 512, (1, 128), device="cuda")
    positions = torch.arange(128, device="cuda")[None]
    te_model, _ = _logits(BuildOptions(device="cuda", attention="te", precision="bf16"), TINY, tokens)
    sdpa_model, _ = _logits(BuildOptions(device="cuda", attention="sdpa", precision="bf16"), TINY, tokens)
    with torch.no_grad():  # both were built from one seed: moved, the weights only agree if they are copied
        for param in te_model.parameters():
            param.add_(0.02 * torch.randn_like(param))
        te_logits = te_model(tokens, positions, None)
    # TE fuses each norm into the linear after it; the local spec names them apart (convert/mapping.py)
    renames = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
    state = {}
    for key, value in te_model.state_dict().items():
        if not key.endswith("_extra_state"):
            for te_name, local_name in renames.items():
                key = key.replace(te_name, local_name)
            state[key] = value
    missing, unexpected = sdpa_model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    with torch.no_grad():
        sdpa_logits = sdpa_model(tokens, positions, None)
    assert (te_logits.float() - sdpa_logits.float()).abs().max() < 5e-2


def test_fp8_attention_forward_backward(gpu_state):
    from megatron_ext.model import BuildOptions
    from megatron_ext.presets import TINY

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 attention needs sm90")
    cfg = {**TINY, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128,
           "intermediate_size": 512}
    tokens = torch.randint(0, 512, (1, 256), device="cuda")
    model, _ = _logits(BuildOptions(device="cuda", attention="te", precision="bf16", fp8="hybrid",
                                    fp8_attention=True), cfg, tokens)
    if model.config.gradient_accumulation_fusion:  # (Apex images) TE's linears add weight gradients into
        for p in model.parameters():              # main_grad, which Megatron's DDP gives each parameter
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    loss = model(tokens, torch.arange(256, device="cuda")[None], None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
