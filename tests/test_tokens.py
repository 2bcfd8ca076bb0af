"""Byte pieces shown as bytes: a token that holds part of a UTF-8 character reads <E1><BB>, never the byte-level
alias "á»" (which looks like a Vietnamese letter and is not one); the character shows where the pieces join."""

import json

from test_smollm2 import needs_model, smollm2  # noqa: F401  (the module's fixture)

from model.engine.tokenizer import BYTE_LEVEL, joined_characters, raw_token_bytes, readable_token, shown_bytes
from model.tools.cli import main


def test_the_byte_level_alphabet_is_gpt2s():
    assert len(BYTE_LEVEL) == 256 and sorted(BYTE_LEVEL.values()) == list(range(256))
    assert BYTE_LEVEL["Ġ"] == 0x20 and BYTE_LEVEL["A"] == 0x41 and BYTE_LEVEL["á"] == 0xE1 and BYTE_LEVEL["»"] == 0xBB


def test_shown_bytes_keeps_whole_characters_and_writes_the_cut_ones_as_bytes():
    assert shown_bytes("ủ".encode()) == "ủ"
    assert shown_bytes("ủ".encode()[:2]) == "<E1><BB>"
    assert shown_bytes(b" \xc4") == " <C4>"
    assert readable_token("á»", "\ufffd") == "<E1><BB>"     # SmolLM2's piece of "ủ"
    assert readable_token("<0xE1>", "\ufffd") == "<E1>"     # a SentencePiece byte token
    assert readable_token("Ġthe", " the") == " the"
    assert raw_token_bytes("á»", "\ufffd") == b"\xe1\xbb"


@needs_model
def test_smollm2_cuts_vietnamese_letters_into_byte_pieces_that_join_back(smollm2, capsys):  # noqa: F811
    tok = smollm2.tokenizer
    ids = tok.encode("Thủ đô").ids
    shown = [tok.token(i) for i in ids]
    assert shown == ["Th", "<E1><BB>", "<A7>", " <C4>", "<91>", "ô"]
    assert "á»" not in "".join(shown)
    assert joined_characters(tok, ids) == [None, "ủ", "ủ", " đ", " đ", None]
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == "Thủ đô"
    assert main(["trace", "--model", "smollm2", "--prompt", "Thủ đô", "--max-new-tokens", "1", "--json"]) == 0
    prompt = json.loads(capsys.readouterr().out)["prompt"]
    assert prompt["tokens"][1:3] == ["<E1><BB>", "<A7>"] and prompt["bytes"][1:3] == ["e1 bb", "a7"]
