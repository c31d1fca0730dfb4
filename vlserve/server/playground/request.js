// The chat completion request the page sends, built from the settings and the conversation.
import { toPart } from "./media.js";

export function userMessage(text, items) {
  if (!items.length) return { role: "user", content: text };
  const content = items.map(toPart);
  if (text) content.push({ type: "text", text });
  return { role: "user", content };
}

// settings: {model, maxTokens, temperature, schema (parsed object or null)}
export function buildBody(settings, messages) {
  const body = {
    model: settings.model,
    messages,
    max_tokens: settings.maxTokens,
    temperature: settings.temperature,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (settings.schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: settings.schema } };
  }
  return body;
}

// The schema box: empty -> null; else a JSON object, or an Error saying what is wrong.
export function parseSchema(text) {
  if (!text.trim()) return null;
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    throw new Error(`JSON schema: ${e.message}`);
  }
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new Error("JSON schema: must be a JSON object");
  }
  return value;
}
