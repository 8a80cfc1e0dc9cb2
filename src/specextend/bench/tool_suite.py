"""The held-out-style tool-calling suite of bench/tools.py: realistic functions (weather, calendar,
database, units, files, email, tickets) with nested schemas, and requests that call them under
every `tool_choice`, in parallel, streamed, and with the tools' results fed back.

Written for this benchmark (no data set): each schema is what an application would declare in
OpenAI's strict style (objects in objects, arrays of objects, enums, required fields, no extra
properties), with the bounds (lengths, ranges) a careful application puts on its inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

AUTO, NONE, REQUIRED = "auto", "none", "required"


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


def _text(max_length: int, description: str | None = None) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string", "maxLength": max_length}
    return {**s, "description": description} if description else s


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$", "description": "YYYY-MM-DD"}
TIME = {"type": "string", "pattern": r"^\d{2}:\d{2}$", "description": "HH:MM, 24-hour"}
UNITS = ["m", "km", "mi", "ft", "kg", "lb", "c", "f", "l", "gal"]

TOOLS: dict[str, dict[str, Any]] = {t["function"]["name"]: t for t in (
    _fn("get_weather", "Current weather and a forecast for a place.", {
        "location": _obj({"city": _text(60), "country": {"type": "string", "pattern": r"^[A-Z]{2}$",
                                                         "description": "ISO 3166 alpha-2 code"}}, ["city"]),
        "days": {"type": "integer", "minimum": 1, "maximum": 14, "description": "forecast days"},
        "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location", "units"]),
    _fn("book_meeting", "Book a meeting in the company calendar and invite people.", {
        "title": _text(80),
        "start": _obj({"date": DATE, "time": TIME}, ["date", "time"]),
        "duration_minutes": {"type": "integer", "minimum": 15, "maximum": 480},
        "attendees": {"type": "array", "minItems": 1, "maxItems": 10, "items": _obj(
            {"email": _text(80), "optional": {"type": "boolean"}}, ["email", "optional"])},
        "room": {"type": "string", "enum": ["orion", "lyra", "vega", "remote"]}},
        ["title", "start", "duration_minutes", "attendees"]),
    _fn("query_database", "Read rows from the shop's database (read-only).", {
        "table": {"type": "string", "enum": ["orders", "customers", "products", "refunds"]},
        "columns": {"type": "array", "items": _text(40), "maxItems": 8},
        "filters": {"type": "array", "maxItems": 5, "items": _obj({
            "column": _text(40), "op": {"type": "string", "enum": ["=", "!=", "<", "<=", ">", ">=", "like"]},
            "value": {"anyOf": [_text(60), {"type": "number", "minimum": -1e9, "maximum": 1e9}]}},
            ["column", "op", "value"])},
        "order_by": _obj({"column": _text(40), "descending": {"type": "boolean"}}, ["column", "descending"]),
        "limit": {"type": "integer", "minimum": 1, "maximum": 1000}}, ["table", "filters", "limit"]),
    _fn("convert_units", "Convert a quantity between units.", {
        "value": {"type": "number", "minimum": -1e9, "maximum": 1e9},
        "from_unit": {"type": "string", "enum": UNITS}, "to_unit": {"type": "string", "enum": UNITS}},
        ["value", "from_unit", "to_unit"]),
    _fn("search_files", "Search the user's files by content and name.", {
        "query": _text(100, "words to look for in the files"),
        "folder": _text(120),
        "extensions": {"type": "array", "maxItems": 6, "items": {"type": "string", "enum": [
            "py", "md", "txt", "pdf", "csv", "json"]}},
        "modified_after": DATE,
        "max_results": {"type": "integer", "minimum": 1, "maximum": 50}}, ["query"]),
    _fn("send_email", "Send an email from the user's account.", {
        "to": {"type": "array", "minItems": 1, "maxItems": 5, "items": _text(80)},
        "subject": _text(120), "body": _text(600),
        "priority": {"type": "string", "enum": ["low", "normal", "high"]}}, ["to", "subject", "body"]),
    _fn("create_ticket", "Open a support ticket for a customer's order.", {
        "customer": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 10**7}, "name": _text(60)}, ["id"]),
        "order_id": _text(20),
        "category": {"type": "string", "enum": ["refund", "damaged", "late", "other"]},
        "items": {"type": "array", "maxItems": 5, "items": _obj(
            {"sku": _text(20), "quantity": {"type": "integer", "minimum": 1, "maximum": 100}}, ["sku", "quantity"])},
        "summary": _text(300)}, ["customer", "category", "summary"]),
)}


@dataclass(frozen=True)
class Case:
    """One request of the suite: its messages, the tools it offers, `tool_choice` (None: the
    field is left out, which means auto; a tool's name: that function), `parallel_tool_calls`
    (None: left out) and whether it streams."""

    name: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[str, ...]
    choice: str | None = None
    parallel: bool | None = None
    stream: bool = False

    @property
    def forced(self) -> bool:
        """A call is forced: `required` or a named function."""
        return self.choice not in (None, AUTO, NONE)

    @property
    def callable(self) -> tuple[str, ...]:
        """The functions the answer may call."""
        return (self.choice,) if self.forced and self.choice != REQUIRED else self.tools

    def fields(self) -> dict[str, Any]:
        """The request's fields for `client.chat.completions.create`."""
        out: dict[str, Any] = {"messages": [dict(m) for m in self.messages], "tools": [TOOLS[t] for t in self.tools]}
        if self.choice is not None:
            out["tool_choice"] = (self.choice if self.choice in (AUTO, NONE, REQUIRED)
                                  else {"type": "function", "function": {"name": self.choice}})
        if self.parallel is not None:
            out["parallel_tool_calls"] = self.parallel
        return out


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


SYSTEM = {"role": "system", "content": "You are a helpful assistant with access to tools. Call a tool when it "
                                         "helps to answer; otherwise answer directly."}


def fed(question: str, calls: list[tuple[str, dict[str, Any]]], results: list[Any]) -> tuple[dict[str, Any], ...]:
    """A conversation where the assistant called tools and their results came back."""
    ids = [f"call_{i + 1}" for i in range(len(calls))]
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in zip(ids, calls, strict=True)]}
    back = [{"role": "tool", "tool_call_id": i, "content": r if isinstance(r, str) else json.dumps(r)}
            for i, r in zip(ids, results, strict=True)]
    return (SYSTEM, user(question), assistant, *back)


