"""A tiny random-weight Llama and a small byte-level BPE tokenizer, made locally.

Nothing is downloaded (``HF_HUB_OFFLINE=1``): the tokenizer is trained with
``tokenizers`` on text generated here from a fixed seed, and the model is a
``LlamaConfig`` of two layers saved with random weights. vLLM loads the directory as
it would a hub model, and the gateway reads the same ``tokenizer.json`` and
``tokenizer_config.json``, so both tokenize alike. The weights are random: the text a
request generates is noise, which is all the router needs (prompts, blocks, events).

Cost: a few seconds and about 1 MiB on disk; the directory is reused while its
marker names the same recipe.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

RECIPE = "tiny-llama-v1"
"""Bumped when the recipe changes, so an old directory is remade."""

MARKER = ".real-vllm-recipe"

VOCAB_SIZE = 2048
"""Target BPE vocabulary, tokens (the model's embedding rows)."""

BOS, EOS = "<s>", "</s>"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A minimal chat template; ``{{ bos_token }}`` first, as Llama's."""

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "da", "fe",
             "gu", "hi", "jo", "be", "qua", "tri", "son", "mar", "ell", "ost", "ing"]


def words(rng: random.Random, n: int) -> list[str]:
    """``n`` pseudo-words of 1–4 syllables drawn from ``rng``."""
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))
            for _ in range(n)]


def make(model_dir: Path, log) -> Path:
    """Writes the model and tokenizer into ``model_dir`` unless already there."""
    marker = model_dir / MARKER
    if marker.exists() and marker.read_text().strip() == RECIPE:
        return model_dir
    log(f"making a tiny random-weight Llama and a BPE tokenizer in {model_dir}")
    # Imported here: only the venv has them.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20250625)
    corpus = [" ".join(words(rng, 64)) for _ in range(4000)]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(model_dir)

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=tok.get_vocab_size(),
        max_position_embeddings=2048, bos_token_id=bos_id, eos_token_id=eos_id,
        torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(model_dir)
    marker.write_text(RECIPE + "\n")
    return model_dir


@functools.cache
def _tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def count_tokens(model_dir: Path, text: str) -> int:
    """Prompt tokens of ``text`` as the gateway counts them (BOS included)."""
    return len(_tokenizer(model_dir).encode(text).ids)
