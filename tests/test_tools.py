"""Function calling (server/tools.py): requests refused by name where they cannot be honoured,
calls read from the output as it streams, conversations with calls and results given back to a
template that knows no tools, and end to end through the openai client on a live server."""
from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tollway.config import EngineConfig, SchedulerConfig
from tollway.engine import Engine
from tollway.request import SamplingParams
from tollway.server.errors import APIError
from tollway.server.protocol import ChatCompletionRequest
from tollway.server.tools import ToolCallReader, ToolCalling, conversation, finish_reason, tool_calling
from tollway.server.validation import validate
from tollway.text.tokenizer import Tokenizer

from live_server import MODEL, running_server
from test_server import server  # noqa: F401 -- the shared live server

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
# Asked so, the 270M model's named call ends (asked as ASK, its "days" runs on in digits to max_tokens).
SHORT_ASK = [{"role": "user", "content": "Weather in Paris, 2 days?"}]
# A chat template that shows the model its tools (as Qwen's or Llama 3.1's do), in Gemma's turns.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<start_of_turn>user\nTools: {{ tools | tojson }}<end_of_turn>\n{% endif %}"
    "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content or '' }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=ASK, **body)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),  # auto, and Gemma's template renders no tools
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_what_cannot_be_honoured_is_refused_by_name(body, param):
    with pytest.raises(APIError) as e:
        tool_calling(chat(**body), renders_tools=False)
    assert e.value.status == 400 and e.value.param == param


def test_none_and_no_tools_generate_text():
    assert tool_calling(chat(), False) == (None, None)
    assert tool_calling(chat(tools=[WEATHER], tool_choice="none"), False) == (None, None)


def _read(calling: ToolCalling, output: str) -> tuple[ToolCallReader, list[dict]]:
    """The output streamed a character at a time."""
    reader = ToolCallReader(calling)
    deltas = [reader.push(ch, i == len(output) - 1) for i, ch in enumerate(output)]
    return reader, [d for d in deltas if d]


def test_a_wrapped_call_streams_its_name_then_its_arguments():
    args = '{"city":"Paris","days":3}'
    reader, deltas = _read(ToolCalling(None), '{"name":"get_weather","arguments":' + args + "}")
    first = deltas[0]["tool_calls"][0]
    assert first["id"] == reader.calls[0]["id"] and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == args
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])
    assert reader.message()["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": args}
    assert reader.message()["content"] is None and finish_reason(reader, "stop") == "tool_calls"


def test_a_named_functions_output_is_its_arguments():
    reader, deltas = _read(ToolCalling("get_weather"), '{"city":"Oslo","days":1}')
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert reader.calls[0]["function"]["arguments"] == '{"city":"Oslo","days":1}'


def test_auto_reads_text_as_text_and_a_cut_call_as_what_it_was():
    reader, deltas = _read(ToolCalling(None), "It is sunny.")
    assert "".join(d["content"] for d in deltas) == "It is sunny." and finish_reason(reader, "stop") == "stop"
    assert reader.message() == {"role": "assistant", "content": "It is sunny."}
    # cut by max_tokens inside the call's head: no call to show, the text as it came
    reader, _ = _read(ToolCalling(None), '{"name":"get_w')
    assert not reader.called and reader.message()["content"] == '{"name":"get_w'
    # cut inside the arguments: the call, with what its arguments got to
    reader, _ = _read(ToolCalling(None), '{"name":"get_weather","arguments":{"city":"Pa')
    assert reader.calls[0]["function"]["arguments"] == '{"city":"Pa' and finish_reason(reader, "length") == "length"


