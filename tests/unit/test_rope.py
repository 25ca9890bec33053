"""RoPE frequencies against transformers' own ROPE_INIT_FUNCTIONS, table accuracy, bad input."""

import copy
import math
import random

import pytest
import torch

from megatron_ext.presets import LLAMA31_8B
from megatron_ext.recipe import RecipeError
from megatron_ext.rope import (
    ROPE_TYPES,
    ULTRALONG_ROPE,
    RopeConfigError,
    ScaledRotaryEmbedding,
    rope_angles,
    rope_frequencies,
)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # HF warns about unusual but valid random configs


def hf_frequencies(cfg: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """The oracle: transformers' ROPE_INIT_FUNCTIONS (default: the models' own default-RoPE functions)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**copy.deepcopy(cfg))
    kind = config.rope_parameters["rope_type"]
    if kind == "default":  # Llama's default ignores partial_rotary_factor; GPT-NeoX's honours it
        if config.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
            return GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)


def random_config(kind: str, rng: random.Random) -> tuple[dict, list]:
    """A random Llama config with a `kind` rope block, in a random HF form; and seq_lens to try."""
    head_dim = rng.choice([8, 16, 32, 64, 96, 128, 128, 256])
    heads = rng.choice([2, 4, 8])
    cfg = {"hidden_size": head_dim * heads, "num_attention_heads": heads, "num_key_value_heads": heads,
           "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 64}
    if rng.random() < 0.7:
        cfg["head_dim"] = head_dim
    prf = rng.choice([1.0, 1.0, 1.0, 0.5, 0.25, 0.75])
    if int(head_dim * prf) % 2 or int(head_dim * prf) <= 2:
        prf = 1.0
    dim = int(head_dim * prf)
    theta = rng.choice([10000.0, 500000.0, 10 ** rng.uniform(3, 7)])
    max_pos = rng.choice([2048, 8192, 131072, 1 << 20, 1 << 22])
    orig = rng.choice([max_pos, max_pos // 4, max_pos // 64, 4096, 8192])
    orig = max(1, min(orig, max_pos))
    block: dict = {}
    seq_lens: list = [None]
    if kind in ("linear", "dynamic", "llama3", "yarn"):
        block["factor"] = rng.choice([1.0, 2.0, 8.0, 128.0, 512.0, rng.uniform(1, 64)])
    if kind == "dynamic":
        seq_lens += [max_pos // 2, max_pos + 1, 3 * max_pos + 17]
    elif kind == "llama3":
        low = rng.choice([1.0, rng.uniform(0.5, 2)])
        block.update(low_freq_factor=low, high_freq_factor=low + rng.choice([3.0, rng.uniform(0.5, 8)]),
                     original_max_position_embeddings=orig)
    elif kind == "yarn":
        block["original_max_position_embeddings"] = orig
        if rng.random() < 0.7:
            fast = rng.choice([4.0, 32.0, rng.uniform(2, 64)])
            block.update(beta_fast=fast, beta_slow=rng.choice([1.0, rng.uniform(0.1, fast - 0.5)]))
        r = rng.random()
        if r < 0.2:
            block["attention_factor"] = rng.uniform(0.5, 2)
        elif r < 0.4:
            block.update(mscale=rng.choice([0.0, 0.707, 1.0]), mscale_all_dim=rng.choice([0.0, 0.707, 1.0]))
        if rng.random() < 0.3:
            block["truncate"] = rng.choice([True, False])
    elif kind == "longrope":
        block.update(original_max_position_embeddings=orig,
                     short_factor=[rng.uniform(1, 4) for _ in range(dim // 2)],
                     long_factor=[rng.uniform(1, 40) for _ in range(dim // 2)])
        if rng.random() < 0.5:
            block["factor"] = rng.uniform(1, 64)
        if rng.random() < 0.3:
            block["attention_factor"] = rng.uniform(0.5, 2)
        seq_lens += [orig, orig + 1, 4 * orig]
    cfg["max_position_embeddings"] = max_pos
    form = rng.choice(["v4", "v4-type", "v5"])
    if form == "v5":
        cfg["rope_parameters"] = {"rope_type": kind, "rope_theta": theta, **block}
        if prf != 1.0:
            cfg["rope_parameters"]["partial_rotary_factor"] = prf
    else:
        cfg["rope_theta"] = theta
        cfg["rope_scaling"] = {("type" if form == "v4-type" else "rope_type"): kind, **block}
        if kind == "default" and rng.random() < 0.5:
            cfg["rope_scaling"] = None
        if prf != 1.0:
            cfg["partial_rotary_factor"] = prf
    return cfg, seq_lens


@pytest.mark.parametrize("kind", ROPE_TYPES)
def test_matches_transformers_on_random_configs(kind):
    rng = random.Random(f"rope-{kind}")
    worst = 0.0
    for _ in range(40):
        cfg, seq_lens = random_config(kind, rng)
        for seq_len in seq_lens:
            ours, ours_af = rope_frequencies(copy.deepcopy(cfg), seq_len)
            ref, ref_af = hf_frequencies(cfg, seq_len)
            assert ours.dtype == torch.float32 and ours.shape == ref.shape, (cfg, ours.shape, ref.shape)
            rel = ((ours.double() - ref.double()).abs() / ref.double().abs()).max().item()
            worst = max(worst, rel)
            assert rel <= 1e-6, (cfg, seq_len, rel)
            assert ours_af == ref_af, (cfg, ours_af, ref_af)
    print(f"{kind}: worst inv_freq relative error over 40 configs = {worst:.3g}")


def test_forms_are_equivalent():
    """transformers-4 (rope_theta + rope_scaling, old `type` key) and -5 (rope_parameters) forms."""
    block = {"factor": 128.0, "original_max_position_embeddings": 8192, "beta_fast": 4.0, "beta_slow": 1.0}
    base = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    forms = [{**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "yarn", **block}},
             {**base, "rope_theta": 5e5, "rope_scaling": {"type": "yarn", **block}},
             {**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, **block}}]
    results = [rope_frequencies(f) for f in forms]
    for inv_freq, factor in results[1:]:
        assert torch.equal(inv_freq, results[0][0]) and factor == results[0][1]
    assert not torch.equal(results[0][0], rope_frequencies({**base, "rope_theta": 5e5})[0])


def test_dynamic_and_longrope_depend_on_length():
    cfg = {**LLAMA31_8B, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
    assert torch.equal(rope_frequencies(cfg)[0], rope_frequencies(cfg, 1000)[0])  # below max: unscaled
    assert not torch.equal(rope_frequencies(cfg)[0], rope_frequencies(cfg, 200000)[0])
    half = LLAMA31_8B["hidden_size"] // LLAMA31_8B["num_attention_heads"] // 2  # 64 frequencies
    long = {**LLAMA31_8B, "max_position_embeddings": 32768,
            "rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 8192,
                             "short_factor": [1.0] * half, "long_factor": [4.0] * half}}
    # short factors up to the original length, long factors beyond it
    assert torch.equal(rope_frequencies(long, 8192)[0], rope_frequencies(long, 4096)[0])
    assert torch.allclose(rope_frequencies(long, 8193)[0], rope_frequencies(long, 8192)[0] / 4)


def test_ultralong_presets():
    expected_af = {"ultralong-1m": 1.485, "ultralong-2m": 1.555, "ultralong-4m": 1.624}
    for name, factor in (("ultralong-1m", 128), ("ultralong-2m", 256), ("ultralong-4m", 512)):
        block = ULTRALONG_ROPE[name]
        assert block == {"rope_type": "yarn", "rope_theta": 500000.0, "factor": factor,
                         "original_max_position_embeddings": 8192, "beta_fast": 4.0, "beta_slow": 1.0}
        cfg = {**LLAMA31_8B, "rope_scaling": None, "rope_parameters": block, "max_position_embeddings": factor * 8192}
        inv_freq, af = rope_frequencies(cfg)
        ref, ref_af = hf_frequencies(cfg, None)
        assert torch.equal(inv_freq, ref) and af == ref_af and round(af, 3) == expected_af[name]


def _tiny(**fields) -> dict:
    """A small Llama config (head_dim 32: 16 frequencies) with `fields` added."""
    return {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64,
            "num_hidden_layers": 1, "vocab_size": 64, **fields}


def assert_matches_transformers(cfg: dict, seq_len: int | None = None) -> None:
    ours, ours_af = rope_frequencies(copy.deepcopy(cfg), seq_len)
    ref, ref_af = hf_frequencies(cfg, seq_len)
    rel = ((ours.double() - ref.double()).abs() / ref.double().abs()).max().item()
    assert rel <= 1e-6 and ours_af == ref_af, (cfg, seq_len, rel, ours_af, ref_af)


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_top_level_original_length_beats_the_blocks(kind):
    """Phi-3 style: a top-level original_max_position_embeddings wins over the rope block's, as in transformers
    (standardize_rope_params, which every ROPE_INIT_FUNCTIONS entry runs, gives the top-level field priority)."""
    block = {"yarn": {"factor": 8.0},
             "longrope": {"short_factor": [1 + i / 16 for i in range(16)], "long_factor": [4 + i for i in range(16)]}}
    cfg = _tiny(max_position_embeddings=32768, rope_theta=1e4, original_max_position_embeddings=4096,
                rope_scaling={"rope_type": kind, **block[kind], "original_max_position_embeddings": 8192})
    for seq_len in (None, 6000):  # longrope: 6000 is past the top-level 4096 (long factors), not past 8192
        assert_matches_transformers(cfg, seq_len)
    block_only = {k: v for k, v in cfg.items() if k != "original_max_position_embeddings"}
    assert not torch.equal(rope_frequencies(block_only, 6000)[0], rope_frequencies(cfg, 6000)[0])  # control


@pytest.mark.parametrize("cfg", [
    _tiny(max_position_embeddings=2048),
    _tiny(max_position_embeddings=2048, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    _tiny(max_position_embeddings=2048, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 512}),
], ids=["no-block", "v4", "v5"])
def test_missing_rope_theta_is_transformers_default(cfg):
    """No rope_theta anywhere: transformers' default_theta (10000), in either form."""
    assert_matches_transformers(cfg)


@pytest.mark.parametrize("rope_type, old_type, seq_len", [("linear", "dynamic", None), ("dynamic", "linear", 8192)])
def test_rope_type_beats_the_old_type_key(rope_type, old_type, seq_len):
    """A block with both keys: `rope_type` wins, as transformers' setdefault("rope_type", block.get("type"))."""
    cfg = _tiny(max_position_embeddings=2048, rope_theta=1e4,
                rope_scaling={"rope_type": rope_type, "type": old_type, "factor": 4.0})
    assert_matches_transformers(cfg, seq_len)
    other = {**cfg, "rope_scaling": {"rope_type": old_type, "factor": 4.0}}
    assert not torch.equal(rope_frequencies(other, seq_len)[0], rope_frequencies(cfg, seq_len)[0])  # control


def test_yarn_correction_range_past_the_last_channel():
    """beta_slow 0.1 at theta 1000 over 4M original positions: the correction range's top (ceil 36.4) passes
    dim - 1 = 31 and is clamped there, as transformers' find_correction_range does."""
    cfg = _tiny(max_position_embeddings=1 << 22, rope_theta=1000.0,
                rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 1 << 22,
                                 "beta_fast": 2000.0, "beta_slow": 0.1})
    assert_matches_transformers(cfg)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_offset_tables_are_transformers_rows(kind):
    """forward / get_emb / get_cos_sin (L, offset=k) give rows k .. k+L-1 of transformers' LlamaRotaryEmbedding
    at position_ids k .. k+L-1, whose frequencies follow the length L + k: past max_position_embeddings (dynamic)
    or the original length (longrope) although L alone is not."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from megatron_ext.rope import set_attention_factor

    block = {"dynamic": {"factor": 4.0},
             "longrope": {"original_max_position_embeddings": 64, "short_factor": [1 + i / 16 for i in range(16)],
                          "long_factor": [4 + i for i in range(16)]}}
    cfg = _tiny(max_position_embeddings={"dynamic": 64, "longrope": 256}[kind], rope_theta=1e4,
                rope_scaling={"rope_type": kind, **block[kind]})
    length, offset = 48, 32
    hf = LlamaRotaryEmbedding(LlamaConfig(**copy.deepcopy(cfg)))
    cos, sin = (t[0] for t in hf(torch.zeros(1), torch.arange(offset, offset + length)[None]))  # [48, 32] each
    emb = ScaledRotaryEmbedding(copy.deepcopy(cfg))
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2)
    set_attention_factor(config, emb)
    emb.bind(config)
    af = emb.attention_factor
    for angles in (emb(length, offset=offset), emb.get_emb(length, offset=offset)):
        assert angles.shape == (length, 1, 1, 32)
        assert torch.allclose(torch.cos(angles[:, 0, 0]) * af, cos, atol=1e-5, rtol=0)
        assert torch.allclose(torch.sin(angles[:, 0, 0]) * af, sin, atol=1e-5, rtol=0)
    our_cos, our_sin = emb.get_cos_sin(length, offset=offset)
    assert torch.allclose(our_cos, cos[:, :16], atol=1e-5, rtol=0)
    assert torch.allclose(our_sin, sin[:, :16], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- table accuracy

LONG_CONFIGS = {
    **{name: {**LLAMA31_8B, "rope_scaling": None, "rope_parameters": block,
              "max_position_embeddings": int(block["factor"]) * 8192} for name, block in ULTRALONG_ROPE.items()},
    "llama3.1-8b": LLAMA31_8B,
}
POSITIONS = [0, 8192, (1 << 20) - 1, (1 << 21) - 1, (1 << 22) - 1]


@pytest.mark.parametrize("name", list(LONG_CONFIGS))
def test_cos_sin_match_float64_reference(name):
    """cos/sin (attention factor applied) at 0, the original length and 1M/2M/4M - 1 vs float64."""
    cfg = LONG_CONFIGS[name]
    inv_freq, af = rope_frequencies(cfg)
    positions = torch.tensor(POSITIONS)
    angles = rope_angles(positions, inv_freq)  # [5, 64] float32
    exact = positions.double()[:, None] * inv_freq.double()[None, :]  # the same fp32 inv_freq, in float64
    for f, ref in ((torch.cos, torch.cos(exact) * af), (torch.sin, torch.sin(exact) * af)):
        err = (f(angles) * af - ref).abs().max().item()
        assert err <= 1e-5, (name, f.__name__, err)
    # what the embedding module hands Megatron at 4M with CP=64: rank 0 holds position 4M - 1 (chunk 127)
    emb = ScaledRotaryEmbedding(cfg)
    table = emb.local_table(1 << 22, cp_size=64, cp_rank=0)  # [65536, 1, 1, 128]
    assert table.shape == (65536, 1, 1, 128) and table.dtype == torch.float32
    last = table[-1, 0, 0, :64]
    assert (torch.cos(last) - torch.cos(exact[-1])).abs().max() <= 1e-5
    assert torch.equal(table[-1, 0, 0, 64:], last)  # rotate_half layout: [angles, angles]


def test_negative_control_float32_angles_are_inaccurate_at_4m():
    """transformers' own float32 product position x inv_freq is off by far more than 1e-5 at 4M - 1."""
    inv_freq, _ = rope_frequencies(LONG_CONFIGS["ultralong-4m"])
    p = torch.tensor([(1 << 22) - 1])
    naive = torch.cos(p.float()[:, None] * inv_freq[None, :])
    exact = torch.cos(p.double()[:, None] * inv_freq.double()[None, :])
    assert (naive.double() - exact).abs().max() > 1e-2


