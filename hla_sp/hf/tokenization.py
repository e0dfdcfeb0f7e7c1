"""The byte-level tokenizer of hla-sp as a Hugging Face tokenizer.

Ids 0..255 are the bytes of the UTF-8 text and id 256 ends a document (the end of
sequence token, also used for padding): the tokens ``hla-sp make-dataset`` writes by
default and the trainer's built-in data uses. Any text round-trips (its UTF-8 bytes are
the ids); a decoded byte sequence that is not valid UTF-8 (a cut multi-byte character)
shows U+FFFD where the cut lies.

The class needs no vocabulary file: ``save_pretrained`` writes only the tokenizer's
config, and ``from_pretrained`` (or ``AutoTokenizer`` after ``import hla_sp.hf``)
rebuilds it from that.
"""

from __future__ import annotations

from typing import Any

from transformers import AddedToken, PreTrainedTokenizer

__all__ = ["BYTES", "EOD", "EOD_TOKEN", "HLASPByteTokenizer"]

BYTES = 256  # ids 0..255: one per byte value
EOD = 256  # the end of a document, as in hla_sp.launch.data.indexed_dataset
EOD_TOKEN = "<|endoftext|>"


class HLASPByteTokenizer(PreTrainedTokenizer):
    """UTF-8 bytes as ids 0..255; ``<|endoftext|>`` (256) is eos and pad.

    A token's string is the character whose code point is its byte (``chr(b)``), so
    the 256 byte tokens are distinct one-character strings and the special token,
    longer, never collides with one.
    """

    model_input_names = ["input_ids", "attention_mask"]  # noqa: RUF012 (transformers' API)

    def __init__(self, eos_token: str | AddedToken = EOD_TOKEN,
                 pad_token: str | AddedToken | None = None, **kwargs: Any):
        # the end of document takes id 256 before the base class adds special tokens,
        # so that a reload gives it the same id
        eod = AddedToken(str(eos_token), special=True, normalized=False, lstrip=False,
                         rstrip=False)
        self._added_tokens_decoder = {EOD: eod}
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        # text is always its bytes, as make-dataset writes it: a literal "<|endoftext|>"
        # in a document is 13 bytes there, so it is here too
        kwargs.setdefault("split_special_tokens", True)
        kwargs.pop("added_tokens_decoder", None)  # always the one above
        super().__init__(eos_token=eod, pad_token=pad_token or eod, **kwargs)

    @property
    def vocab_size(self) -> int:
        """The byte ids (256); ``len(tokenizer)`` counts the end of document too (257)."""
        return BYTES

    def get_vocab(self) -> dict[str, int]:
        vocab = {chr(b): b for b in range(BYTES)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        if len(token) == 1 and ord(token) < BYTES:
            return ord(token)
        raise ValueError(f"token: expected one character below U+0100 (a byte), got {token!r}")

    def _convert_id_to_token(self, index: int) -> str:
        if 0 <= index < BYTES:
            return chr(index)
        raise ValueError(f"id: expected 0..{BYTES - 1} or {EOD} (end of document), got {index}")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Bytes are joined and decoded together (a character may span several); a
        special token is its own text."""
        out: list[str] = []
        run = bytearray()
        for t in tokens:
            if len(t) == 1 and ord(t) < BYTES:
                run.append(ord(t))
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(t)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def save_vocabulary(self, save_directory: str,
                        filename_prefix: str | None = None) -> tuple[str, ...]:
        """No vocabulary file: the 256 bytes are the vocabulary."""
        return ()
