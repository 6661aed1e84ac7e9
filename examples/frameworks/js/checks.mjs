// What every JavaScript example shares: where meshgate is, which model, the asks, and the verdicts.
// Each example prints one line per check ("ok <name>: ..." or "FAIL <name>: ...") and exits 1 if any failed.

export const URL = process.env.MESHGATE_URL ?? "http://127.0.0.1:11434"; // meshgate serve's default port
export const MODEL = process.env.MESHGATE_MODEL ?? "gemma3:270m";
export const KEY = process.env.MESHGATE_API_KEY ?? "unused";
export const ASK = "Say hello in five words.";
export const TOOL_ASK = "What is the weather in Paris? Use the get_weather tool.";
export const REVIEW_ASK = "Rate this review from 1 to 5 and say if the reader liked it: 'Great book, I loved every page.'";
export const WEATHER_SCHEMA = {
  type: "object",
  properties: { location: { type: "string", description: "A city" } },
  required: ["location"],
};
export const REVIEW_SCHEMA = {
  type: "object",
  properties: { score: { type: "integer", minimum: 1, maximum: 5 }, liked: { type: "boolean" } },
  required: ["score", "liked"],
  additionalProperties: false,
};

export const STAT_ASK = "How many days a year does it rain in Paris? Answer with the days and the metric.";
export const TYPED_TOKENS = 48; // an unbounded integer must leave room for the keys after it
export const STAT_SCHEMA = {
  type: "object",
  properties: { days: { type: "integer" }, metric: { type: "string", maxLength: 20 } },
  required: ["days", "metric"],
  additionalProperties: false,
};

export function assert(ok, message) {
  if (!ok) throw new Error(message);
}

export function validReview(review) {
  const { score, liked } = review;
  assert(Number.isInteger(score) && score >= 1 && score <= 5, `score ${JSON.stringify(score)} is not an integer from 1 to 5`);
  assert(typeof liked === "boolean", `liked ${JSON.stringify(liked)} is not a boolean`);
  return `score=${score} liked=${liked}`;
}

export function validStat(stat) {
  const { days, metric } = stat;
  assert(Number.isSafeInteger(days), `days ${JSON.stringify(days)} is not an integer JavaScript holds exactly`);
  assert(typeof metric === "string", `metric ${JSON.stringify(metric)} is not a string`);
  return `days=${days} metric=${JSON.stringify(metric)}`;
}

export async function run(prefix, checks) {
  let failed = 0;
  for (const [name, check] of Object.entries(checks)) {
    try {
      console.log(`ok ${prefix} ${name}: ${await check()}`);
    } catch (error) {
      failed += 1;
      console.log(`FAIL ${prefix} ${name}: ${error?.message ?? error}`);
      console.error(error);
    }
  }
  process.exit(failed ? 1 : 0);
}