def _ask(text: str) -> tuple[dict[str, Any], ...]:
    return (SYSTEM, user(text))


PARIS = {"location": {"city": "Paris", "country": "FR"}, "days": 2, "units": "celsius"}
ORDERS = {"table": "orders", "filters": [{"column": "total", "op": ">", "value": 500},
                                         {"column": "country", "op": "=", "value": "DE"}],
          "order_by": {"column": "created_at", "descending": True}, "limit": 3}

SUITE: tuple[Case, ...] = (
    # Forced: `required` and a named function, one call each.
    Case("weather-required", _ask("What's the weather going to be in Paris this weekend?"),
         ("get_weather", "convert_units"), REQUIRED, False),
    Case("weather-named", _ask("Will I need an umbrella in Tokyo tomorrow?"), ("get_weather", "search_files"),
         "get_weather"),
    Case("meeting-named", _ask("Book a 45-minute design review called 'Checkout redesign' on 2026-12-01 at 14:30 "
                               "in Orion with alice@example.com and bob@example.com (Bob is optional)."),
         ("book_meeting", "send_email"), "book_meeting"),
    Case("database-required", _ask("Show me the 10 most recent orders over 500 euros from customers in Germany."),
         ("query_database", "create_ticket"), REQUIRED, False),
    Case("convert-named", _ask("How many kilometres is a marathon of 26.2 miles?"), ("convert_units",),
         "convert_units"),
    Case("files-required", _ask("Find my Python and Markdown notes about the retry policy that I changed since "
                                "2026-10-01 in ~/projects."), ("search_files", "send_email"), REQUIRED, False),
    Case("email-named", _ask("Email carol@example.com that the quarterly report is ready for review; it's urgent."),
         ("send_email", "book_meeting"), "send_email"),
    Case("ticket-required", _ask("Customer 48213 (Dana Reyes) says order A-1009 arrived with 2 broken mugs, SKU "
                                 "MUG-01. Open a ticket."), ("create_ticket", "query_database"), REQUIRED, False),
    # Forced, several calls at once.
    Case("weather-parallel", _ask("Compare today's weather in Berlin, Madrid and Oslo."), ("get_weather",),
         REQUIRED, True),
    Case("convert-parallel", _ask("Convert 100 F to Celsius and 5 kg to pounds."), ("convert_units",), REQUIRED,
         True),
    # The model chooses.
    Case("auto-weather", _ask("What's the weather like in Lisbon right now?"), ("get_weather", "search_files")),
    Case("auto-explain", _ask("Can you explain what a cold front is, in two sentences?"),
         ("get_weather", "convert_units"), AUTO),
    Case("auto-database", _ask("How many customers signed up in November 2026?"), ("query_database",
                                                                                  "send_email"), AUTO),
    Case("auto-haiku", _ask("Write a haiku about autumn."), ("search_files", "send_email"), AUTO),
    Case("auto-support", (
        {"role": "system", "content": "You are the support agent of an online shop. Use the tools to look things "
                                      "up or open tickets."},
        user("Hi, my order A-2231 is a week late. Can you check it?")), ("query_database", "create_ticket"), AUTO),
    # No call allowed.
    Case("none-weather", _ask("What's the weather in Rome?"), ("get_weather",), NONE),
    Case("none-explain", _ask("In one sentence, which of your tools would book a meeting?"),
         ("book_meeting", "send_email"), NONE),
    # The tools' results fed back: the model answers from them (or calls on).
    Case("fed-weather", fed("What's the weather in Paris for the next two days?", [("get_weather", PARIS)],
                            [{"today": {"condition": "rain", "high_c": 11, "low_c": 6},
                              "tomorrow": {"condition": "sunny", "high_c": 14, "low_c": 7}}]),
         ("get_weather", "convert_units")),
    Case("fed-database-none", fed("Show me the 3 biggest recent German orders over 500 euros.",
                                  [("query_database", ORDERS)],
                                  [[{"id": "A-1187", "total": 1240.5, "created_at": "2026-11-20"},
                                    {"id": "A-1179", "total": 860.0, "created_at": "2026-11-18"},
                                    {"id": "A-1162", "total": 512.99, "created_at": "2026-11-12"}]]),
         ("query_database",), NONE),
    Case("fed-parallel", fed("Convert 100 F to Celsius and 5 kg to pounds.",
                             [("convert_units", {"value": 100, "from_unit": "f", "to_unit": "c"}),
                              ("convert_units", {"value": 5, "from_unit": "kg", "to_unit": "lb"})],
                             [{"value": 37.78, "unit": "c"}, {"value": 11.02, "unit": "lb"}]),
         ("convert_units",), AUTO),
    Case("fed-meeting", fed("Book the 'Checkout redesign' review on 2026-12-01 at 14:30 for 45 minutes with "
                            "alice@example.com.", [("book_meeting", {
                                "title": "Checkout redesign", "start": {"date": "2026-12-01", "time": "14:30"},
                                "duration_minutes": 45, "attendees": [{"email": "alice@example.com",
                                                                       "optional": False}]})],
                            [{"status": "booked", "room": "orion", "event_id": "evt_5521"}]),
         ("book_meeting", "send_email")),
    Case("fed-then-call", fed("Check the weather in Paris tomorrow; if it's sunny, email dave@example.com to "
                              "suggest lunch outside.", [("get_weather", PARIS)],
                              [{"tomorrow": {"condition": "sunny", "high_c": 14}}]),
         ("get_weather", "send_email"), REQUIRED, False),
    # Streamed (tool-call deltas reassembled by the client).
    Case("stream-weather-required", _ask("What's the weather in Nairobi over the next 3 days, in Celsius?"),
         ("get_weather",), REQUIRED, False, True),
    Case("stream-meeting-named", _ask("Set up a 30-minute sync 'Q1 planning' on 2027-01-05 at 09:00, remote, "
                                      "with erin@example.com."), ("book_meeting",), "book_meeting", None, True),
    Case("stream-parallel", _ask("What's the weather in Sydney and in Toronto today?"), ("get_weather",),
         REQUIRED, True, True),
    Case("stream-auto", _ask("Find the CSV exports about invoices in ~/finance."), ("search_files",), AUTO, None,
         True),
    Case("stream-fed", fed("What's the weather in Paris for the next two days?", [("get_weather", PARIS)],
                           [{"today": {"condition": "cloudy", "high_c": 9}, "tomorrow": {"condition": "rain",
                                                                                         "high_c": 8}}]),
         ("get_weather",), AUTO, None, True),
)


def pick(names: str | None) -> tuple[Case, ...]:
    """The suite's cases named (comma-separated), all of them for None; ValueError for an unknown one."""
    if not names:
        return SUITE
    by = {c.name: c for c in SUITE}
    unknown = [n for n in names.split(",") if n.strip() and n.strip() not in by]
    if unknown:
        raise ValueError(f"no case {unknown[0]!r} in the suite (cases: {', '.join(by)})")
    return tuple(by[n.strip()] for n in names.split(",") if n.strip())
