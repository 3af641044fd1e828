"""Builds a realistic byte-level BPE tokenizer for the gateway's measurements.

    python bench_tokenizer.py OUT_DIR [CORPUS_FILE...]

The repo's test tokenizer (kv-tokenizer/tests/data) has 400 tokens: it makes about one
token per two bytes of English and its encodes cost little, so it understates what a
real model's tokenizer costs. This trains one shaped like Llama 3's and Qwen 2's (NFC,
their split regex, byte-level BPE, a BOS post-processor: the test fixture's `train`)
with a 32,000-token vocabulary on the given text files (default: this Python's own
reference documentation, pydoc_data/topics.py, and its standard library's top-level
modules: English prose, docstrings and code), and writes OUT_DIR/tokenizer.json and
OUT_DIR/tokenizer_config.json. Nothing is downloaded; the same inputs give the same
files.
"""

import glob
import json
import os
import sys

from tokenizers import normalizers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "kv-tokenizer", "tests", "data"))
from make_fixture import train  # noqa: E402

TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start|>' + message.role + '\\n' + message.content + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant\\n' }}{%- endif %}"
)


def main():
    out, corpus = sys.argv[1], sys.argv[2:]
    if not corpus:
        import pydoc_data.topics

        stdlib = os.path.dirname(os.__file__)
        corpus = [pydoc_data.topics.__file__] + sorted(glob.glob(os.path.join(stdlib, "*.py")))
    lines = []
    for path in corpus:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines.extend(f.read().splitlines())
    tok = train(lines, 32000, normalizers.NFC())
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(json.dumps({"vocab": tok.get_vocab_size(), "lines": len(lines)}))


if __name__ == "__main__":
    main()
