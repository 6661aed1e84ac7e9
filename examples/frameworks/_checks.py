"""What every Python example shares: where meshgate is, which model, the task each check asks, and the verdicts.

Each example prints one line per check (``ok <name>: ...`` or ``FAIL <name>: ...``) and exits 1 if any failed.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Awaitable, Callable

from pydantic import BaseModel, Field

URL = os.environ.get("MESHGATE_URL", "http://127.0.0.1:11434")  # meshgate serve's default port (Ollama's)
MODEL = os.environ.get("MESHGATE_MODEL", "gemma3:270m")
KEY = os.environ.get("MESHGATE_API_KEY", "unused")  # any string unless the gateway was started with --api-key
ASK = "Say hello in five words."
TOOL_ASK = "What is the weather in Paris? Use the get_weather tool."
REVIEW_ASK = "Rate this review from 1 to 5 and say if the reader liked it: 'Great book, I loved every page.'"
STAT_ASK = "How many days a year does it rain in Paris? Answer with the days and the metric."
TYPED_TOKENS = 48
"""The output limit of the ``typed`` check: an unbounded integer must leave room for the keys after it."""


class Review(BaseModel):
    """The structured answer: a bounded integer the grammar must respect."""

    score: int = Field(ge=1, le=5)
    liked: bool


class Stat(BaseModel):
    """A typed answer whose integer has no bounds: the gateway holds it to what JSON consumers hold exactly."""

    days: int
    metric: str = Field(max_length=20)


def get_weather(location: str) -> str:
    """Current weather in a city."""
    return f"Sunny in {location}"


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"location": {"type": "string", "description": "A city"}},
    "required": ["location"],
}

_failed: list[str] = []


def check(name: str, run: Callable[[], str]) -> None:
    """Run one check; ``run`` returns what to print, raises (or asserts) on failure."""
    try:
        print(f"ok {name}: {run()}", flush=True)
    except Exception as exc:  # the verdict names the check; the traceback says why
        _failed.append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(file=sys.stderr)


async def acheck(name: str, run: Callable[[], Awaitable[str]]) -> None:
    """``check`` for a coroutine function."""
    try:
        print(f"ok {name}: {await run()}", flush=True)
    except Exception as exc:
        _failed.append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(file=sys.stderr)


def valid_review(review: Review | dict) -> str:
    """A review whose score is 1..5, checked again here whatever the client library did."""
    data = review.model_dump() if isinstance(review, Review) else review
    score = data["score"]
    assert isinstance(score, int) and 1 <= score <= 5, f"score {score!r} is not an integer from 1 to 5"
    return f"score={score} liked={data['liked']}"


def valid_stat(stat: Stat | dict) -> str:
    """A whole ``Stat`` (every key there) whose ``days`` a JavaScript client would hold exactly."""
    data = stat.model_dump() if isinstance(stat, Stat) else Stat.model_validate(stat).model_dump()
    assert abs(data["days"]) <= 2**53 - 1, f"days {data['days']} is beyond what JSON consumers hold exactly"
    return f"days={data['days']} metric={data['metric']!r}"


def run_checks(prefix: str, *runs: Callable[[], str]) -> None:
    """Run each check, named after its function (``forced_tool``: ``forced tool``), then exit 1 if any failed."""
    for run in runs:
        check(f"{prefix} {run.__name__.replace('_', ' ')}", run)
    done()


def done() -> None:
    sys.exit(1 if _failed else 0)
