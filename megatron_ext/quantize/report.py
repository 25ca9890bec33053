"""Serving memory of an FP8 export: weights and KV cache at long contexts (pure arithmetic).

The KV-cache formula is the planner's (`megatron_ext.cost_model.kv_cache_bytes_per_token`), shared.
"""

from __future__ import annotations

from megatron_ext.cost_model import kv_cache_bytes_per_token, layer_matmul_params, shape_from_hf_config, total_params

GIB = 1 << 30
SERVING_LENGTHS = (1 << 20, 1 << 21, 1 << 22)  # 1M, 2M, 4M tokens
BF16, FP8 = 2.0, 1.0


def weight_bytes(hf_cfg: dict, weights: str = "fp8", base_bytes: float = BF16) -> float:
    """Bytes of the weights: FP8 linear layers of the decoder (1 B + scales, negligible), the rest
    (embedding, LM head, norms: left unquantized by ModelOpt's FP8 config) at `base_bytes`."""
    s = shape_from_hf_config(hf_cfg)
    total = total_params(s)
    if weights == "none":
        return total * base_bytes
    linear = s.layers * layer_matmul_params(s)
    return linear * FP8 + (total - linear) * base_bytes


def serving_memory(hf_cfg: dict, lengths=SERVING_LENGTHS, weights: str = "fp8", kv_cache: str = "fp8") -> list[dict]:
    """Per context length (batch of one): weights + KV cache in bytes, BF16 vs the export."""
    kv_ref = kv_cache_bytes_per_token(hf_cfg, BF16)
    kv_q = kv_cache_bytes_per_token(hf_cfg, FP8 if kv_cache == "fp8" else BF16)
    w_ref, w_q = weight_bytes(hf_cfg, "none"), weight_bytes(hf_cfg, weights)
    return [{"tokens": n, "bf16": w_ref + n * kv_ref, "fp8": w_q + n * kv_q,
             "kv_bf16": n * kv_ref, "kv_fp8": n * kv_q, "saved": (w_ref + n * kv_ref) - (w_q + n * kv_q)}
            for n in lengths]


def _tokens(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n:,}"


def _size(b: float) -> str:
    return f"{b / GIB:.1f} GiB" if b >= GIB / 10 else f"{b / 2**20:.1f} MiB"


def format_serving_table(rows: list[dict]) -> str:
    """Markdown table of `serving_memory` rows."""
    lines = ["| context | BF16 weights + KV | FP8 export | KV cache BF16 -> FP8 | saved |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {_tokens(r['tokens'])} | {_size(r['bf16'])} | {_size(r['fp8'])} | "
                     f"{_size(r['kv_bf16'])} -> {_size(r['kv_fp8'])} | {_size(r['saved'])} |")
    return "\n".join(lines)


def format_report(hf_cfg: dict, layers: dict[str, list[str]], in_bytes: int, out_bytes: int,
                  kv_cache: str, weights: str) -> str:
    """The export report: what was quantized, checkpoint sizes, KV bytes per token, serving memory."""
    kv_before = kv_cache_bytes_per_token(hf_cfg, BF16)
    kv_after = kv_cache_bytes_per_token(hf_cfg, FP8 if kv_cache == "fp8" else BF16)
    kinds = sorted({n.rsplit(".", 1)[-1] for n in layers["fp8_linear"]})
    lines = [
        f"quantized: {len(layers['fp8_linear'])} linear layers to FP8 E4M3 (weights and inputs, per-tensor scales)"
        + (f": {', '.join(kinds)} in each decoder layer" if kinds else ""),
        f"KV cache: {'FP8 (k_scale/v_scale) in ' + str(len(layers['fp8_kv_cache'])) + ' attention layers' if kv_cache == 'fp8' else 'unchanged (--kv-cache none)'}",
        f"kept in the original dtype: {', '.join(layers['kept']) or 'none'}",
        f"checkpoint size: {in_bytes / 2**20:,.2f} MiB -> {out_bytes / 2**20:,.2f} MiB "
        f"({out_bytes / max(in_bytes, 1):.2f}x)",
        f"KV cache per token: {kv_before:,.0f} B (BF16) -> {kv_after:,.0f} B ({'FP8' if kv_cache == 'fp8' else 'BF16'})",
        "serving memory at long contexts (batch 1; weights + KV cache):",
        format_serving_table(serving_memory(hf_cfg, weights=weights, kv_cache=kv_cache)),
    ]
    return "\n".join(lines)
