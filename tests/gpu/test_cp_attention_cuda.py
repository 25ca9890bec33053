"""Zigzag CP attention on a CUDA GPU runs in flash attention (no mask tensor) and equals causal attention."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_per_chunk_cp_attention_runs_in_flash_and_matches_causal_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_ext.attention import zigzag_causal_attention
    from megatron_ext.context_parallel import cp_positions

    def sdpa(q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=k.shape[1] != q.shape[1])

    seq, cp_size = 8192, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, seq, 128, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(1, 8, seq, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    for rank in (0, cp_size - 1):
        pos = cp_positions(seq, cp_size, rank).cuda()
        mask = pos[:, None] >= torch.arange(seq, device="cuda")[None, :]
        ref = sdpa(q[:, :, pos].double(), k.double(), v.double(), mask)  # float64 math kernel, [1, 32, 2048, 128]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises "No available kernel" if a mask were needed
            ours = zigzag_causal_attention(sdpa, q[:, :, pos], k, v, cp_size, rank)
        flash_whole = sdpa(q, k, v)[:, :, pos]  # the same kernel on the whole sequence: the bf16 rounding to expect
        err_ours = (ours.double() - ref).abs().max()
        err_whole = (flash_whole.double() - ref).abs().max()
        assert err_ours <= 2 * err_whole + 1e-3, (rank, err_ours, err_whole)
    with pytest.raises(RuntimeError):  # control: a dense mask has no flash kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            sdpa(q[:, :, pos], k, v, mask)


@pytest.mark.parametrize("kernel", ["flash", "cudnn", "efficient"])
def test_forced_sdpa_kernel_runs_and_matches_float64(kernel):
    """runtime.sdpa_kernel on the GPU: each kernel runs the sdpa backend's causal GQA attention (K/V repeated where it
    refuses grouped K/V: recorded), forward and backward, within bf16 rounding of float64 attention; the profiler
    names the forced kernel's op."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.attention import TorchSDPAttention
    from megatron_ext.model import BuildOptions, transformer_config
    from megatron_ext.presets import TINY

    cfg = {**TINY, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    config = transformer_config(cfg, BuildOptions(device="cuda", attention="sdpa", precision="bf16"))
    attention = TorchSDPAttention(config, 1, AttnMaskType.causal, "self", sdpa_kernel=kernel)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4096, 1, 32, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(4096, 1, 8, 128, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    with torch.profiler.profile() as prof:
        out = attention(q, k, v)  # [s, b, nh * d]
        out.float().square().sum().backward()
    ran = {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")}
    assert f"aten::_scaled_dot_product_{kernel}_attention" in ran, ran  # the forced kernel, not SDPA's own choice
    ref = F.scaled_dot_product_attention(*(t.detach().double().permute(1, 2, 0, 3) for t in (q, k, v)),
                                         is_causal=True, enable_gqa=True).permute(2, 0, 1, 3).reshape(4096, 1, -1)
    assert (out.double() - ref).abs().max() < 2e-2, kernel
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    print(f"[sdpa_kernel] {kernel}: grouped K/V {'repeated' if attention._expand_kv else 'taken as they are'}")
