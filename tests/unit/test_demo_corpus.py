"""The demo's training documents teach retrieval in the NIAH evaluation's own text form (megatron_ext/demo/corpus.py):
since the evaluation's haystack starts with a space after the instruction's "Text:" (NIAH prompt_version 2), so do
they. Control: the form before ("Text:The special ...", "Text:A painter ...") fails."""

import random
import re

from megatron_ext.demo.corpus import TASK, demo_chats, needle_document


def test_documents_read_as_the_evaluation_prompts():
    for seed in range(300):
        doc = needle_document(random.Random(seed), seed % 6, kv_facts=seed % 3)
        assert doc.startswith(TASK.instruction + " ") and doc[len(TASK.instruction) + 1] != " ", doc[:150]
        # the needle follows a full stop and a space ("Text: " first), and is followed by a space or the question
        at = doc.index(TASK.needle.strip().split("{")[0])
        assert doc[at - 2:at] in (". ", ": "), doc[at - 20:at + 40]
        end = doc.index(".", at) + 1
        assert doc[end] == " " or doc[end:].startswith(TASK.question), doc[at:end + 30]
        assert "  " not in doc and not re.search(r"\.[A-Z]", doc), doc
    (chat,) = demo_chats(1, seed=0, min_sentences=2, max_sentences=4)
    assert chat["messages"][0]["content"].startswith(TASK.instruction + " ")