def test_small_angles_are_bit_identical_to_float32_product():
    inv_freq, _ = rope_frequencies(LLAMA31_8B)
    p = torch.arange(4096)
    naive = p.float()[:, None] * inv_freq[None, :]
    ours = rope_angles(p, inv_freq)
    small = naive <= math.pi
    assert small.sum() > 1000 and torch.equal(ours[small], naive[small])
    assert ours.abs().max() <= math.pi + 1e-6


@pytest.mark.parametrize("name", ["ultralong-4m", "llama3.1-8b"])
def test_float32_angles_are_transformers_own_far_out(name):
    """`rope_angle_precision: float32` (recipe `rope.angle_precision`): the trainer's table, as Megatron applies it
    (cos/sin x factor), equals transformers' LlamaRotaryEmbedding bit for bit on the positions CP rank 0 of 64 holds
    at 4M, last one 4M - 1; the default float64 table differs there by > 1e-2 (control)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from megatron_ext.rope import cp_local_positions

    cfg = LONG_CONFIGS[name]
    hf = LlamaRotaryEmbedding(LlamaConfig(**copy.deepcopy(cfg)))
    positions = cp_local_positions(1 << 22, 64, 0)  # [65536]: chunks 0 and 127 of 128
    theirs = torch.cat(hf(torch.zeros(1), positions[None]), -1)[0]  # [65536, 256]: cos, sin

    def ours(precision: str) -> torch.Tensor:
        emb = ScaledRotaryEmbedding({**cfg, "rope_angle_precision": precision})
        angles = emb.local_table(1 << 22, cp_size=64, cp_rank=0)[:, 0, 0]  # [65536, 128]
        return torch.cat([torch.cos(angles) * emb.attention_factor, torch.sin(angles) * emb.attention_factor], -1)

    assert torch.equal(ours("float32"), theirs)
    assert (ours("float64") - theirs).abs().max() > 1e-2


# ---------------------------------------------------------------------------- bad input

V4 = {k: v for k, v in LLAMA31_8B.items()}


def _v4(**scaling):
    return {**V4, "rope_scaling": scaling}


def _v5(**params):
    return {**{k: v for k, v in V4.items() if k not in ("rope_scaling", "rope_theta")}, "rope_parameters": params}


BAD = [
    ("unknown type", _v4(rope_type="ntk", factor=2.0), "rope_scaling.rope_type = 'ntk'"),
    ("unknown type (v5)", _v5(rope_type="su"), "rope_parameters.rope_type = 'su'"),
    ("missing factor", _v4(rope_type="yarn", original_max_position_embeddings=8192), "rope_scaling.factor: missing"),
    ("missing factor (v5)", _v5(rope_type="linear", rope_theta=1e4), "rope_parameters.factor: missing"),
    ("missing factor (old key)", _v4(type="dynamic"), "rope_scaling.factor: missing"),
    ("factor < 1", _v4(rope_type="yarn", factor=0.5, original_max_position_embeddings=8192),
     "rope_scaling.factor = 0.5: must be >= 1"),
    ("beta_fast <= beta_slow", _v4(rope_type="yarn", factor=128.0, beta_fast=1.0, beta_slow=4.0,
                                   original_max_position_embeddings=8192), "rope_scaling.beta_fast = 1.0"),
    ("beta_fast <= default beta_slow", _v4(rope_type="yarn", factor=8.0, beta_fast=0.5,
                                           original_max_position_embeddings=8192),
     "rope_scaling.beta_fast = 0.5: must be above beta_slow = 1 "),
    ("beta_fast == beta_slow", _v5(rope_type="yarn", factor=8.0, beta_fast=2.0, beta_slow=2.0),
     "rope_parameters.beta_fast = 2.0"),
    ("original above max positions", _v4(rope_type="yarn", factor=8.0, original_max_position_embeddings=262144),
     "rope_scaling.original_max_position_embeddings = 262144: above max_position_embeddings = 131072"),
    ("original above max (llama3)", _v4(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=1 << 20),
     "rope_scaling.original_max_position_embeddings = 1048576"),
    ("llama3 high <= low", _v4(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
                               original_max_position_embeddings=8192), "rope_scaling.high_freq_factor = 1.0"),
    ("llama3 missing low", _v4(rope_type="llama3", factor=8.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192), "rope_scaling.low_freq_factor = None"),
    ("field of another type", _v4(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192, beta_fast=4.0), "rope_scaling.beta_fast"),
    ("typo", _v5(rope_type="yarn", factor=8.0, beta_fst=4.0), "rope_parameters.beta_fst"),
    ("longrope wrong length", _v4(rope_type="longrope", short_factor=[1.0], long_factor=[1.0] * 64,
                                  original_max_position_embeddings=8192), "rope_scaling.short_factor"),
    ("factor not a number", _v4(rope_type="linear", factor="8"), "rope_scaling.factor = '8'"),
    ("partial > 1", {**V4, "partial_rotary_factor": 1.5}, "partial_rotary_factor = 1.5"),
    ("blocks disagree", {**_v4(rope_type="linear", factor=2.0), "rope_parameters": {"rope_type": "linear",
                                                                                     "factor": 4.0}},
     "rope_scaling and rope_parameters disagree on ['factor']"),
]


@pytest.mark.parametrize("cfg, message", [(c, m) for _, c, m in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_clear_error(cfg, message):
    with pytest.raises(RopeConfigError) as e:
        rope_frequencies(cfg)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert isinstance(e.value, RecipeError)  # CLI tools already turn these into `error: ...` lines
