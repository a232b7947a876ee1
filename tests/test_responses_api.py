"""The Responses API (POST/GET/DELETE /v1/responses) through the openai client on a live,
metered server with two keys: a response is the chat completion it translates to, its stream
parses in client.responses.stream, and kept responses continue and stay with their key."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from tollway.config import KeySpec
from tollway.server.keys import Gatekeeper
from tollway.server.responses_output import OutputItems
from tollway.server.responses_translation import input_messages

from live_server import MODEL, make_meter, running_server

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}
ASK = "What is the weather in Paris for the next 3 days?"


def test_function_calls_and_outputs_become_chat_tool_calls_and_tool_messages():
    call = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone":"UTC"}'}
    messages = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "Time?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        call, {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "12:00"}]}])
    assert messages[0] == {"role": "user", "content": "Time?"}
    assert messages[1]["content"] == "Let me look." and [c["id"] for c in messages[1]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone":"UTC"}'}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}
    assert len(messages) == 3


def test_output_items_close_each_item_before_the_next_opens():
    items = OutputItems()
    events = items.add({"content": "Hm"}) + items.add({"content": "."})
    events += items.add({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{"}}]})
    events += items.add({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}) + items.finish("completed")
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["output_index"] for e in events] == [0] * 7 + [1] * 5
    message, call = items.items
    assert message["content"][0]["text"] == "Hm." and message["status"] == "completed"
    assert call == {"id": call["id"], "type": "function_call", "status": "completed", "call_id": "call_1", "name": "f",
                    "arguments": "{}"}
    assert events[0]["item"]["content"] == [] and events[7]["item"]["arguments"] == ""  # as they were when added


def test_output_items_hold_a_tokens_logprobs_until_its_text_comes():
    a, b, c = ({"token": t, "logprob": -1.0, "bytes": [], "top_logprobs": []} for t in "abc")
    items = OutputItems()
    assert items.add({"content": ""}, [a]) == []  # part of a character: no text yet
    added, part_added, delta = items.add({"content": "é"}, [b])
    assert delta["logprobs"] == [a, b] and part_added["part"]["logprobs"] == []
    assert items.add({"content": ""}, [c]) == []
    text_done, part_done, _ = items.finish("completed")
    assert text_done["logprobs"] == part_done["part"]["logprobs"] == [a, b, c]
    assert items.items[0]["content"][0]["logprobs"] == [a, b, c]


@pytest.fixture(scope="module")
def server(make_engine, tmp_path_factory):
    meter = make_meter(tmp_path_factory.mktemp("responses") / "ledger.sqlite")
    keys = Gatekeeper([KeySpec("sk-alice", "alice"), KeySpec("sk-bob", "bob")])
    yield from running_server(make_engine(num_blocks=256), gatekeeper=keys, meter=meter)


@pytest.fixture(scope="module")
def alice(server):
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="sk-alice", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def bob(server):
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="sk-bob", max_retries=0) as client:
        yield client


def _chat_text(client, messages, **params) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **params)
    return reply.choices[0].message.content


def test_a_string_input_is_answered_with_usage_and_cost(alice):
    r = alice.responses.create(model=MODEL, input="Write a short poem about the sea.", max_output_tokens=5,
                               temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].status == "incomplete" and r.output_text
    usage = r.usage
    assert usage.output_tokens == 5 and usage.input_tokens > 5
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.model_extra["cost"] > 0 and usage.model_extra["engine_seconds"] > 0
    assert r.service_tier == "default" and r.store is True
    # the same as the chat completion of that one user message
    assert r.output_text == _chat_text(alice, [{"role": "user", "content": "Write a short poem about the sea."}],
                                       max_completion_tokens=5)


def test_items_and_instructions_are_the_chat_messages_they_stand_for(alice):
    items = [{"role": "user", "content": "Hi, I am Ada."},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "What is my name? "},
                                          {"type": "input_text", "text": "Answer in one word."}]}]
    r = alice.responses.create(model=MODEL, input=items, instructions="You are terse.", max_output_tokens=12,
                               temperature=0)
    assert r.instructions == "You are terse."
    assert r.output_text == _chat_text(alice, [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi, I am Ada."},
        {"role": "assistant", "content": "Hello Ada!"},
        {"role": "user", "content": "What is my name? Answer in one word."}], max_completion_tokens=12)


def test_the_stream_parses_and_ends_with_the_greedy_text(alice):
    whole = alice.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=16, temperature=0)
    with alice.responses.stream(model=MODEL, input="Name three colours.", max_output_tokens=16,
                                temperature=0) as stream:
        events = list(stream)
        # as OpenAI's, a response cut by max_output_tokens ends in response.incomplete, which the
        # client's get_final_response does not take
        final = stream.get_final_response() if whole.status == "completed" else events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text != ""
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id and final.id != whole.id


class City(BaseModel):  # strings: an unbounded integer is one this model writes digits into until cut
    name: str
    country: str


def test_text_format_json_schema_gives_json_of_the_schema(alice):
    question = "Describe the city of Paris as JSON."
    r = alice.responses.parse(model=MODEL, input=question, text_format=City, max_output_tokens=120, temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, City)
    assert r.text.format.type == "json_schema" and r.text.format.name == "City"
    assert json.loads(r.output_text) == r.output_parsed.model_dump()
    anything = alice.responses.create(model=MODEL, input="Give me a JSON object with a name and an age.",
                                      text={"format": {"type": "json_object"}}, max_output_tokens=120, temperature=0)
    assert anything.status == "completed" and isinstance(json.loads(anything.output_text), dict), anything.output_text


def test_a_required_tool_makes_a_function_call_and_its_output_is_answered(alice):
    r = alice.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME], tool_choice="required",
                               max_output_tokens=60)
    call = r.output[0]
    assert len(r.output) == 1 and call.type == "function_call" and call.status == "completed"
    assert call.name in ("get_weather", "get_time") and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments), dict)
    follow = alice.responses.create(model=MODEL, input=[
        {"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'}],
        tools=[WEATHER, TIME], tool_choice="none", max_output_tokens=12, temperature=0)
    assert follow.output[0].type == "message" and follow.output_text


def test_a_kept_function_call_is_continued_with_its_output(alice):
    asked = alice.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                   max_output_tokens=60, temperature=0)
    call = asked.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 25 C"}
    answer = alice.responses.create(model=MODEL, previous_response_id=asked.id, input=[result], tools=[WEATHER],
                                    tool_choice="none", max_output_tokens=12, temperature=0)
    # the same as sending the whole conversation, the call included, as items
    whole = alice.responses.create(model=MODEL, input=[{"role": "user", "content": ASK},
                                                       call.model_dump(exclude_none=True), result],
                                   tools=[WEATHER], tool_choice="none", max_output_tokens=12, temperature=0)
    assert answer.output_text == whole.output_text != ""


def test_a_named_tool_streams_its_arguments(alice):
    with alice.responses.stream(model=MODEL, input="What time is it in Berlin?", tools=[WEATHER, TIME],
                                tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=30) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_time"
    assert json.loads(call.arguments)["zone"] in ("UTC", "CET")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments


def test_previous_response_id_continues_the_conversation_of_its_key_only(alice, bob):
    first = alice.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                   max_output_tokens=8, temperature=0)
    second = alice.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                    max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    # instructions are not carried over, as OpenAI's
    assert second.output_text == _chat_text(alice, [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], max_completion_tokens=8)
    assert alice.responses.retrieve(second.id).output_text == second.output_text
    for client, response_id in ((bob, first.id), (alice, "resp_unknown")):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model=MODEL, input="And now?", previous_response_id=response_id)
        assert e.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
    alice.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(first.id)


def test_input_items_list_a_responses_own_input_in_pages_for_its_key_only(alice, bob):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone":"UTC"}'}
    items = [{"role": "user", "content": "What time is it?"}, call,
             {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
             {"type": "message", "id": "msg_mine", "role": "user", "content": [{"type": "input_text", "text": "Say "},
                                                                              {"type": "input_text", "text": "it."}]}]
    r = alice.responses.create(model=MODEL, input=items, tools=[TIME], tool_choice="none", max_output_tokens=2)
    listed = alice.responses.input_items.list(r.id, order="asc").data
    assert [i.type for i in listed] == ["message", "function_call", "function_call_output", "message"]
    assert (listed[0].role, listed[0].content[0].type, listed[0].content[0].text) == (
        "user", "input_text", "What time is it?")
    assert (listed[1].call_id, listed[1].name, listed[1].arguments) == ("call_1", "get_time", '{"zone":"UTC"}')
    assert (listed[2].call_id, listed[2].output) == ("call_1", "12:00")
    assert listed[3].id == "msg_mine" and [p.text for p in listed[3].content] == ["Say ", "it."]
    ids = [i.id for i in listed]
    assert len(set(ids)) == 4 and ids[0].startswith("msg_") and ids[1].startswith("fc_")
    # newest first unless order="asc", in pages: the client walks them to the end
    page = alice.responses.input_items.list(r.id, limit=3)
    assert [i.id for i in page.data] == ids[:0:-1] and page.has_more
    assert (page.first_id, page.last_id) == (ids[3], ids[1])
    assert [i.id for i in alice.responses.input_items.list(r.id, limit=3)] == ids[::-1]
    rest = alice.responses.input_items.list(r.id, after=ids[1])
    assert [i.id for i in rest.data] == [ids[0]] and not rest.has_more
    # a continuation lists its own input, not its previous response's
    again = alice.responses.create(model=MODEL, input="Thanks.", previous_response_id=r.id, max_output_tokens=2)
    [thanks] = alice.responses.input_items.list(again.id).data
    assert (thanks.role, thanks.content[0].text) == ("user", "Thanks.")
    with pytest.raises(openai.NotFoundError):
        bob.responses.input_items.list(r.id)
    for params, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after"),
                          ({"include": ["message.input_image.image_url"]}, "include")):
        with pytest.raises(openai.BadRequestError) as e:
            alice.responses.input_items.list(r.id, **params)
        assert e.value.body["param"] == param
    for query in ({"include": "message.input_image.image_url"}, {"limit": "many"}):
        refused = httpx.get(f"{alice.base_url}responses/{r.id}/input_items", params=query,
                            headers={"Authorization": "Bearer sk-alice"})
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, next(iter(query)))


def test_include_logprobs_gives_the_output_texts_logprobs_on_its_part_and_deltas(alice):
    asked = dict(model=MODEL, input="Name a fruit.", max_output_tokens=6, temperature=0)
    chat = alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}],
                                         max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    expected = [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]
    r = alice.responses.create(**asked, include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = r.output[0].content[0].logprobs
    assert r.top_logprobs == 2 and len(expected) == 6
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in logprobs] == expected
    assert "".join(e.token for e in logprobs) == r.output_text
    with alice.responses.stream(**asked, include=["message.output_text.logprobs"], top_logprobs=2) as stream:
        events = list(stream)
    deltas = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    assert [(e.token, e.logprob) for e in deltas] == [(e.token, e.logprob) for e in done.logprobs] == \
        [(token, logprob) for token, logprob, _ in expected]
    assert alice.responses.create(**asked).output[0].content[0].logprobs == []  # not asked for


def test_store_false_is_not_kept(alice):
    r = alice.responses.create(model=MODEL, input="Hello", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.create(model=MODEL, input="Again", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.input_items.list(r.id)


@pytest.mark.parametrize("body, param", [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without include's logprobs
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text"),  # no name
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"service_tier": "gold"}, "service_tier"),
    ({"input": ["not an item"]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "no call_id"}]}, "input"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(alice, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(model=MODEL, input="Hi", extra_body=body)
    assert e.value.body["param"] == param, e.value.body
