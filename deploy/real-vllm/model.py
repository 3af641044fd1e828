"""Tiny random-weight models and a small byte-level BPE tokenizer, made locally.

Nothing is downloaded (``HF_HUB_OFFLINE=1``): the tokenizer is trained with
``tokenizers`` on text generated here from a fixed seed, and the model is saved with
random weights: a two-layer ``LlamaConfig`` (``make``), or for the hybrid-attention
mode a four-layer Gemma-3 text model, three sliding-window layers (window 128 tokens)
and one full-attention layer (``make_hybrid``), which vLLM serves with one KV cache
group per layer. vLLM loads the directory as it would a hub model, and the gateway
reads the same ``tokenizer.json`` and ``tokenizer_config.json``, so both tokenize
alike. The weights are random: the text a request generates is noise, which is all
the router needs (prompts, blocks, events).

Cost: a few seconds and about 1 MiB on disk each; a directory is reused while its
marker names the same recipe.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

RECIPE = "tiny-llama-v1"
"""Bumped when the recipe changes, so an old directory is remade."""

HYBRID_RECIPE = "tiny-gemma3-v1"
"""``RECIPE`` of the hybrid-attention model."""

SLIDING_WINDOW = 128
"""Tokens each sliding-window layer of the hybrid model attends to (vLLM keeps the
last ``SLIDING_WINDOW / block size`` blocks of those layers' KV cache group)."""

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
    """Writes the Llama model and tokenizer into ``model_dir`` unless already there."""
    return _make(model_dir, RECIPE, "a tiny random-weight Llama", _llama, log)


def make_hybrid(model_dir: Path, log) -> Path:
    """Writes the hybrid-attention Gemma-3 model and tokenizer into ``model_dir``
    unless already there."""
    return _make(model_dir, HYBRID_RECIPE,
                 "a tiny random-weight Gemma-3 (3 sliding-window layers + 1 full)",
                 _gemma3, log)


def _make(model_dir: Path, recipe: str, what: str, build, log) -> Path:
    """``build(model_dir)`` (writes tokenizer and weights) unless the marker names
    ``recipe``."""
    marker = model_dir / MARKER
    if marker.exists() and marker.read_text().strip() == recipe:
        return model_dir
    log(f"making {what} and a BPE tokenizer in {model_dir}")
    model_dir.mkdir(parents=True, exist_ok=True)
    build(model_dir)
    marker.write_text(recipe + "\n")
    return model_dir


def _save_tokenizer(model_dir: Path, pad: bool = False) -> tuple[int, int, int]:
    """Trains the BPE tokenizer and saves it with the chat template (and EOS as the
    pad token when ``pad``); its BOS id, EOS id and vocabulary size."""
    # Imported here: only the venv has them.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

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
                                   chat_template=CHAT_TEMPLATE,
                                   **({"pad_token": EOS} if pad else {}))
    fast.save_pretrained(model_dir)
    return bos_id, eos_id, tok.get_vocab_size()


def _llama(model_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    bos_id, eos_id, vocab = _save_tokenizer(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=vocab,
        max_position_embeddings=2048, bos_token_id=bos_id, eos_token_id=eos_id,
        torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(model_dir)


def _gemma3(model_dir: Path) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    bos_id, eos_id, vocab = _save_tokenizer(model_dir, pad=True)
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        query_pre_attn_scalar=32, sliding_window=SLIDING_WINDOW,
        max_position_embeddings=2048, bos_token_id=bos_id, eos_token_id=eos_id,
        pad_token_id=eos_id, torch_dtype="float32")
    Gemma3ForCausalLM(config).save_pretrained(model_dir)


@functools.cache
def _tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def count_tokens(model_dir: Path, text: str) -> int:
    """Prompt tokens of ``text`` as the gateway counts them (BOS included)."""
    return len(_tokenizer(model_dir).encode(text).ids)


def token_ids(model_dir: Path, rng: random.Random, n: int, bos: bool = False) -> list[int]:
    """Exactly ``n`` token ids of fresh pseudo-text drawn from ``rng`` (BOS first when
    ``bos``): a prompt whose length and shared prefixes are exact to the token."""
    tok = _tokenizer(model_dir)
    ids = [tok.token_to_id(BOS)] if bos else []
    while len(ids) < n:
        ids += tok.encode(" " + " ".join(words(rng, 64)), add_special_tokens=False).ids
    return ids[:n]
