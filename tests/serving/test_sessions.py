"""Sessions keep what the engine sampled, token for token: an agent that appends extends one chain, one that
rewrites its history starts another, and nothing is re-tokenised from text."""

import string

import openai
import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from conftest import CALL, CHATML, served
from plait.agents.tokens import ContinuousTokens

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def chat(url, session, messages, **kwargs):
    client = openai.OpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="x")
    return client.chat.completions.create(model="tiny", messages=messages, **kwargs).choices[0]


def test_an_agent_that_appends_is_one_chain_laid_out_as_the_tool_loop_lays_it(tokenizer):
    with served(tokenizer, plain=False) as (gateway, url, _, queue):
        session = gateway.open("row 0", queue.generate, {"temperature": 1.0}, 256, 200)
        messages = [{"role": "user", "content": "what is 2+3?"}]
        first = chat(url, session, messages, tools=TOOLS)
        messages += [first.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.message.tool_calls[0].id, "content": "5"}]
        assert chat(url, session, messages, tools=TOOLS).message.content == "#### 5"
    [t] = session.trajectories()
    ct = ContinuousTokens(tokenizer, "qwen2")
    prompt = ct.render(messages[:1], True, TOOLS)
    tool = ct.delta(messages[2:], TOOLS)
    turn1 = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    turn2 = tokenizer.encode("#### 5", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert t.ids == prompt + turn1 + tool + turn2
    assert t.mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert t.logprobs == [-0.5] * len(turn1) + [0.0] * len(tool) + [-0.5] * len(turn2)


def test_a_rewritten_history_starts_a_new_chain_and_neither_drifts(tokenizer):
    """An agent that compacts its context after the tool answer: the second call is a chain of its own whose
    prompt is the rewritten conversation rendered afresh; the first chain keeps its sampled turn."""
    with served(tokenizer, plain=False) as (gateway, url, _, queue):
        session = gateway.open("row 0", queue.generate, {"temperature": 1.0}, 256, 200)
        messages = [{"role": "user", "content": "what is 2+3?"}]
        first = chat(url, session, messages, tools=TOOLS)
        compacted = [{"role": "system", "content": "summary: add(2, 3) returned 5"}, messages[0]]
        chat(url, session, compacted, tools=TOOLS)  # the scripted model calls again: it saw no tool message
    chains = session.trajectories()
    assert len(chains) == 2
    ct = ContinuousTokens(tokenizer, "qwen2")
    call = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert chains[0].ids == ct.render(messages, True, TOOLS) + call and chains[0].mask == [1] * len(call)
    assert chains[1].ids == ct.render(compacted, True, TOOLS) + call and chains[1].mask == [1] * len(call)
    assert first.message.tool_calls[0].function.name == "add"


def test_branches_train_a_shared_turn_once(tokenizer):
    """n=2 on the second call forks the conversation: two leaves; the first call's turn, in both, is trained in
    the first leaf only (attended, mask 0, in the other)."""
    with served(tokenizer, plain=False) as (gateway, url, _, queue):
        session = gateway.open("row 0", queue.generate, {"temperature": 1.0}, 256, 200)
        messages = [{"role": "user", "content": "what is 2+3?"}]
        first = chat(url, session, messages, tools=TOOLS)
        messages += [first.message.model_dump(exclude_none=True), {"role": "tool", "content": "5"}]
        client = openai.OpenAI(base_url=f"{url}/sessions/{session.id}/v1", api_key="x")
        assert len(client.chat.completions.create(model="t", messages=messages, tools=TOOLS, n=2).choices) == 2
    a, b = session.trajectories()
    turn1 = len(CALL) + 1
    assert a.ids == b.ids and sum(a.mask[:turn1]) == turn1 and sum(b.mask[:turn1]) == 0
    assert sum(a.mask[turn1:]) == sum(b.mask[turn1:]) == len("#### 5") + 1


def test_a_chain_out_of_budget_is_answered_cut_without_sampling(tokenizer):
    with served(tokenizer, plain=False) as (gateway, url, engine, queue):
        session = gateway.open("row 0", queue.generate, {"temperature": 1.0}, 256, len(CALL) + 3)
        messages = [{"role": "user", "content": "what is 2+3?"}]
        first = chat(url, session, messages, tools=TOOLS)
        messages += [first.message.model_dump(exclude_none=True), {"role": "tool", "content": "5"}]
        asked = len(engine.prompts)
        second = chat(url, session, messages, tools=TOOLS)
        assert second.finish_reason == "length" and second.message.content == "" and len(engine.prompts) == asked


def test_training_samples_with_the_rollouts_settings(tokenizer, capsys):
    with served(tokenizer, plain=False) as (gateway, url, _, queue):
        seen = []

        async def generate(**kwargs):
            seen.append(kwargs["sampling_params"])
            return await queue.generate(**kwargs)
        session = gateway.open("row 3", generate, {"temperature": 0.7, "top_p": 1.0, "top_k": -1}, 256, 200)
        chat(url, session, [{"role": "user", "content": "hi"}], temperature=0.1)
    assert seen[0]["temperature"] == 0.7 and session.overridden == {"temperature"}
    assert "asked for temperature=0.1 (row 3)" in capsys.readouterr().err


def test_a_prompt_too_long_for_a_new_chain_is_a_context_length_error(tokenizer):
    with served(tokenizer, plain=False) as (gateway, url, _, queue):
        session = gateway.open("row 0", queue.generate, {}, 10, 200)
        with pytest.raises(openai.BadRequestError) as err:
            chat(url, session, [{"role": "user", "content": "a long question"}])
    assert err.value.body["code"] == "context_length_exceeded"


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """Printable characters and one merge, "ab": a model may sample "a", "b" where encoding "ab" gives one token."""
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {"<eos>": 0, "<pad>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    vocab["ab"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, merges=[("a", "b")]))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = CHATML
    return tok


def test_the_tokens_kept_are_the_sampled_ones_where_retokenising_differs():
    """The engine samples "a", "b" (two tokens); the agent echoes the text "ab" back. Re-tokenising it would
    give the one token "ab": the session keeps the two sampled ids, with their log-probs."""
    tok = merging_tokenizer()
    a, b, ab = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "ab"))
    sampled = [a, b, tok.eos_token_id]
    with served(tok, plain=False, script=lambda text: sampled) as (gateway, url, _, queue):
        session = gateway.open("row 0", queue.generate, {}, 256, 200)
        messages = [{"role": "user", "content": "hi"}]
        answer = chat(url, session, messages)
        assert answer.message.content == "ab" and tok.encode("ab", add_special_tokens=False) == [ab]
        chat(url, session, messages + [answer.message.model_dump(exclude_none=True), {"role": "user", "content": "and"}])
    [t] = session.trajectories()
    first = t.ids[t.prompt_len:t.prompt_len + 3]
    assert first == sampled and t.mask[:3] == [1, 1, 1]
