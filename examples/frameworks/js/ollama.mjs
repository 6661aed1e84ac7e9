// The official ollama package against meshgate's Ollama API: chat, streaming, a forced tool call (tools with
// `format`, as Ollama has no tool_choice), structured output (`format` = the JSON schema).
import { Ollama } from "ollama";
import {
  ASK, MODEL, REVIEW_ASK, REVIEW_SCHEMA, STAT_ASK, STAT_SCHEMA, TOOL_ASK, TYPED_TOKENS, URL, WEATHER_SCHEMA, assert, run, validReview,
  validStat,
} from "./checks.mjs";

const client = new Ollama({ host: URL });
const user = (content) => [{ role: "user", content }];

await run("js ollama", {
  async chat() {
    const answer = await client.chat({ model: MODEL, messages: user(ASK), options: { num_predict: 16, temperature: 0 } });
    assert(answer.message.content.trim(), "empty answer");
    return JSON.stringify(answer.message.content);
  },
  async stream() {
    const pieces = [];
    const stream = await client.chat({ model: MODEL, messages: user(ASK), stream: true, options: { num_predict: 16, temperature: 0 } });
    for await (const part of stream) if (part.message.content) pieces.push(part.message.content);
    assert(pieces.length > 1 && pieces.join("").trim(), `pieces: ${JSON.stringify(pieces)}`);
    return `${pieces.length} chunks`;
  },
  async "forced tool"() {
    const answer = await client.chat({
      model: MODEL,
      messages: user(TOOL_ASK),
      tools: [{ type: "function", function: { name: "get_weather", description: "Current weather.", parameters: WEATHER_SCHEMA } }],
      format: WEATHER_SCHEMA,
      options: { num_predict: 32, temperature: 0 },
    });
    const [call] = answer.message.tool_calls ?? [];
    assert(call?.function.name === "get_weather" && typeof call.function.arguments.location === "string", JSON.stringify(answer.message));
    return `get_weather(${JSON.stringify(call.function.arguments)})`;
  },
  async structured() {
    const answer = await client.chat({
      model: MODEL,
      messages: user(REVIEW_ASK),
      format: REVIEW_SCHEMA,
      options: { num_predict: 32, temperature: 0 },
    });
    return validReview(JSON.parse(answer.message.content));
  },
  async typed() {
    const answer = await client.chat({
      model: MODEL,
      messages: user(STAT_ASK),
      format: STAT_SCHEMA,
      options: { num_predict: TYPED_TOKENS, temperature: 0 },
    });
    return validStat(JSON.parse(answer.message.content));
  },
});
