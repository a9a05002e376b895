"""Tiny Shakespeare as per-role devices for next-word prediction (NWP) with local OOV buckets.

Each speaking role is a device, as in the LEAF benchmark. The file (char-rnn's `input.txt`) has
speeches as a speaker line ending in ':' and the speech, separated by blank lines, but no play
titles: a role is therefore a speaker *name* over the whole file, and a name used in several
plays (`First Citizen`, `Servant`, `ANTONIO`) is one device. Only two play boundaries are marked
(a double blank line), too few to split names by play.

Text to words: lower-case; a speech's lines are joined and cut into sentences at `.`, `?` and
`!`; a word is a run of letters with inner apostrophes or hyphens kept (`we'll`, `know't`,
`serving-men`), so `--` dashes, quotes and all other punctuation separate words and are
dropped. `'tis` becomes `tis`.

Token ids: `PAD` 0, `BOS` 1, `EOS` 2, then the vocabulary's words, most frequent first, then
the OOV buckets. The first `num_global_tokens` ids are rows of the global tables; the last
`num_oov_buckets` ids are rows of the OOV tables, which FedRecon keeps local. The vocabulary
counts words of the *training* roles only, so held-out roles meet words it never saw.

Examples (per-token next-word prediction, as TFF's Stack Overflow NWP task): each sentence
becomes `[BOS] words [EOS]`, cut into windows of `seq_len` inputs whose targets are the next
token; windows overlap by one token so that every word and each `EOS` is a target exactly
once, and the last window is padded. A per-token mask is needed (sentences end mid-window),
but it is `targets != PAD`, so the examples carry no separate mask; a padded example (all
`PAD`) counts for nothing in a masked loss, so a static batch can be padded with them.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from android_sim.datasets import folder_of, missing_hint
from android_sim.movielens import DataFormatError
from contracts.command_line import CommandParser

DEFAULT_FOLDER = folder_of("tinyshakespeare")
TEXT_FILE = "input.txt"
CHECKSUM_FILE = "SHA256SUMS"

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
SPLIT_SEED = 42

# A role's examples, column-wise: feature name -> array with one row per example.
Examples = dict[str, np.ndarray]

_SENTENCE_END = re.compile(r"[.?!]+")
_WORD = re.compile(r"[a-z]+(?:['-][a-z]+)*")


class ShakespeareDataError(DataFormatError):
    """Tiny Shakespeare missing, altered (checksum) or not in the speaker/speech format."""


@dataclass(frozen=True)
class Role:
    """One speaking role: its sentences, each a tuple of words, in the order they are spoken."""

    name: str
    sentences: tuple[tuple[str, ...], ...]

    def num_examples(self, seq_len: int) -> int:
        """Windows of `seq_len` targets its sentences make (each sentence: words + EOS)."""
        return sum(-(-(len(s) + 1) // seq_len) for s in self.sentences)


def sentences(speech: str) -> list[tuple[str, ...]]:
    """The words of each sentence of a speech; sentences without a word are dropped."""
    out = []
    for piece in _SENTENCE_END.split(speech.lower()):
        words = _WORD.findall(piece)
        if words:
            out.append(tuple(words))
    return out


def verify_checksum(folder: Path) -> None:
    """Refuse a text file that is not the one `SHA256SUMS` names (truncated, edited, other)."""
    text_path, sums_path = folder / TEXT_FILE, folder / CHECKSUM_FILE
    for path in (text_path, sums_path):
        if not path.is_file():
            raise ShakespeareDataError(
                f"{path} not found; expected Tiny Shakespeare ({TEXT_FILE} and {CHECKSUM_FILE}) in {folder}"
                + missing_hint(text_path)
            )
    expected = None
    for line in sums_path.read_text(encoding="ascii", errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == TEXT_FILE:
            expected = parts[0].lower()
    if expected is None:
        raise ShakespeareDataError(
            f"{sums_path} has no line for {TEXT_FILE}; expected '<sha256>  {TEXT_FILE}'"
        )
    actual = hashlib.sha256(text_path.read_bytes()).hexdigest()
    if actual != expected:
        raise ShakespeareDataError(
            f"{text_path} has sha256 {actual[:12]}..., {CHECKSUM_FILE} says {expected[:12]}...: "
            "the file is altered or truncated; restore the original (sha256sum -c SHA256SUMS)"
        )


def parse_roles(text: str, source: str = TEXT_FILE) -> list[Role]:
    """Roles in order of first appearance, from speeches separated by blank lines."""
    said: dict[str, list[tuple[str, ...]]] = {}
    speaker: str | None = None
    speech: list[str] = []

    def end_speech() -> None:
        if speaker is not None:
            said.setdefault(speaker, []).extend(sentences(" ".join(speech)))

    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            end_speech()
            speaker, speech = None, []
        elif speaker is None:
            name = line.strip()
            if not name.endswith(":") or len(name) == 1:
                raise ShakespeareDataError(
                    f"{source}:{number}: expected a speaker line ending in ':' (e.g. 'First Citizen:') "
                    f"after a blank line, got {name[:60]!r}"
                )
            speaker = name[:-1]
        else:
            speech.append(line)
    end_speech()
    if not said:
        raise ShakespeareDataError(
            f"{source}: no speeches; expected 'SPEAKER:' lines, each followed by a speech"
        )
    return [Role(name, tuple(sentences_)) for name, sentences_ in said.items()]


def read_roles(folder: Path = DEFAULT_FOLDER) -> list[Role]:
    """Check the file against its checksum, then parse it into roles."""
    folder = Path(folder)
    verify_checksum(folder)
    return parse_roles((folder / TEXT_FILE).read_text(encoding="utf-8"), str(folder / TEXT_FILE))


def oov_bucket(word: str, num_oov_buckets: int) -> int:
    """A stable bucket (CRC-32, the same in every process, unlike Python's salted `hash`)."""
    return zlib.crc32(word.encode("utf-8")) % num_oov_buckets


@dataclass(frozen=True)
class Vocabulary:
    """The global words (most frequent first) and the number of OOV hash buckets."""

    words: tuple[str, ...]
    num_oov_buckets: int
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_oov_buckets < 1:
            raise ValueError(f"num_oov_buckets is {self.num_oov_buckets}; expected at least 1")
        if len(set(self.words)) != len(self.words):
            raise ValueError("vocabulary words must be distinct")
        object.__setattr__(self, "_ids", {w: NUM_SPECIAL + i for i, w in enumerate(self.words)})

    @classmethod
    def build(cls, roles: Iterable[Role], size: int, num_oov_buckets: int) -> Vocabulary:
        """The `size` most frequent words of `roles`; ties broken alphabetically, so it is deterministic."""
        if size < 1:
            raise ValueError(f"vocabulary size is {size}; expected at least 1")
        counts = Counter(w for role in roles for s in role.sentences for w in s)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls(tuple(w for w, _ in ranked[:size]), num_oov_buckets)

    @property
    def num_global_tokens(self) -> int:
        """Rows of the global tables: PAD, BOS, EOS and the words."""
        return NUM_SPECIAL + len(self.words)

    @property
    def num_tokens(self) -> int:
        """All ids: the global tokens, then the OOV buckets."""
        return self.num_global_tokens + self.num_oov_buckets

    def token_id(self, word: str) -> int:
        found = self._ids.get(word)
        if found is not None:
            return found
        return self.num_global_tokens + oov_bucket(word, self.num_oov_buckets)

    def encode(self, words: Sequence[str]) -> list[int]:
        return [self.token_id(w) for w in words]

    def is_oov(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids) >= self.num_global_tokens

    def oov_rate(self, roles: Iterable[Role]) -> float:
        """Share of the roles' words outside the vocabulary."""
        total = oov = 0
        for role in roles:
            for s in role.sentences:
                total += len(s)
                oov += sum(w not in self._ids for w in s)
        return oov / total if total else 0.0


def role_examples(role: Role, vocabulary: Vocabulary, seq_len: int) -> Examples:
    """`tokens` and `targets`, int32 [n, seq_len], oldest first; see the module docstring."""
    if seq_len < 1:
        raise ValueError(f"seq_len is {seq_len}; expected at least 1")
    tokens: list[list[int]] = []
    targets: list[list[int]] = []
    for s in role.sentences:
        stream = [BOS, *vocabulary.encode(s), EOS]
        for start in range(0, len(stream) - 1, seq_len):
            window = stream[start : start + seq_len + 1]
            pad = [PAD] * (seq_len + 1 - len(window))
            tokens.append(window[:-1] + pad)
            targets.append(window[1:] + pad)
    shape = (len(tokens), seq_len)
    return {
        "tokens": np.asarray(tokens, np.int32).reshape(shape),
        "targets": np.asarray(targets, np.int32).reshape(shape),
    }


def time_split(
    examples: Mapping[str, np.ndarray], support_fraction: float = 0.5
) -> tuple[Examples, Examples]:
    """(support, query) by time: the oldest share for reconstruction, the rest to train or score.

    Both are non-empty when there are two or more examples.
    """
    if not 0.0 < support_fraction < 1.0:
        raise ValueError(f"support_fraction is {support_fraction}; expected a number in (0, 1)")
    n = len(next(iter(examples.values())))
    cut = min(max(1, round(n * support_fraction)), n - 1) if n > 1 else n
    return {k: v[:cut] for k, v in examples.items()}, {k: v[cut:] for k, v in examples.items()}


@dataclass(frozen=True)
class RoleSplit:
    train: list[Role]
    validation: list[Role]
    test: list[Role]


def split_roles(roles: Sequence[Role], seed: int = SPLIT_SEED) -> RoleSplit:
    """80/10/10 train/validation/test roles, shuffled with `seed`: the MovieLens protocol's cut."""
    order = np.random.RandomState(seed).permutation(len(roles)).tolist()
    train_end, validation_end = int(len(roles) * 0.8), int(len(roles) * 0.9)
    pick = [roles[i] for i in order]
    return RoleSplit(pick[:train_end], pick[train_end:validation_end], pick[validation_end:])


@dataclass(frozen=True)
class NextWordData:
    """The federated NWP data set: one `Examples` per role of each split, and the vocabulary."""

    vocabulary: Vocabulary
    seq_len: int
    roles: RoleSplit
    train: list[Examples]
    validation: list[Examples]
    test: list[Examples]


def next_word_data(
    roles: Sequence[Role],
    vocab_size: int,
    num_oov_buckets: int,
    seq_len: int = 20,
    min_examples: int = 10,
    seed: int = SPLIT_SEED,
) -> NextWordData:
    """Roles with at least `min_examples` examples, split, the vocabulary of the training roles."""
    eligible = [r for r in roles if r.num_examples(seq_len) >= min_examples]
    split = split_roles(eligible, seed)
    if not split.validation or not split.test:
        raise ValueError(
            f"{len(eligible)} roles have at least {min_examples} examples of {seq_len} tokens; "
            "too few for one validation and one test role at least (80/10/10): lower min_examples"
        )
    vocabulary = Vocabulary.build(split.train, vocab_size, num_oov_buckets)

    def encode(part: list[Role]) -> list[Examples]:
        return [role_examples(r, vocabulary, seq_len) for r in part]

    return NextWordData(
        vocabulary, seq_len, split, encode(split.train), encode(split.validation), encode(split.test)
    )


def statistics(folder: Path, seq_len: int, min_examples: int, vocab_sizes: Sequence[int]) -> list[str]:
    """Lines that describe the data set as `next_word_data` prepares it."""
    roles = read_roles(folder)
    data = next_word_data(roles, vocab_sizes[0], 1, seq_len, min_examples)
    words = [w for r in roles for s in r.sentences for w in s]
    num_eligible = len(data.train) + len(data.validation) + len(data.test)
    lines = [
        f"{len(roles)} roles, {sum(len(r.sentences) for r in roles)} sentences, {len(words)} words, "
        f"{len(set(words))} distinct words",
        f"{num_eligible} roles with at least {min_examples} examples of {seq_len} tokens: "
        f"{len(data.train)} train, {len(data.validation)} validation, {len(data.test)} test",
    ]
    for name, part in (("train", data.train), ("validation", data.validation), ("test", data.test)):
        counts = [len(e["tokens"]) for e in part]
        targets = [int((e["targets"] != PAD).sum()) for e in part]
        lines.append(
            f"  {name}: examples per role median {np.median(counts):.0f} (min {min(counts)}, "
            f"max {max(counts)}, total {sum(counts)}); targets per role median {np.median(targets):.0f}"
        )
    held_out = [*data.roles.validation, *data.roles.test]
    for size in vocab_sizes:
        vocabulary = Vocabulary.build(data.roles.train, size, 1)
        lines.append(
            f"  V={size} ({len(vocabulary.words)} words): OOV rate of words "
            f"{vocabulary.oov_rate(data.roles.train):.2%} on training roles, "
            f"{vocabulary.oov_rate(held_out):.2%} on held-out roles"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m android_sim.shakespeare",
        description="Statistics of Tiny Shakespeare as per-role next-word prediction data.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_FOLDER, help="folder with input.txt, SHA256SUMS")
    parser.add_argument("--seq-len", type=int, default=20)
    parser.add_argument("--min-examples", type=int, default=10)
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[1000, 5000, 10000])
    args = parser.parse_args(argv)
    try:
        for line in statistics(args.data, args.seq_len, args.min_examples, args.vocab_sizes):
            print(line)
    except (DataFormatError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
