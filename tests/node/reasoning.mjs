// Usage: node reasoning.mjs BASE_URL MODEL
// A reasoning model's thinking through the Vercel AI SDK's openai-compatible provider, which
// reads delta.reasoning_content: streamText's reasoning and text, and generateText's; and
// generateText's with the provider option reasoningEffort "none" (sent as reasoning_effort).
// Prints them as one JSON line (the test compares them with the script).
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateText, streamText } from "ai";

const [baseURL, model] = process.argv.slice(2);
const m = createOpenAICompatible({ name: "pageserve", baseURL, apiKey: "unused" })(model);
const errors = [];
const stream = streamText({ model: m, prompt: "Is it?", temperature: 0, onError: ({ error }) => errors.push(String(error)) });
let streamedReasoning = "";
let streamedText = "";
for await (const part of stream.fullStream) {
  if (part.type === "reasoning-delta") streamedReasoning += part.text;
  if (part.type === "text-delta") streamedText += part.text;
}
if (errors.length) throw new Error(errors.join("; "));
const whole = await generateText({ model: m, prompt: "Is it?", temperature: 0 });
const off = await generateText({ model: m, prompt: "Is it?", temperature: 0,
  providerOptions: { pageserve: { reasoningEffort: "none" } } });
console.log(JSON.stringify({ streamedReasoning, streamedText, reasoning: whole.reasoningText, text: whole.text,
  offReasoning: off.reasoningText ?? null, offText: off.text }));