def test_calls_and_results_go_back_through_a_template_without_tools(default_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Paris","days":3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain on day 3"},
    ]
    turns = conversation(messages, [WEATHER], renders_tools=False)
    assert [m["role"] for m in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.") and "get_weather" in turns[0]["content"]
    assert json.loads(turns[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
    assert "sunny, 21C" in turns[3]["content"] and "rain on day 3" in turns[3]["content"]
    prompt = default_tokenizer.apply_chat_template(turns)  # Gemma's template: roles alternate
    assert "sunny, 21C" in prompt and prompt.endswith("<start_of_turn>model\n")
    # a template that renders tools gets the messages, the calls' arguments as objects (as transformers' are)
    given = conversation(messages, [WEATHER], renders_tools=True)
    assert given[3:] == messages[3:] and given[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 3}


def test_auto_with_a_template_that_renders_tools(make_engine, default_weights):
    """The tools reach the template, and the output is text or a call, as the model chooses: here
    steered to a call by logit_bias on "{", and, with that token banned, to text."""
    tokenizer = Tokenizer.load(default_weights.tokenizer_path, chat_template=TOOLS_TEMPLATE)
    assert tokenizer.renders_tools
    engine = make_engine(num_blocks=128)
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    outputs = {}
    for name, bias in (("call", 100), ("text", -100)):
        sub = validate(chat(tools=[WEATHER, TIME], logit_bias={str(brace): bias}, temperature=0, max_tokens=60),
                       MODEL, tokenizer, engine.model_config.vocab_size, 4096)
        assert sub.tools == ToolCalling(None)  # its template teaches no syntax: a grammar makes the calls
        assert "get_weather" in tokenizer.decode(sub.prompts[0])  # the template showed the tools
        engine.add_request(sub.prompts[0], sub.params[0], request_id=name)
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                outputs[out.request_id] = out
    reader = ToolCallReader(ToolCalling(None))
    reader.push(outputs["call"].text, True)
    assert reader.called and all(c["function"]["name"] in ("get_weather", "get_time") for c in reader.calls)
    if outputs["call"].finish_reason == "stop":
        for c in reader.calls:
            json.loads(c["function"]["arguments"])
    assert not outputs["text"].text.startswith("{")


def test_a_named_function_end_to_end(server):  # noqa: F811
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused") as client:
        kwargs = dict(model=MODEL, messages=SHORT_ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        resp = client.chat.completions.create(**kwargs)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
        assert set(args) == {"city", "days"} and isinstance(args["city"], str) and isinstance(args["days"], int)
        # Streamed: the deltas add up to the same call.
        name, pieces, reasons = None, [], []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    name = name or tc.function.name
                    pieces.append(tc.function.arguments or "")
                reasons += [c.finish_reason] if c.finish_reason else []
        assert name == "get_weather" and "".join(pieces) == call.function.arguments and reasons == ["tool_calls"]
        # The result goes back, and the model answers in text.
        follow = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, tools=[WEATHER],
                                                tool_choice="none", messages=[
            *SHORT_ASK, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}])
        assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls
        assert follow.usage.prompt_tokens > resp.usage.prompt_tokens


def test_required_calls_one_of_the_tools(server):  # noqa: F811
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused") as client:
        resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                              temperature=0, tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0].function
    args = json.loads(call.arguments)
    assert call.name in ("get_weather", "get_time")
    assert set(args) >= ({"city", "days"} if call.name == "get_weather" else {"zone"})


def test_auto_on_a_template_without_tools_is_a_400_naming_tool_choice(server):  # noqa: F811
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=5)
    assert e.value.body["param"] == "tool_choice" and "template" in e.value.body["message"]


def test_sampling_params_carry_the_grammar(default_tokenizer):
    sub = validate(chat(tools=[WEATHER], tool_choice="required", n=2), MODEL, default_tokenizer, 262144, 4096)
    assert all(isinstance(p, SamplingParams) and p.grammar and p.grammar == sub.params[0].grammar for p in sub.params)


