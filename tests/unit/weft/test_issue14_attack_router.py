"""Hostile tool-calling chat messages (issue 14's attack, against the router's parser): each
bad shape is an InvalidRequestError (HTTP 400) whose field is the full path of the
offending value, never silently dropped or named by its bare key."""
from __future__ import annotations

import pytest

from services.router.chat_messages import parse_message
from services.router.errors import InvalidRequestError

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(("message", "field"), [
    # tool_calls on a user / tool / system message were dropped without a word
    ({"role": "user", "content": "hi", "tool_calls": [CALL]}, "messages[3].tool_calls"),
    ({"role": "tool", "tool_call_id": "c1", "content": "x", "tool_calls": [CALL]}, "messages[3].tool_calls"),
    ({"role": "system", "content": "x", "tool_calls": []}, "messages[3].tool_calls"),
    # a wrongly typed tool_call_id / name was a 400 naming "tool_call_id" / "name" only
    ({"role": "tool", "tool_call_id": 5, "content": "x"}, "messages[3].tool_call_id"),
    ({"role": "user", "content": "x", "name": 5}, "messages[3].name"),
    # an assistant tool call with a non-string id or a non-function type went to the template
    ({"role": "assistant", "tool_calls": [{**CALL, "id": 7}]}, "messages[3].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}, "messages[3].tool_calls[0].type"),
], ids=["calls_on_user", "calls_on_tool", "calls_on_system", "tool_call_id_int", "name_int", "call_id_int",
        "call_type_code"])
def test_a_malformed_tool_message_is_refused_naming_its_full_path(message, field):
    with pytest.raises(InvalidRequestError) as info:
        parse_message(message, "messages[3]")
    assert info.value.field == field


def test_the_shapes_openai_clients_send_still_parse():
    calls = parse_message({"role": "assistant", "content": None, "tool_calls": [CALL]}, "m")["tool_calls"]
    assert calls[0]["id"] == "c1"
    assert parse_message({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}, "m")["tool_calls"][0][
        "id"] == "call_0"
    assert parse_message({"role": "user", "content": "x", "tool_calls": None}, "m") == {"role": "user", "content": "x"}
    assert parse_message({"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"}, "m") == {
        "role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": "c1"}
