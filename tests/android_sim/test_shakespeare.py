"""Tiny Shakespeare as NWP data: words, roles, vocabulary, OOV buckets, windows, splits, checksum."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from android_sim.shakespeare import (
    BOS,
    EOS,
    PAD,
    Role,
    ShakespeareDataError,
    Vocabulary,
    next_word_data,
    oov_bucket,
    parse_roles,
    read_roles,
    role_examples,
    sentences,
    split_roles,
    time_split,
)

PLAY = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?
'Tis known--we'll not carry coals, serving-men!
"""


def roles_of(*counts: int, word: str = "w") -> list[Role]:
    """Roles whose sentences are one repeated word, `count` one-word sentences each."""
    return [Role(f"role {i}", ((f"{word}{i}",),) * n) for i, n in enumerate(counts)]


def write_data(folder: Path, text: str, checksum_of: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "input.txt").write_text(text)
    digest = hashlib.sha256((checksum_of if checksum_of is not None else text).encode()).hexdigest()
    (folder / "SHA256SUMS").write_text(f"{digest}  input.txt\n")
    return folder


def test_words_are_lower_case_with_inner_apostrophes_and_hyphens_and_no_punctuation() -> None:
    said = sentences("Is't a verdict? 'Tis known--we'll not carry coals, serving-men! Away.")

    assert said == [
        ("is't", "a", "verdict"),
        ("tis", "known", "we'll", "not", "carry", "coals", "serving-men"),
        ("away",),
    ]


def test_roles_gather_their_speeches_in_order_of_first_appearance(tmp_path: Path) -> None:
    roles = read_roles(write_data(tmp_path, PLAY))

    assert [r.name for r in roles] == ["First Citizen", "All"]
    assert roles[0].sentences == (
        ("before", "we", "proceed", "any", "further", "hear", "me", "speak"),
        ("you", "are", "all", "resolved", "rather", "to", "die", "than", "to", "famish"),
        ("tis", "known", "we'll", "not", "carry", "coals", "serving-men"),
    )
    assert roles[1].sentences == (("speak", "speak"),)


def test_the_real_file_passes_its_checksum_and_has_its_speakers(tiny_shakespeare: Path) -> None:
    roles = read_roles(tiny_shakespeare)

    assert len(roles) == 309
    assert roles[0].name == "First Citizen"
    assert sum(len(r.sentences) >= 10 for r in roles) > 100


def test_an_altered_file_is_refused_by_its_checksum(tmp_path: Path) -> None:
    folder = write_data(tmp_path, PLAY.replace("famish", "starve"), checksum_of=PLAY)

    with pytest.raises(ShakespeareDataError, match=r"sha256 .*SHA256SUMS says .*altered or truncated"):
        read_roles(folder)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"input.txt": PLAY}, r"SHA256SUMS not found"),
        ({"input.txt": PLAY, "SHA256SUMS": "0" * 64 + "  other.txt\n"}, r"has no line for input\.txt"),
    ],
)
def test_missing_checksums_are_refused(tmp_path: Path, files: dict[str, str], message: str) -> None:
    for name, content in files.items():
        (tmp_path / name).write_text(content)

    with pytest.raises(ShakespeareDataError, match=message):
        read_roles(tmp_path)


def test_a_speech_without_a_speaker_line_is_refused_with_its_line() -> None:
    with pytest.raises(ShakespeareDataError, match=r"play:7: expected a speaker line ending in ':'"):
        parse_roles("ROMEO:\nWhat light.\n\nJULIET:\nAy me.\n\nno speaker here\n", "play")


def test_oov_buckets_are_crc32_so_every_process_agrees() -> None:
    # 0xCBF43926 is CRC-32's published check value for "123456789"; Python's hash() is salted.
    assert oov_bucket("123456789", 2**32) == 0xCBF43926
    assert oov_bucket("123456789", 1000) == 0xCBF43926 % 1000


