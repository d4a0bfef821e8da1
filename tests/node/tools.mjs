// Usage: node tools.mjs BASE_URL MODEL
// Streams a forced tool call with the SDK and accumulates the tool_calls deltas the way a chat
// front end does; prints the result as JSON (the test checks it against the schema). Exits
// non-zero if the SDK throws, no call comes back, or the arguments are not JSON.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120_000 });
const tools = [{
  type: "function",
  function: {
    name: "get_weather",
    description: "The current weather in a city",
    parameters: {
      type: "object",
      properties: {
        city: { type: "string", maxLength: 30 },
        unit: { type: "string", enum: ["celsius", "fahrenheit"] },
      },
      required: ["city", "unit"],
    },
  },
}];

const stream = await client.chat.completions.create({
  model, temperature: 0, max_tokens: 100, stream: true, tools, tool_choice: "required", parallel_tool_calls: false,
  messages: [{ role: "user", content: "What is the weather like in Lisbon today?" }],
});
const calls = [];
let content = "";
let finish = null;
for await (const chunk of stream) {
  const choice = chunk.choices[0];
  if (!choice) continue;
  content += choice.delta.content ?? "";
  for (const d of choice.delta.tool_calls ?? []) {
    if (!calls[d.index]) calls[d.index] = { id: d.id, type: d.type, name: "", arguments: "" };
    if (d.function?.name) calls[d.index].name += d.function.name;
    if (d.function?.arguments) calls[d.index].arguments += d.function.arguments;
  }
  if (choice.finish_reason) finish = choice.finish_reason;
}
if (!calls.length) throw new Error(`no tool call; content ${JSON.stringify(content)}`);
const parsed = calls.map((c) => ({ id: c.id, type: c.type, name: c.name, arguments: JSON.parse(c.arguments) }));
console.log(JSON.stringify({ content, finish, calls: parsed }));
