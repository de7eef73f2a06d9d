"""Tokenizer loading for local tokenizer directories or bare ``tokenizer.json`` files."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

DEFAULT_ASSETS_DIR: Path = Path(__file__).resolve().parent / "assets"

# A bare tokenizer.json carries no notion of which token plays which role, so roles are
# assigned by these conventional names when the vocabulary has them.
_CONVENTIONAL_ROLES = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
}


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a fast tokenizer from a directory holding ``tokenizer.json`` or from the file itself.

    Directories are loaded with ``from_pretrained`` so their ``tokenizer_config.json`` decides
    the special tokens. Tokenizers without a pad token reuse EOS for padding; padded positions
    are always masked out of the loss, so the pad id only has to be a valid id.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"Tokenizer directory {p} has no tokenizer.json (config field data.tokenizer). "
                f"Point data.tokenizer at a directory written by `save_pretrained`, at a tokenizer.json "
                f"file, or at the shipped tokenizer in {DEFAULT_ASSETS_DIR}."
            )
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(p))
    elif p.is_file():
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(p))
        vocab = tokenizer.get_vocab()
        for role, token in _CONVENTIONAL_ROLES.items():
            if getattr(tokenizer, role) is None and token in vocab:
                setattr(tokenizer, role, token)
    else:
        raise FileNotFoundError(
            f"Tokenizer path {p} does not exist (config field data.tokenizer). "
            f"Set data.tokenizer to a tokenizer directory or tokenizer.json file; "
            f"the shipped tiny tokenizer is at {DEFAULT_ASSETS_DIR}."
        )

    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"Tokenizer at {p} defines no EOS token (config field data.tokenizer); SFT sequences end "
            "with EOS so the model learns where a response stops. Set eos_token in its tokenizer_config.json."
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