def test_token_ids_put_specials_first_then_words_then_oov_buckets() -> None:
    vocabulary = Vocabulary(("the", "and"), num_oov_buckets=4)

    ids = vocabulary.encode(["and", "the", "zounds", "zounds"])

    assert vocabulary.num_global_tokens == 5 and vocabulary.num_tokens == 9
    assert ids[:2] == [4, 3]
    assert ids[2] == ids[3] == 5 + oov_bucket("zounds", 4)
    assert vocabulary.is_oov(np.asarray(ids)).tolist() == [False, False, True, True]


def test_vocabulary_counts_training_roles_only_and_breaks_ties_alphabetically() -> None:
    held_out_word = "w99"
    train = [Role("a", (("b", "a", "c"), ("c", "b"))), Role("b", (("c",),))]

    vocabulary = Vocabulary.build(train, size=2, num_oov_buckets=1)

    assert vocabulary.words == ("c", "b")
    assert vocabulary.token_id(held_out_word) == vocabulary.num_global_tokens


def test_data_set_vocabulary_never_holds_a_held_out_only_word() -> None:
    roles = roles_of(*[12] * 20)

    data = next_word_data(roles, vocab_size=1000, num_oov_buckets=3, seq_len=4, min_examples=10)

    train_words = {s[0] for r in data.roles.train for s in r.sentences}
    assert set(data.vocabulary.words) == train_words
    for examples in data.test:
        words = examples["targets"][examples["targets"] > EOS]
        assert data.vocabulary.is_oov(words).all()


def test_windows_predict_every_word_and_the_end_once_with_padding() -> None:
    vocabulary = Vocabulary(tuple("abcdefg"), num_oov_buckets=1)
    role = Role("r", (tuple("abcdefg"), ("z",)))

    examples = role_examples(role, vocabulary, seq_len=3)

    a, g, oov = vocabulary.encode(["a", "g", "z"])
    assert examples["tokens"].dtype == examples["targets"].dtype == np.int32
    assert examples["tokens"].tolist() == [
        [BOS, a, a + 1],
        [a + 2, a + 3, a + 4],
        [a + 5, g, PAD],
        [BOS, oov, PAD],
    ]
    assert examples["targets"].tolist() == [
        [a, a + 1, a + 2],
        [a + 3, a + 4, a + 5],
        [g, EOS, PAD],
        [oov, EOS, PAD],
    ]
    assert role.num_examples(3) == len(examples["tokens"])


def test_roles_with_too_few_examples_are_left_out() -> None:
    roles = roles_of(*[10] * 10, 9, 3)

    data = next_word_data(roles, vocab_size=100, num_oov_buckets=1, seq_len=2, min_examples=10)

    kept = [*data.roles.train, *data.roles.validation, *data.roles.test]
    assert sorted(r.name for r in kept) == sorted(r.name for r in roles[:10])
    assert min(len(e["tokens"]) for e in [*data.train, *data.validation, *data.test]) == 10


def test_too_few_roles_for_a_held_out_split_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"5 roles have at least 5 examples .* lower min_examples"):
        next_word_data(roles_of(*[5] * 5, 4), vocab_size=10, num_oov_buckets=1, seq_len=2, min_examples=5)


def test_role_split_is_a_deterministic_80_10_10_partition() -> None:
    roles = roles_of(*range(1, 41))

    first, again, other = split_roles(roles, seed=42), split_roles(roles, seed=42), split_roles(roles, seed=7)

    assert (len(first.train), len(first.validation), len(first.test)) == (32, 4, 4)
    assert first == again
    assert first != other
    names = [r.name for r in (*first.train, *first.validation, *first.test)]
    assert sorted(names) == sorted(r.name for r in roles)


def test_time_split_gives_the_oldest_examples_to_reconstruction() -> None:
    examples = {"tokens": np.arange(10).reshape(5, 2), "targets": np.arange(10, 20).reshape(5, 2)}

    support, query = time_split(examples, support_fraction=0.4)
    one_support, one_query = time_split({k: v[:2] for k, v in examples.items()}, 0.9)

    assert support["tokens"].tolist() == [[0, 1], [2, 3]]
    assert query["targets"].tolist() == [[14, 15], [16, 17], [18, 19]]
    assert len(one_support["tokens"]) == len(one_query["tokens"]) == 1
