import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vlserve.core.sampling_params import SamplingParams
from vlserve.frontend.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
TEXT = "héllo 世界 🙂 and 🙃 ñandú 日本, hello world STOP here"


@pytest.fixture(scope="module")
def tokenizer():
    # Byte-level BPE with a tiny vocabulary: most non-ASCII characters stay
    # split across several byte tokens, which is what we want to exercise.
    sentences = ["héllo 世界 🙂 hello world", "the quick brown fox", "héllo again, world! 世界"] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def feed(detok, ids, step=1):
    """Feeds ids `step` at a time like a stream does; returns the deltas shown and the stop string hit.

    What a stream shows only ever grows: every visible text extends the one before it."""
    deltas, stop, shown = [], None, ""
    for i in range(0, len(ids), step):
        stop = detok.update(ids[i : i + step])
        if stop is not None:
            detok.finish()
        visible = detok.visible_text
        assert visible.startswith(shown), f"shown {shown!r}, later {visible!r}"
        deltas.append(visible[len(shown):])
        shown = visible
        if stop is not None:
            break
    detok.finish()
    deltas.append(detok.visible_text[len(shown):])
    return deltas, stop


def test_multibyte_chars_are_split_in_this_vocab(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_incremental_matches_full_decode(tokenizer, step):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "), SamplingParams())
    deltas, stop = feed(detok, ids, step)
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids) == TEXT
    assert "".join(deltas) == TEXT
    assert all(REPLACEMENT not in d for d in deltas)


def test_no_replacement_char_ever_in_output_text(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for i in ids:
        detok.update([i])
        assert REPLACEMENT not in detok.output_text
        assert TEXT.startswith(detok.output_text)


@pytest.mark.parametrize("step", [1, 2])
def test_a_character_cut_off_by_the_end_shows_as_replacement_at_finish(tokenizer, step):
    """max_tokens can end the output inside a multi-byte character: the finished text is what decoding every output
    token gives (U+FFFD for the cut character, as transformers' decode and SGLang show it), and the stream's last
    delta carries it, so streamed and whole answers agree."""
    ids = tokenizer.encode(TEXT)
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT))
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "), SamplingParams())
    deltas, _ = feed(detok, ids[:cut], step)
    assert detok.output_text == tokenizer.decode(ids[:cut]) == "".join(deltas)
    assert detok.output_text.endswith(REPLACEMENT) and REPLACEMENT not in "".join(deltas[:-1])


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hello") + [tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    keep = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    for i in ids:
        skip.update([i])
        keep.update([i])
    assert skip.output_text == "hello"
    assert keep.output_text == "hello<eos>"


def test_stop_string_cuts_output(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    deltas, stop = feed(detok, ids)
    assert stop == "STOP" and detok.stop_string == "STOP"
    expected = TEXT[: TEXT.index("STOP")]
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    # Nothing after a stop is ever emitted.
    assert detok.update(tokenizer.encode(" more")) is None
    assert detok.output_text == expected and detok.visible_text == expected


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="STOP", include_stop_str_in_output=True))
    deltas, stop = feed(detok, ids, step=3)
    expected = TEXT[: TEXT.index("STOP") + 4]
    assert stop == "STOP" and detok.output_text == expected == "".join(deltas)


def test_stop_string_spanning_tokens(tokenizer):
    ids = tokenizer.encode(TEXT)
    stop_str = "界 🙂 a"  # spans several tokens, including split multi-byte ones
    start = TEXT.index(stop_str)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["zzz", stop_str]))
    n_fed = 0
    stop = None
    for i in ids:
        n_fed += 1
        stop = detok.update([i])
        if stop:
            break
    assert stop == stop_str
    # It spans tokens: the text before the last token fed holds part of it, not all.
    assert len(tokenizer.decode(ids[: n_fed - 1])) < start + len(stop_str)
    assert len(tokenizer.decode(ids[: n_fed - 1]).rstrip(REPLACEMENT)) > start
    assert detok.output_text == TEXT[:start]


def test_earliest_stop_wins(tokenizer):
    ids = tokenizer.encode("the quick brown fox")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["fox", "quick"]))
    stop = detok.update(ids)  # all at once: both match in the same update
    assert stop == "quick" and detok.output_text == "the "


def test_holdback_hides_only_a_stop_string_prefix(tokenizer):
    text = "hello world, hello wor"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world!", "xyz"]))
    for i in ids:
        assert detok.update([i]) is None
        out = detok.output_text
        held = out[len(detok.visible_text):]
        # Exactly the longest end of the text that starts a stop string is held back.
        assert held == next((out[-k:] for k in range(min(5, len(out)), 0, -1) if "world!".startswith(out[-k:])), "")
    assert detok.visible_text == "hello world, hello " and detok.output_text == text
    detok.finish()
    assert detok.visible_text == text


def test_no_holdback_without_stop_or_with_include(tokenizer):
    ids = tokenizer.encode("hello wor")
    for params in (SamplingParams(), SamplingParams(stop="world", include_stop_str_in_output=True)):
        detok = IncrementalDetokenizer(tokenizer, [], params)
        detok.update(ids)
        assert detok.visible_text == "hello wor"


@pytest.mark.parametrize("step", [1, 2, 5])
@pytest.mark.parametrize("stops", [["world"], ["d h", "llo w"], ["o wo", "xx", "hello world hello world"],
                                   ["界 🙂 a", "🙃 ñ"]])
def test_stream_concatenation_equals_final_text(tokenizer, step, stops):
    """Stop strings that begin inside one token and end in a later one: the stream never shows text the final
    answer does not have."""
    for text in ("hello world hello world", TEXT):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops))
        deltas, _ = feed(detok, tokenizer.encode(text), step)
        assert "".join(deltas) == detok.output_text


def test_stop_strings_ignored_until_min_tokens(tokenizer):
    ids = tokenizer.encode("hello world hello world")
    params = SamplingParams(stop="world", min_tokens=4)
    assert len(tokenizer.encode("hello world")) < 4
    detok = IncrementalDetokenizer(tokenizer, [], params)
    stop = None
    for i in ids:
        stop = detok.update([i])
        if stop:
            break
    assert stop == "world"
    assert detok.output_text == "hello world hello "


def test_incomplete_trailing_char_not_emitted(tokenizer):
    ids = tokenizer.encode("ok 🙃")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids[:-1])  # last byte of the emoji missing
    # The space may share a token with the emoji's first bytes, so "ok" or "ok ".
    assert detok.output_text in ("ok", "ok ")
    detok.update(ids[-1:])
    assert detok.output_text == "ok 🙃"


def _held_by_definition(text: str, stops: list[str]) -> int:
    """The longest end of `text` that begins some stop string (shorter than it), by brute force."""
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)


def test_held_back_text_is_the_longest_end_that_begins_a_stop_string():
    """The bounded search (tail of the longest stop, first-character candidates) agrees with the definition."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab\u00e9") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 4))]
        detok = IncrementalDetokenizer(None, [], SamplingParams(stop=stops))
        detok._text = "".join(rng.choice("ab\u00e9") for _ in range(rng.randint(0, 12)))
        assert detok._stop_prefix_len() == _held_by_definition(detok._text, stops), (detok._text, stops)

