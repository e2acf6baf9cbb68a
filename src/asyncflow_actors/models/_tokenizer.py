"""`CharTokenizer`: a character-level tokenizer with an explicit vocabulary."""

from __future__ import annotations

import json
import string
from collections.abc import Iterable, Sequence

import attrs

__all__ = ["DEFAULT_ALPHABET", "CharTokenizer", "TokenizerError"]

#: Characters of the built-in tasks (digits, lower-case letters and a little punctuation).
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + " +-*=?:,.()[]<>|"

_SPECIALS = ("<pad>", "<bos>", "<eos>")


class TokenizerError(ValueError):
    """Text holds a character outside the vocabulary, an id is out of range, or the
    vocabulary itself is invalid."""


def _check_alphabet(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise TokenizerError(f"alphabet must be a non-empty str, got {value!r}")
    dups = sorted({c for c in value if value.count(c) > 1})
    if dups:
        raise TokenizerError(f"alphabet has duplicate characters {dups}; expected each once")


@attrs.frozen
class CharTokenizer:
    """Maps each character of `alphabet` to one id; ids 0, 1, 2 are `<pad>`, `<bos>`, `<eos>`.

    The vocabulary is explicit: encoding a character outside it raises `TokenizerError` instead
    of silently mapping it to an unknown token, so a task and its tokenizer cannot drift apart.
    """

    alphabet: str = attrs.field(default=DEFAULT_ALPHABET, validator=_check_alphabet)
    _index: dict[str, int] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        index = {c: i + len(_SPECIALS) for i, c in enumerate(self.alphabet)}
        object.__setattr__(self, "_index", index)

    @classmethod
    def from_texts(cls, texts: Iterable[str], *, extra: str = "") -> CharTokenizer:
        """A tokenizer whose alphabet is every character of `texts` and `extra`, sorted."""
        chars: set[str] = set(extra)
        for text in texts:
            chars.update(text)
        if not chars:
            raise TokenizerError("from_texts needs at least one character, got only empty texts")
        return cls("".join(sorted(chars)))

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def vocab_size(self) -> int:
        return len(_SPECIALS) + len(self.alphabet)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(len(_SPECIALS)))

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`; raises `TokenizerError` naming the first unknown character."""
        ids = [self.bos_id] if add_bos else []
        index = self._index
        for pos, char in enumerate(text):
            token = index.get(char)
            if token is None:
                raise TokenizerError(
                    f"character {char!r} at position {pos} of {text!r} is not in the "
                    f"vocabulary {self.alphabet!r}"
                )
            ids.append(token)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        """Text of `ids` with special tokens dropped; by default stops at the first `<eos>`."""
        chars: list[str] = []
        n_special = len(_SPECIALS)
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise TokenizerError(f"token id {token} is outside [0, {self.vocab_size})")
            if token == self.eos_id and stop_at_eos:
                break
            if token >= n_special:
                chars.append(self.alphabet[token - n_special])
        return "".join(chars)

    def token_text(self, token: int) -> str:
        """Printable form of one id (special tokens as `<pad>`, `<bos>`, `<eos>`)."""
        if not 0 <= token < self.vocab_size:
            raise TokenizerError(f"token id {token} is outside [0, {self.vocab_size})")
        if token < len(_SPECIALS):
            return _SPECIALS[token]
        return self.alphabet[token - len(_SPECIALS)]

    def to_json(self) -> str:
        return json.dumps({"type": "char", "specials": list(_SPECIALS), "alphabet": self.alphabet})

    @classmethod
    def from_json(cls, text: str) -> CharTokenizer:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"tokenizer JSON is malformed: {exc}") from exc
        if (
            not isinstance(data, dict)
            or data.get("type") != "char"
            or data.get("specials") != list(_SPECIALS)
            or not isinstance(data.get("alphabet"), str)
        ):
            raise TokenizerError(
                f"expected a char tokenizer JSON with specials {list(_SPECIALS)}, got {text[:200]!r}"
            )
        return cls(data["alphabet"])
