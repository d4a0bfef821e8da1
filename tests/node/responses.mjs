// Usage: node responses.mjs BASE_URL MODEL
// What today's Node front ends call: the Vercel AI SDK with @ai-sdk/openai's default provider
// (the Responses API) and with @ai-sdk/openai-compatible (chat completions): streamText,
// generateObject with a schema and a forced tool call; then the openai package's
// responses.create streamed and whole, and a second turn through previous_response_id.
// Prints one JSON line of results (the test checks them); exits non-zero if anything throws
// or comes back malformed.
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateObject, generateText, streamText, tool } from "ai";
import OpenAI from "openai";
import { z } from "zod";

const [baseURL, model] = process.argv.slice(2);
const check = (ok, what) => { if (!ok) throw new Error(what); };

const providers = {
  responses: createOpenAI({ baseURL, apiKey: "unused" })(model),
  compatible: createOpenAICompatible({ name: "pageserve", baseURL, apiKey: "unused",
                                       supportsStructuredOutputs: true, includeUsage: true })(model),
};
const weather = z.object({ city: z.enum(["Paris", "Lisbon", "Oslo"]), days: z.number().int().min(1).max(7) });
const results = {};

for (const [name, m] of Object.entries(providers)) {
  const errors = [];
  const stream = streamText({ model: m, prompt: "Tell me about cats.", temperature: 0, maxOutputTokens: 12,
                              onError: ({ error }) => errors.push(String(error)) });
  let streamed = "";
  let pieces = 0;
  for await (const piece of stream.textStream) { streamed += piece; pieces += 1; }
  const usage = await stream.usage;
  check(!errors.length, `${name} streamText: ${errors.join("; ")}`);
  check(streamed.length > 0 && pieces > 1, `${name} streamText: ${pieces} pieces, text ${JSON.stringify(streamed)}`);
  check(usage.outputTokens === 12 && usage.inputTokens > 0, `${name} streamText usage ${JSON.stringify(usage)}`);
  const whole = await generateText({ model: m, prompt: "Tell me about cats.", temperature: 0, maxOutputTokens: 12 });

  const { object } = await generateObject({ model: m, schema: weather, temperature: 0, maxOutputTokens: 200,
                                            prompt: "The weather where?" });

  const called = await generateText({
    model: m, temperature: 0, maxOutputTokens: 200, toolChoice: "required",
    prompt: "What is the weather like in Lisbon?",
    tools: { get_weather: tool({ description: "The weather in a city", inputSchema: weather }) },
  });
  check(called.toolCalls.length >= 1, `${name}: no tool call (${called.finishReason}, ${JSON.stringify(called.text)})`);
  const call = called.toolCalls[0];
  check(call.toolName === "get_weather" && weather.safeParse(call.input).success,
        `${name}: tool call ${JSON.stringify(call)}`);
  results[name] = { streamed, whole: whole.text, object, call: { name: call.toolName, input: call.input },
                    finish: called.finishReason };
}

const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120_000 });
const events = [];
let finalResponse = null;
let deltas = "";
const stream = await client.responses.create({ model, input: "Tell me about cats.", temperature: 0,
                                               max_output_tokens: 12, stream: true });
for await (const event of stream) {
  events.push(event.type);
  if (event.type === "response.output_text.delta") deltas += event.delta;
  if (event.type === "response.completed" || event.type === "response.incomplete") finalResponse = event.response;
}
check(finalResponse !== null, `no final event: ${events.join(",")}`);
const first = await client.responses.create({ model, input: "Tell me about cats.", temperature: 0,
                                              max_output_tokens: 12 });
check(first.output_text === deltas, `whole ${JSON.stringify(first.output_text)} vs streamed ${JSON.stringify(deltas)}`);
const second = await client.responses.create({ model, input: "And dogs?", previous_response_id: first.id,
                                               temperature: 0, max_output_tokens: 6 });
check(second.previous_response_id === first.id, "previous_response_id not echoed");
const fetched = await client.responses.retrieve(first.id);
check(fetched.id === first.id && fetched.output_text === first.output_text, "retrieve gave another response");
results.openai = { events, streamed: deltas, first: { id: first.id, text: first.output_text, usage: first.usage },
                   second: { text: second.output_text, usage: second.usage } };
console.log(JSON.stringify(results));
