"""A character-level tokenizer that is a real ``transformers.PreTrainedTokenizerFast``.

One token per character, so a tiny model's vocabulary stays ~90 and ``decode(encode(s)) == s`` for every
string over :data:`CHARS` (spaces and newlines included). Being a genuine ``tokenizers``-backed fast
tokenizer, it saves with ``save_pretrained``, loads with ``AutoTokenizer.from_pretrained(path)`` offline and
is accepted as a ``processing_class`` by TRL.

Ids: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3, then :data:`CHARS` in order from 4.

Conventions the trainer relies on:
  - no special tokens are added automatically (the post-processor is the identity template ``$A``): the
    trainer prepends BOS and appends EOS itself, by id, so what you encode is what the model sees;
  - text is only ever characters: ``split_special_tokens=True``, so the string ``"<eos>"`` encodes to the
    five characters ``< e o s >``, not to EOS. Special tokens enter a sequence by id only. Without this a
    string over the alphabet such as ``"<pad>"`` would not round-trip, and text produced by a model could
    smuggle in control tokens;
  - ``padding_side="left"``: prompts are left-padded for generation;
  - decoding concatenates characters (``Fuse`` decoder, no clean-up of spaces), so ``" ."`` stays ``" ."``.
Characters outside the alphabet encode to ``<unk>`` (and vanish with ``skip_special_tokens=True``).
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
"""Special tokens, in id order 0..3."""

CHARS: str = "0123456789+-*=()<>/. ,:;?!abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n\\{}_^#|"
"""The alphabet: digits, arithmetic, punctuation, space, letters, newline and ``\\boxed{}``-style LaTeX."""


def char_vocab() -> dict[str, int]:
    """Token -> id: the special tokens first (0..3), then every character of :data:`CHARS`."""
    tokens = [*SPECIAL_TOKENS, *CHARS]
    assert len(set(tokens)) == len(tokens), "duplicate character in the alphabet"
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer (vocabulary size ``len(SPECIAL_TOKENS) + len(CHARS)`` = 90)."""
    backend = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    # Split every code point into its own piece. Oniguruma has no (?s), so "any character" is [\s\S].
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")  # adds nothing
    backend.decoder = decoders.Fuse()  # join pieces with no separator
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
    )
