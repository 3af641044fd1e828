"""Builds the tiny test tokenizer and the parity goldens in this directory.

Run with the Hugging Face `tokenizers` and `transformers` Python packages installed:
    python make_fixture.py
It writes tokenizer.json, tokenizer_config.json and golden.json. The goldens are what
transformers' apply_chat_template and the Python tokenizer produce, i.e. what vLLM and
SGLang compute, so the Rust tests check parity against the reference implementation.
"""

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))

CORPUS = [
    "The router sends every request to the worker that already holds its prefix.",
    "A paged cache keeps blocks of sixteen tokens; shared prefixes share blocks.",
    "Hello there! How are you today? I am fine, thank you.",
    "You are a helpful assistant. Answer briefly and clearly.",
    "What is the capital of France? Paris is the capital of France.",
    "Tokens, blocks and hashes: 123 456 7890.",
]
SPECIALS = ["<|bos|>", "<|eos|>", "<|start|>", "<|end|>", "<|pad|>"]
# A GPT-style split: contractions, letters, digits in threes, punctuation, spaces.
SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def train(lines, vocab_size, normalizer=None):
    """A byte-level BPE with SPLIT, SPECIALS and a BOS post-processor, trained on
    `lines` up to `vocab_size` tokens (also used by tests/python/bench_tokenizer.py)."""
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A",
        pair="<|bos|> $A <|bos|> $B",
        special_tokens=[("<|bos|>", bos)],
    )
    return tok


def main():
    tok = train(CORPUS, 400)
    bos = tok.token_to_id("<|bos|>")
    tok.save(os.path.join(HERE, "tokenizer.json"))

    TEMPLATE = (
        "{{- bos_token }}"
        "{%- if messages[0]['role'] == 'system' %}"
        "{%- set system = messages[0]['content'] | trim %}{%- set rest = messages[1:] %}"
        "{%- else %}{%- set system = 'Be brief.' %}{%- set rest = messages %}{%- endif %}"
        "{{- '<|start|>system\\n' + system + '<|end|>\\n' }}"
        "{%- for message in rest %}"
        "{%- if message.role not in ['user', 'assistant'] %}"
        "{{- raise_exception('unsupported role: ' + message.role) }}"
        "{%- endif %}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('roles must alternate user/assistant') }}"
        "{%- endif %}"
        "{{- '<|start|>' + message.role + '\\n' + message.content.strip() + '<|end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start|>assistant\\n' }}{%- endif %}"
    )
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<|bos|>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False},
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    with open(os.path.join(HERE, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    # Goldens from the reference implementation.
    from transformers import PreTrainedTokenizerFast  # noqa: E402

    hf = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(HERE, "tokenizer.json"),
        bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
    )
    hf.chat_template = TEMPLATE
    chat = [
        {"role": "system", "content": "  You are a helpful assistant.\n"},
        {"role": "user", "content": "Hello there! What is the capital of France?"},
        {"role": "assistant", "content": " Paris. "},
        {"role": "user", "content": "And 12345 tokens?"},
    ]
    rendered = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    rendered_no_gen = hf.apply_chat_template(chat[1:2], tokenize=False, add_generation_prompt=False)
    completion = "The router sends every request to the worker that already holds its prefix."
    golden = {
        "chat": chat,
        "chat_rendered": rendered,
        # vLLM's chat path: render, then tokenize with add_special_tokens=False.
        "chat_ids": hf(rendered, add_special_tokens=False)["input_ids"],
        "chat_rendered_no_generation_prompt": rendered_no_gen,
        "completion": completion,
        # vLLM's completions path: add_special_tokens=True (the default).
        "completion_ids": hf(completion, add_special_tokens=True)["input_ids"],
        "completion_ids_no_special": hf(completion, add_special_tokens=False)["input_ids"],
        "unicode": "naïve café — 東京 🚀",
        "unicode_ids": hf("naïve café — 東京 🚀", add_special_tokens=False)["input_ids"],
        "bos_id": bos,
        "eos_id": tok.token_to_id("<|eos|>"),
    }
    with open(os.path.join(HERE, "golden.json"), "w") as f:
        json.dump(golden, f, indent=2, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
