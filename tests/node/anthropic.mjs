// Usage: node anthropic.mjs BASE_URL MODEL API_KEY
// The Vercel AI SDK's Anthropic provider against /v1/messages: a streamed answer with a tool the
// model may call, then the same request whole. Prints both as JSON (thinking, text, tool calls,
// finish reason, usage); exits non-zero if the SDK throws.
import { createAnthropic } from "@ai-sdk/anthropic";
import { generateText, streamText, tool } from "ai";
import { z } from "zod";

const [baseURL, model, apiKey] = process.argv.slice(2);
const anthropic = createAnthropic({ baseURL: `${baseURL}/v1`, apiKey });
const request = {
  model: anthropic(model),
  maxOutputTokens: 200,
  temperature: 0,
  maxRetries: 0,
  tools: { note: tool({ description: "Write a note", inputSchema: z.object({ text: z.string() }) }) },
  prompt: "Note the colours",
};

const streamed = streamText(request);
let parts = 0;
for await (const part of streamed.fullStream) {
  if (part.type === "error") throw part.error;
  parts += 1;
}
const whole = await generateText(request);
const summary = async (r) => ({
  reasoning: await r.reasoningText,
  text: await r.text,
  calls: (await r.toolCalls).map((c) => ({ name: c.toolName, input: c.input })),
  finish: await r.finishReason,
  outputTokens: (await r.usage).outputTokens,
});
console.log(JSON.stringify({ streamed: await summary(streamed), whole: await summary(whole), parts }));
