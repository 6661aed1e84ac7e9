"""pydantic-ai against meshgate, through its OpenAI and its Anthropic provider: chat, streaming, a forced tool call
(a direct model request that allows no text), structured output (an Agent whose output type is ``Review``)."""

import asyncio

from _checks import (
    ASK,
    KEY,
    MODEL,
    REVIEW_ASK,
    STAT_ASK,
    TOOL_ASK,
    TYPED_TOKENS,
    URL,
    WEATHER_SCHEMA,
    Review,
    Stat,
    acheck,
    done,
    valid_review,
    valid_stat,
)
from pydantic_ai import Agent
from pydantic_ai.direct import model_request
from pydantic_ai.messages import ModelRequest, ToolCallPart
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.tools import ToolDefinition

MODELS: dict[str, Model] = {
    "openai": OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{URL}/v1", api_key=KEY)),
    "anthropic": AnthropicModel(MODEL, provider=AnthropicProvider(base_url=URL, api_key=KEY)),
}
SHORT = {"max_tokens": 16, "temperature": 0}


def checks(model: Model) -> dict:
    async def chat() -> str:
        text = (await Agent(model, model_settings=SHORT).run(ASK)).output
        assert text.strip(), "empty answer"
        return repr(text)

    async def stream() -> str:
        async with Agent(model, model_settings=SHORT).run_stream(ASK) as run:
            got = [delta async for delta in run.stream_text(delta=True)]
        assert len(got) > 1 and "".join(got).strip(), got
        return f"{len(got)} chunks"

    async def forced_tool() -> str:
        weather = ToolDefinition(
            name="get_weather", description="Current weather.", parameters_json_schema=WEATHER_SCHEMA
        )
        response = await model_request(
            model,
            [ModelRequest.user_text_prompt(TOOL_ASK)],
            model_settings={"max_tokens": 32, "temperature": 0},
            model_request_parameters=ModelRequestParameters(function_tools=[weather], allow_text_output=False),
        )
        (call,) = [p for p in response.parts if isinstance(p, ToolCallPart)]
        args = call.args_as_dict()
        assert call.tool_name == "get_weather" and isinstance(args["location"], str), call
        return f"{call.tool_name}({args})"

    async def structured() -> str:  # no retries: a bad answer fails here, not quietly on a second try
        agent = Agent(model, output_type=Review, model_settings={"max_tokens": 32, "temperature": 0}, retries=0)
        return valid_review((await agent.run(REVIEW_ASK)).output)

    async def typed() -> str:
        settings = {"max_tokens": TYPED_TOKENS, "temperature": 0}
        return valid_stat(
            (await Agent(model, output_type=Stat, model_settings=settings, retries=0).run(STAT_ASK)).output
        )

    return {"chat": chat, "stream": stream, "forced tool": forced_tool, "structured": structured, "typed": typed}


async def main() -> None:  # one event loop for every check: the providers' clients keep their connections
    for provider, model in MODELS.items():
        for name, run in checks(model).items():
            await acheck(f"pydantic-ai {provider} {name}", run)


asyncio.run(main())
done()
