"""Tests for services/gateway/text.py: incremental UTF-8 decoding and exact stop sequences in TextAssembler."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.gateway.text import TextAssembler

REPLACEMENT = "\ufffd"


def run(pieces: Sequence[bytes], stop: Sequence[str] = ()) -> tuple[list[str], str, bool]:
    """Feed pieces one by one, taking after each; return the chunks taken, everything taken, and whether it stopped."""
    assembler = TextAssembler(stop)
    chunks = []
    for piece in pieces:
        assembler.feed(piece)
        chunks.append(assembler.take())
    assembler.finish()
    chunks.append(assembler.take(final=True))
    return chunks, "".join(chunks), assembler.stopped


# --- UTF-8 ------------------------------------------------------------------------------------------------------


def test_two_byte_character_split_across_pieces() -> None:
    assert "é".encode() == b"\xc3\xa9"
    assembler = TextAssembler()
    assembler.feed(b"caf\xc3")
    assert assembler.take() == "caf"  # the lone lead byte is held by the decoder, not replaced
    assembler.feed(b"\xa9!")
    assert assembler.take() == "é!"
    assembler.finish()
    assert assembler.take(final=True) == ""
    assert assembler.text == "café!"


def test_multibyte_characters_fed_one_byte_at_a_time() -> None:
    text = "日本é😀"
    pieces = [bytes([b]) for b in text.encode()]
    chunks, out, stopped = run(pieces)
    assert out == text
    assert not stopped
    assert all(REPLACEMENT not in chunk for chunk in chunks)


def test_finish_flushes_a_dangling_partial_character_as_replacement() -> None:
    assembler = TextAssembler()
    assembler.feed(b"a\xe6\x97")  # first two bytes of a three-byte character
    assert assembler.take() == "a"
    assembler.finish()
    assert assembler.take(final=True) == REPLACEMENT


def test_invalid_byte_becomes_replacement_and_decoding_continues() -> None:
    _, out, _ = run([b"a\xc3", b"b"])  # lead byte followed by an ASCII byte: invalid sequence
    assert out == f"a{REPLACEMENT}b"


# --- stop sequences ---------------------------------------------------------------------------------------------


def test_no_stop_list_passes_everything_through_immediately() -> None:
    assembler = TextAssembler()
    assembler.feed(b"hello <")
    assert assembler.take() == "hello <"
    assert not assembler.stopped


def test_empty_stop_strings_are_ignored() -> None:
    assembler = TextAssembler(["", ""])
    assert assembler.stop == []
    assembler.feed(b"abc")
    assert assembler.take() == "abc"
    assert not assembler.stopped


def test_stop_inside_one_piece_cuts_exactly() -> None:
    assembler = TextAssembler(["STOP"])
    assembler.feed(b"before STOP after")
    assert assembler.stopped
    assert assembler.text == "before "
    assert assembler.take() == "before "
    assert assembler.take(final=True) == ""


def test_stop_at_very_start() -> None:
    chunks, out, stopped = run([b"</s>tail"], ["</s>"])
    assert stopped
    assert out == ""
    assert chunks == ["", ""]


def test_stop_spanning_several_pieces_cuts_exactly_and_never_shows_its_start() -> None:
    chunks, out, stopped = run([b"abc<", b"|en", b"d|", b">tail"], ["<|end|>"])
    assert stopped
    assert out == "abc"
    assert chunks == ["abc", "", "", "", ""]


def test_stop_spanning_a_split_multibyte_character() -> None:
    chunks, out, stopped = run([b"caf\xc3", b"\xa9 au lait"], ["é"])
    assert stopped
    assert out == "caf"
    assert REPLACEMENT not in "".join(chunks)


def test_prefix_of_stop_is_held_back_until_final() -> None:
    assembler = TextAssembler(["Hello"])
    assembler.feed(b"say Hel")
    assert assembler.take() == "say "  # "Hel" could still become "Hello"
    assembler.finish()  # generation ends without the stop
    assert not assembler.stopped
    assert assembler.take() == ""  # still held when not final
    assert assembler.take(final=True) == "Hel"


def test_held_back_prefix_is_released_when_it_diverges() -> None:
    assembler = TextAssembler(["</s>"])
    assembler.feed(b"a<")
    assert assembler.take() == "a"
    assembler.feed(b"/")
    assert assembler.take() == ""
    assembler.feed(b"x")
    assert assembler.take() == "</x"
    assert not assembler.stopped


def test_held_back_uses_the_longest_prefix_over_all_stops() -> None:
    assembler = TextAssembler(["END", "xSTOP"])
    assembler.feed(b"aaxST")
    assert assembler.take() == "aa"  # "xST" is a prefix of "xSTOP"; "T" alone is no prefix of "END"


def test_earliest_occurrence_wins_among_several_stops() -> None:
    # "lo" is listed second but occurs first.
    _, out, stopped = run([b"hello world"], ["world", "lo"])
    assert stopped
    assert out == "hel"


def test_earliest_occurrence_wins_across_pieces() -> None:
    _, out, stopped = run([b"xx A", b"B yy"], ["yy", "AB"])
    assert stopped
    assert out == "xx "


@pytest.mark.parametrize("final", [False, True])
def test_feed_and_finish_are_ignored_after_stop(final: bool) -> None:
    assembler = TextAssembler(["."])
    assembler.feed(b"one. two")
    assert assembler.stopped
    assert assembler.take(final=final) == "one"
    assembler.feed(b" three.")
    assembler.feed(b"\xc3")
    assembler.finish()
    assert assembler.text == "one"
    assert assembler.take(final=True) == ""


def test_take_never_repeats_text() -> None:
    pieces = [b"The ", b"quick ", b"brown", b" fox"]
    chunks, out, stopped = run(pieces, ["jumps"])
    assert not stopped
    assert out == "The quick brown fox"
    assert chunks == ["The ", "quick ", "brown", " fox", ""]
