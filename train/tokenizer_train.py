"""Byte-level BPE tokenizer (default 8k vocabulary) trained with `tokenizers` on the corpus train split.

Special tokens: `<|endoftext|>` (id 0, document separator and end of generation), `<|im_start|>`, `<|im_end|>`
(chat turns, Qwen's ChatML), and `<|mask|>` as the **last** id — the drafter's MASK slot token
(`DrafterConfig.from_target` defaults mask_token_id to vocab_size − 1), never produced by encoding text.
Saved as `tokenizer.json` + `tokenizer_config.json` (chat template, eos/pad) that `transformers` loads with
`AutoTokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Byte-level BPE; the result has exactly `vocab_size` ids when the text allows that many merges."""
    if vocab_size < 300:
        raise ValueError("vocab_size must be at least 300 (256 bytes + specials + merges)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([MASK])
    return tok


def tokenizer_config(tok: Tokenizer, model_max_length: int = 4096) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": EOS, "pad_token": EOS, "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE,
        "mask_token_id": tok.token_to_id(MASK),
    }


def generation_config(tok: Tokenizer) -> dict:
    """generation_config.json for a model directory using this tokenizer (stop at end-of-text or end-of-turn)."""
    return {"eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)], "pad_token_id": tok.token_to_id(EOS),
            "bos_token_id": None}


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 4096) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok, model_max_length), indent=2) + "\n")


def apply_chat_template(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The chat template without jinja (same text as `tokenizer_config.json`'s template)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def load_or_train(tok_dir: Path, texts: list[str], vocab_size: int) -> tuple[Tokenizer, bool]:
    """(tokenizer, trained now?): an existing tokenizer.json in tok_dir is reused as is."""
    path = Path(tok_dir) / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path)), False
    tok = train_tokenizer(texts, vocab_size)
    save_tokenizer(tok, tok_dir)
    return tok, True


__all__ = ["EOS", "IM_START", "IM_END", "MASK", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "train_tokenizer",
           "save_tokenizer", "tokenizer_config", "generation_config", "apply_chat_template", "load_or_train"]
