// Usage: node images.mjs BASE_URL MODEL PNG_FILE
// Sends one question with an image the two ways a Node front end does: openai-node's
// image_url part (a data: URL) and the AI SDK's openai-compatible provider's image part (bytes
// it encodes itself). Prints both answers as JSON; exits non-zero if either SDK throws.
import { readFileSync } from "node:fs";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateText } from "ai";
import OpenAI from "openai";

const [baseURL, model, file] = process.argv.slice(2);
const png = readFileSync(file);
const question = "Describe this image.";

const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120_000 });
const chat = await client.chat.completions.create({
  model, temperature: 0, max_tokens: 12,
  messages: [{ role: "user", content: [
    { type: "text", text: question },
    { type: "image_url", image_url: { url: `data:image/png;base64,${png.toString("base64")}` } },
  ] }],
});

const m = createOpenAICompatible({ name: "pageserve", baseURL, apiKey: "unused" })(model);
const sdk = await generateText({
  model: m, temperature: 0, maxOutputTokens: 12, maxRetries: 0,
  messages: [{ role: "user", content: [
    { type: "text", text: question },
    { type: "image", image: new Uint8Array(png), mediaType: "image/png" },
  ] }],
});
console.log(JSON.stringify({ openai: chat.choices[0].message.content, aisdk: sdk.text }));