# Gemma's turns teaching Hermes' call syntax, as Qwen's template teaches it.
HERMES_TEMPLATE = """{{ bos_token }}{% if tools %}<start_of_turn>user
You may call functions. Their signatures, within <tools></tools> tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each call, answer with a JSON object with the function's name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><end_of_turn>
{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<start_of_turn>user
<tool_response>
{{ m.content }}
</tool_response><end_of_turn>
{% elif m.role == 'assistant' %}<start_of_turn>model
{{ m.content or '' }}{% for c in m.tool_calls or [] %}{{ '\\n' if not loop.first }}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<end_of_turn>
{% else %}<start_of_turn>{{ m.role }}
{{ m.content }}<end_of_turn>
{% endif %}{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""
PARIS = {"role": "user", "content": "What is the weather in Paris for 3 days, and the time in CET?"}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
# Asked the same three times and answered with the same two calls: the model (greedy) writes them
# again, in the template's syntax, unconstrained: which is how a tool-trained model calls.
REPEATED = [PARIS, {"role": "assistant", "content": None, "tool_calls": [
    {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    for i, (name, args) in enumerate(CALLS)]}] * 3 + [PARIS]


@pytest.fixture(scope="module")
def hermes_server(default_weights):
    engine = Engine(EngineConfig(chat_template=HERMES_TEMPLATE, profile_steps=False,
                                 scheduler=SchedulerConfig(num_blocks=128)),
                    progress=False, loaded=default_weights)
    yield from running_server(engine)


def _the_calls_text(tokenizer) -> int:
    """Tokens of the two calls as the template writes them: max_tokens that ends the reply there
    (this small model, having copied them, does not end its turn)."""
    text = "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>' for n, a in CALLS)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_the_models_own_calls_come_back_as_tool_calls(hermes_server):
    tokens = _the_calls_text(hermes_server["sync"].tokenizer)
    kwargs = dict(model=MODEL, messages=REPEATED, tools=[WEATHER, TIME], temperature=0, max_tokens=tokens)
    with openai.OpenAI(base_url=hermes_server["url"] + "/v1", api_key="unused", max_retries=0) as client:
        resp = client.chat.completions.create(**kwargs)
        message = resp.choices[0].message
        assert message.content is None and resp.choices[0].finish_reason == "length"  # cut where the calls end
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == CALLS
        assert len({c.id for c in message.tool_calls}) == 2 and all(c.id.startswith("call_") for c in message.tool_calls)
        # Streamed: deltas per call (index, id and name first, then pieces of the arguments),
        # which the client's own stream accumulator puts together into the same calls.
        state = ChatCompletionStreamState(input_tools=kwargs["tools"])
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        for chunk in chunks:
            state.handle_chunk(chunk)
        final = state.current_completion_snapshot  # get_final_completion refuses a reply cut by max_tokens
        streamed = final.choices[0].message
        assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert not streamed.content and final.choices[0].finish_reason == "length"
        deltas = [tc for chunk in chunks for ch in chunk.choices for tc in ch.delta.tool_calls or []]
        assert {d.index for d in deltas} == {0, 1} and sum(d.id is not None for d in deltas) == 2
        assert len(deltas) > 6  # the arguments came in pieces, not all at once
        assert not any(ch.delta.content for chunk in chunks for ch in chunk.choices)  # no marker leaked as text
        # parallel_tool_calls false: the first call only
        one = client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0].message
        assert [(c.function.name, json.loads(c.function.arguments)) for c in one.tool_calls] == CALLS[:1]


def test_the_syntax_is_the_templates_unless_configured(default_weights):
    tokenizer = Tokenizer.load(default_weights.tokenizer_path, chat_template=HERMES_TEMPLATE)
    sub = validate(chat(tools=[WEATHER]), MODEL, tokenizer, 262144, 4096)
    assert sub.tools == ToolCalling(None, "hermes") and sub.params[0].grammar is None  # the model writes freely
    sub = validate(chat(tools=[WEATHER]), MODEL, tokenizer, 262144, 4096, tool_call_parser="constrained")
    assert sub.tools == ToolCalling(None) and sub.params[0].grammar  # a grammar writes the call
    sub = validate(chat(tools=[WEATHER], tool_choice="required"), MODEL, tokenizer, 262144, 4096)
    assert sub.tools == ToolCalling(None) and sub.params[0].grammar  # required stays constrained
