// Usage: node client.mjs BASE_URL MODEL
// One streamed chat read with the SDK's async iterator, one whole chat; exits non-zero if the
// SDK throws or a text comes back empty.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120_000 });
const messages = [{ role: "user", content: "In one sentence, what is a cat?" }];

const stream = await client.chat.completions.create({
  model, messages, temperature: 0, max_tokens: 24, stream: true,
  stream_options: { include_usage: true },
});
let streamed = "";
let usage = null;
for await (const chunk of stream) {
  if (chunk.choices.length) streamed += chunk.choices[0].delta.content ?? "";
  if (chunk.usage) usage = chunk.usage;
}
const whole = await client.chat.completions.create({ model, messages, temperature: 0, max_tokens: 24 });
const text = whole.choices[0].message.content;

console.log(`streamed: ${JSON.stringify(streamed)}`);
console.log(`whole: ${JSON.stringify(text)}`);
if (!streamed || !text) throw new Error("empty text");
if (streamed !== text) throw new Error("streamed and whole texts differ");
if (!usage || usage.completion_tokens <= 0) throw new Error("no usage chunk");
