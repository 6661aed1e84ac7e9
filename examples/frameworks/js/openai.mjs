// The official openai SDK against meshgate's OpenAI API: chat, streaming, a forced tool call, structured output.
import OpenAI from "openai";
import {
  ASK, KEY, MODEL, REVIEW_ASK, REVIEW_SCHEMA, STAT_ASK, STAT_SCHEMA, TOOL_ASK, TYPED_TOKENS, URL, WEATHER_SCHEMA, assert, run,
  validReview, validStat,
} from "./checks.mjs";

const client = new OpenAI({ baseURL: `${URL}/v1`, apiKey: KEY, maxRetries: 0 });
const user = (content) => [{ role: "user", content }];

await run("js openai", {
  async chat() {
    const answer = await client.chat.completions.create({ model: MODEL, messages: user(ASK), max_tokens: 16, temperature: 0 });
    const text = answer.choices[0].message.content;
    assert(text.trim(), "empty answer");
    return JSON.stringify(text);
  },
  async stream() {
    const stream = await client.chat.completions.create({ model: MODEL, messages: user(ASK), max_tokens: 16, temperature: 0, stream: true });
    const pieces = [];
    for await (const chunk of stream) if (chunk.choices[0]?.delta?.content) pieces.push(chunk.choices[0].delta.content);
    assert(pieces.length > 1 && pieces.join("").trim(), `pieces: ${JSON.stringify(pieces)}`);
    return `${pieces.length} chunks`;
  },
  async "forced tool"() {
    const answer = await client.chat.completions.create({
      model: MODEL,
      messages: user(TOOL_ASK),
      tools: [{ type: "function", function: { name: "get_weather", description: "Current weather.", parameters: WEATHER_SCHEMA } }],
      tool_choice: { type: "function", function: { name: "get_weather" } },
      max_tokens: 32,
      temperature: 0,
    });
    const [call] = answer.choices[0].message.tool_calls;
    const args = JSON.parse(call.function.arguments);
    assert(call.function.name === "get_weather" && typeof args.location === "string", JSON.stringify(call));
    return `${call.function.name}(${call.function.arguments})`;
  },
  async structured() {
    const answer = await client.chat.completions.create({
      model: MODEL,
      messages: user(REVIEW_ASK),
      response_format: { type: "json_schema", json_schema: { name: "review", schema: REVIEW_SCHEMA, strict: true } },
      max_tokens: 32,
      temperature: 0,
    });
    return validReview(JSON.parse(answer.choices[0].message.content));
  },
  async typed() {
    const answer = await client.chat.completions.create({
      model: MODEL,
      messages: user(STAT_ASK),
      response_format: { type: "json_schema", json_schema: { name: "stat", schema: STAT_SCHEMA, strict: true } },
      max_tokens: TYPED_TOKENS,
      temperature: 0,
    });
    return validStat(JSON.parse(answer.choices[0].message.content));
  },
});
