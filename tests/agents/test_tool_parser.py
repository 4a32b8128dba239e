"""The hermes tool-call parser on hand-written turns, read as verl 0.9.1's HermesToolParser reads them."""

import pytest

from plait.agents.tool_parser import SUPPORTED_FORMATS, FunctionCall, count_call_blocks, parse_tool_calls


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


def test_hermes_and_gpt_oss_are_supported():
    assert SUPPORTED_FORMATS == ("hermes", "gpt-oss")
    with pytest.raises(ValueError, match="qwen3_coder"):
        parse_tool_calls("x", "qwen3_coder")


# -- gpt-oss (harmony), as verl 0.9.1's GptOssToolParser reads it ---------------------------------

HARMONY_CALL = ('<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>'
                '{"a": 2,"b":3}<|call|>')


def test_gpt_oss_call_keeps_its_arguments_as_written_and_the_rest_is_content():
    text = "<|channel|>final<|message|>let me add<|end|>" + HARMONY_CALL
    content, calls = parse_tool_calls(text, "gpt-oss")
    assert calls == [FunctionCall("add", '{"a": 2,"b":3}')]
    assert content == "<|channel|>final<|message|>let me add<|end|>"
    assert count_call_blocks(text, "gpt-oss") == 1


def test_gpt_oss_reasoning_is_removed_and_its_calls_are_not_calls():
    cot = ("<|channel|>analysis<|message|>maybe to=functions.sub <|constrain|>json<|message|>{}<|call|> no<|end|>"
           "<|start|>assistant<|channel|>analysis<|message|>more<|end|>")
    content, calls = parse_tool_calls(cot + HARMONY_CALL + HARMONY_CALL.replace("add", "mul"), "gpt-oss")
    assert [c.name for c in calls] == ["add", "mul"] and content == ""
    assert count_call_blocks(cot, "gpt-oss") == 0


def test_gpt_oss_without_calls_is_the_text_less_its_reasoning_and_a_headless_call_is_no_call():
    text = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>5<|return|>"
    assert parse_tool_calls(text, "gpt-oss") == ("<|start|>assistant<|channel|>final<|message|>5<|return|>", [])
    headless = HARMONY_CALL.removeprefix("<|start|>assistant")  # as verl: a call needs its own head
    assert parse_tool_calls(headless, "gpt-oss") == (headless, [])
    assert count_call_blocks(headless, "gpt-oss") == 1  # written, not parsed: counts against the valid-call rate
