"""How docs/images/niah_example.png was made: a tiny Llama trained briefly on CPU to retrieve needles.

    PYTHONPATH=. OMP_NUM_THREADS=1 python docs/images/niah_example.py /tmp/niah_toy 1200   # ~10 min on CPU
    python tools/niah.py --model /tmp/niah_toy --lengths 64,128,192,256,320,384,448,512 --depths 0:100:10 \
        --samples 4 --force --title "Tiny Llama trained to 256 tokens (CPU, 1200 steps), run to 512 with --force" \
        --out /tmp/niah_toy_out && cp /tmp/niah_toy_out/heatmap.png docs/images/niah_example.png
    PYTHONPATH=. python -c "from megatron_ext.evaluate.haystack import filler_sentences as f; g = f(7); \
        open('/tmp/doc.txt', 'w').write(' '.join(next(g) for _ in range(300)))"
    python tools/niah.py ppl --model /tmp/niah_toy --text /tmp/doc.txt --seq-len 1024 --label "tiny Llama (256 tokens)" \
        --out /tmp/niah_toy_ppl && cp /tmp/niah_toy_ppl/ppl.png docs/images/ppl_example.png

The model (4 layers, hidden 128, max_position_embeddings 256) and the word-level tokenizer are
those of tests/unit/test_evaluate.py, scaled up a little; training prompts come from the NIAH
prompt builder itself, at lengths up to 256, with the LM loss on every token.
"""

import random
import sys
import time
from pathlib import Path

import torch

from megatron_ext.evaluate.haystack import Haystack, builtin_haystack
from megatron_ext.evaluate.niah import NeedleTask, build_prompt, prompt_parts
from megatron_ext.presets import TINY
from tests.unit.test_evaluate import make_tokenizer


def main(out: str, steps: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    tok = make_tokenizer()
    cfg = dict(TINY, hidden_size=128, intermediate_size=352, num_hidden_layers=4, head_dim=32)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})).train()
    task = NeedleTask()
    head, tail = prompt_parts(tok, task, chat=False)
    hay = builtin_haystack(tok, 40000, seed=123)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 200))
    rng = random.Random(0)
    t0 = time.time()
    for step in range(steps):
        n_ans = 9  # "▁", 7 digits, "."
        length = rng.choice(range(64, 257, 16)) - n_ans
        rows = []
        for _ in range(16):
            value = str(rng.randrange(10 ** 6, 10 ** 7))
            needle = tok(task.needle.format(value=value), add_special_tokens=False)["input_ids"]
            off = rng.choice(hay.starts[hay.starts < 30000].tolist())
            part = Haystack(hay.ids[off:], hay.starts[hay.starts >= off] - off, "train")
            ids, _, _ = build_prompt(part, head, needle, tail, length, rng.uniform(0, 100))
            rows.append(ids + tok(" " + value + ".", add_special_tokens=False)["input_ids"])
        x = torch.tensor(rows)
        logits = model(x[:, :-1]).logits.float()
        per_tok = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # [B, T]
        answer = per_tok[:, -n_ans:].mean()
        loss = per_tok.mean() + answer
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f} answer {answer.item():.3f} {time.time() - t0:.0f}s", flush=True)
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(sys.argv[1], int(sys.argv[2]))
