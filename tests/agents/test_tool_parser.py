"""The hermes tool-call parser on hand-written turns, read as verl 0.9.1's HermesToolParser reads them."""

import pytest

from plait.agents.tool_parser import SUPPORTED_FORMATS, FunctionCall, parse_tool_calls


def test_no_tags_is_all_content():
    text = "The answer is 42.<|im_end|>"
    assert parse_tool_calls(text) == (text, [])


def test_one_tag_without_the_other_is_content_unchanged():
    text = 'I will call <tool_call>{"name": "calc", "arguments": {"x": 1}}'  # cut off before the closing tag
    assert parse_tool_calls(text) == (text, [])


def test_one_call_and_the_content_around_it():
    text = 'Let me check.\n<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n</tool_call><|im_end|>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check.\n<|im_end|>"
    assert calls == [FunctionCall("calc_gsm8k_reward", '{"answer": "72"}')]


def test_arguments_are_rewritten_as_json_dumps_writes_them():
    text = '<tool_call>{"name":"f","arguments":{"b":[1,2],"a":"é"}}</tool_call>'
    _, calls = parse_tool_calls(text)
    assert calls[0].arguments == '{"b": [1, 2], "a": "é"}'  # spaces added, key order and non-ASCII kept


def test_string_and_null_arguments_stay_json_values():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "g", "arguments": null}</tool_call>'
    _, calls = parse_tool_calls(text)
    assert calls == [FunctionCall("f", '"{\\"x\\": 1}"'), FunctionCall("g", "null")]


def test_several_calls_in_order_and_bad_blocks_skipped_but_removed():
    text = ("a<tool_call>{\"name\": \"one\", \"arguments\": {}}</tool_call>b"
            "<tool_call>{not json}</tool_call>c"
            "<tool_call>{\"name\": \"no_args\"}</tool_call>d"
            "<tool_call>[\"a list\"]</tool_call>e"
            "<tool_call>{\"name\": 5, \"arguments\": {}}</tool_call>f"
            "<tool_call>{\"name\": \"two\", \"arguments\": {\"k\": 2}}</tool_call>g")
    content, calls = parse_tool_calls(text)
    assert content == "abcdefg"
    assert [c.name for c in calls] == ["one", "two"]
    assert calls[1].arguments == '{"k": 2}'


def test_blocks_match_shortest_and_across_lines():
    text = '<tool_call>{"name": "a",\n "arguments": {"s": "x"}}</tool_call> mid <tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == " mid "
    assert [c.name for c in calls] == ["a", "b"]


def test_unclosed_second_block_stays_in_content():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b"'
    content, calls = parse_tool_calls(text)
    assert content == ' then <tool_call>{"name": "b"'
    assert [c.name for c in calls] == ["a"]


def test_closing_tag_before_opening_tag_is_content():
    text = "</tool_call> oops <tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_deeply_nested_json_is_skipped_not_raised():
    text = "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>"
    assert parse_tool_calls(text) == ("", [])


def test_only_hermes_is_supported():
    assert SUPPORTED_FORMATS == ("hermes",)
    with pytest.raises(ValueError, match="gpt-oss"):
        parse_tool_calls("x", "gpt-oss")
