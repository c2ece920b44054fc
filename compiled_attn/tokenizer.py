"""Text <-> token ids: a model directory's ``tokenizer.json`` or UTF-8 bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


def check_token_ids(prompt: list[int], vocab_size: int, name: str) -> None:
    """A prompt's integer token ids must be at least one and lie in ``[0, vocab_size)``.

    Raises:
        ValueError: an empty ``prompt`` or an id outside the vocabulary (the first one
            named); ``name`` says which prompt.
    """
    if not prompt:
        raise ValueError(f"{name} is empty; every prompt needs >= 1 token")
    if min(prompt) < 0 or max(prompt) >= vocab_size:  # (the builtins: a prompt's ids in C, not Python)
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        raise ValueError(f"{name} has token ids outside [0, {vocab_size}) (first: {bad})")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Token id = byte value of the UTF-8 encoding; ids >= 256 decode to U+FFFD."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return b"".join(bytes([i]) if 0 <= i < 256 else "\ufffd".encode() for i in ids).decode(
            "utf-8", errors="replace"
        )


class JsonTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"{path} is not a readable tokenizer.json: {err}") from None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def load_tokenizer(model_dir: str | Path | None) -> Tokenizer:
    """``model_dir/tokenizer.json`` when present, otherwise :class:`ByteTokenizer`."""
    path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    return JsonTokenizer(path) if path is not None and path.is_file() else ByteTokenizer()
