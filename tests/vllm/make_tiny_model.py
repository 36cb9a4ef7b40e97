"""Make a small Llama-architecture model directory locally, with no download.

Run it with the Python that has vLLM (it needs `tokenizers` and `transformers`):

    python tests/vllm/make_tiny_model.py OUT_DIR [--shape tiny|llama-8b]

It writes a byte-level BPE tokenizer trained on a seeded synthetic corpus, a ChatML chat
template and a config. There are no weights: serve it with `--load-format dummy`.
`tiny` (2 layers, hidden 128) runs on a laptop CPU; `llama-8b` has Llama-3.1-8B's shape,
so prefill costs on a GPU are real. The output is the same on every run.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

SHAPES = {
    "tiny": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 16384,
    },
    "llama-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rope_theta": 500000.0,
    },
}


def corpus(seed: int = 7, lines: int = 4000) -> list[str]:
    """Seeded text with English-like words, digits and punctuation."""
    rng = random.Random(seed)
    syllables = ["an", "el", "or", "th", "ing", "qu", "st", "re", "ly", "mo", "ca", "pi", "de"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(900)]
    words += ["the", "a", "of", "to", "and", "is", "in", "that", "document", "question"]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(5, 25)))
        + rng.choice([".", "?", "!", ",", ":"])
        + f" {rng.randint(0, 9999)}"
        for _ in range(lines)
    ]


def make_tokenizer(out: Path, vocab_size: int = 2048) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return int(tokenizer.get_vocab_size())


def make_config(out: Path, vocab_size: int, shape: str) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        **SHAPES[shape],
    )
    config.save_pretrained(out)
    generation = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(generation))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(args.out)
    make_config(args.out, vocab, args.shape)
    print(f"wrote {args.shape} model ({vocab} tokens) to {args.out}")


if __name__ == "__main__":
    main()
