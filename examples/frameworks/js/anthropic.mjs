// The official @anthropic-ai/sdk against meshgate's Messages API: chat, streaming, a forced tool call, structured
// output (a forced tool whose input schema is the answer's, the Messages API's way).
import Anthropic from "@anthropic-ai/sdk";
import {
  ASK, KEY, MODEL, REVIEW_ASK, REVIEW_SCHEMA, STAT_ASK, STAT_SCHEMA, TOOL_ASK, TYPED_TOKENS, URL, WEATHER_SCHEMA, assert, run,
  validReview, validStat,
} from "./checks.mjs";

const client = new Anthropic({ baseURL: URL, apiKey: KEY, maxRetries: 0 });
const user = (content) => [{ role: "user", content }];

async function forced(name, schema, content, maxTokens = 32) {
  const answer = await client.messages.create({
    model: MODEL,
    messages: user(content),
    tools: [{ name, description: `The ${name} tool.`, input_schema: schema }],
    tool_choice: { type: "tool", name },
    max_tokens: maxTokens,
    temperature: 0,
  });
  const calls = answer.content.filter((block) => block.type === "tool_use");
  assert(calls.length === 1 && calls[0].name === name, JSON.stringify(answer.content));
  assert(answer.stop_reason === "tool_use", `stop_reason ${answer.stop_reason}, not tool_use`);
  return calls[0].input;
}

await run("js anthropic", {
  async chat() {
    const answer = await client.messages.create({ model: MODEL, messages: user(ASK), max_tokens: 16, temperature: 0 });
    const text = answer.content.map((block) => block.text ?? "").join("");
    assert(text.trim(), "empty answer");
    return JSON.stringify(text);
  },
  async stream() {
    const pieces = [];
    const stream = client.messages.stream({ model: MODEL, messages: user(ASK), max_tokens: 16, temperature: 0 });
    stream.on("text", (text) => pieces.push(text));
    await stream.finalMessage();
    assert(pieces.length > 1 && pieces.join("").trim(), `pieces: ${JSON.stringify(pieces)}`);
    return `${pieces.length} chunks`;
  },
  async "forced tool"() {
    const input = await forced("get_weather", WEATHER_SCHEMA, TOOL_ASK);
    assert(typeof input.location === "string", JSON.stringify(input));
    return `get_weather(${JSON.stringify(input)})`;
  },
  async structured() {
    return validReview(await forced("review", REVIEW_SCHEMA, REVIEW_ASK));
  },
  async typed() {
    return validStat(await forced("stat", STAT_SCHEMA, STAT_ASK, TYPED_TOKENS));
  },
});
