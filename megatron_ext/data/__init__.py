"""Long-context data: corpus -> tokens -> Megatron-Core indexed dataset; SFT chat data with loss masks.

Usage
-----
CPT corpus (the paper: per-source length upsampling, documents separated by the literal text
`<s>`, packed by Megatron-Core's GPTDataset into 1M/2M/4M sequences with no document mask)::

    python tools/prepare_data.py cpt --input yaofu/slimpajama-per-source-length-upsample \\
        --tokenizer meta-llama/Llama-3.1-8B-Instruct --output data/cpt --max-tokens 1300000000
    python tools/prepare_data.py cpt --input a.jsonl b.parquet c.txt --tokenizer TOK_DIR --output data/cpt \\
        --source-field meta.source --upsample 'lt4k=0.5,gt8k=2.0' --separator '<s>' --workers 8

  (the recipes read steps x batch x seq_length tokens: 1.05B for cpt_1m and cpt_2m, 1.26B for cpt_4m; with
  less, GPTDataset repeats some, which launch --check and the trainer warn about) writes data/cpt.bin/.idx
  (Megatron-Core `IndexedDatasetBuilder`) and data/cpt.json (documents,
  tokens, per-source counts, length histogram, skipped lines, settings, tokenizer hash). Inputs:
  .jsonl/.json (JSON Lines)/.parquet/.txt (one document per line) files, folders of them (every data file,
  recursively, all of one type: `sources.py`), or a `datasets` hub name (`NAME[:split]`, streamed). `--separator` is literal text (default `<s>`), `bos-eos`
  (`<|begin_of_text|>` doc `<|end_of_text|>`) or `none`. `--upsample` rules: see `cpt.py`.

SFT chat data (records with a `messages` list of {role, content})::

    python tools/prepare_data.py sft --input chats.jsonl --tokenizer TOK_DIR --output data/sft \\
        --seq-length 8192 [--chat-template llama3.1 | tokenizer | FILE.jinja] \\
        [--answer-field answer] [--max-samples N]

  writes data/sft.bin/.idx (tokens), data/sft_lossmask.bin/.idx (uint8, 1 on assistant tokens)
  and data/sft.json. The built-in llama3.1 template needs a tokenizer with Llama-3's
  `<|start_header_id|>`/`<|end_header_id|>`/`<|eot_id|>` tokens (refused otherwise). Samples
  without an assistant turn, longer than --seq-length, or malformed (with the built-in llama3.1
  template: a role other than system/user/assistant/tool/ipython) are dropped and counted.
  `--answer-field` appends a row's separately kept reply as the last assistant turn (AceMath-Instruct's
  `answer`); `--max-samples N` keeps N rows drawn uniformly with --seed.

Reading (trainer side)::

    from megatron_ext.data import build_cpt_datasets, SFTPackedDataset, collate_packed
    train, valid, test = build_cpt_datasets("data/cpt", seq_length=1_048_576, seed=1234)
    sft = SFTPackedDataset("data/sft", seq_length=8192)   # batch dict shapes: see loaders.py

Offline toys for tests and the demo: `toy.build_toy_tokenizer(dir)`, `toy.synthetic_corpus(n)`,
`toy.synthetic_chats(n)`, `toy.write_jsonl(path, records)`.

Every output is written under a temporary name and renamed into place when complete; an
existing PREFIX is refused without `--force`. User mistakes raise `DataError` (one line).
"""

from megatron_ext.data.common import DataError

# Lazy (PEP 562): the CLI's argument and path checks should not pay for importing torch and
# Megatron-Core, which the readers need.
_LAZY = {"prepare_cpt": "cpt", "prepare_sft": "sft", "pack_samples": "sft", "SFTPackedDataset": "loaders",
         "build_cpt_datasets": "loaders", "collate_packed": "loaders", "read_manifest": "dataset_files"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"megatron_ext.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'megatron_ext.data' has no attribute {name!r}")


__all__ = ["DataError", *_LAZY]
