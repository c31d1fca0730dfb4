// curl and Python (openai client) that send the same request. Media are read from files of the names the user
// picked instead of pasting megabytes of base64; the key is read from $VLSERVE_API_KEY, never written out.

// Each data URL in the body -> a placeholder, a variable and how to rebuild it from the file.
function mediaRefs(body, names) {
  const refs = [];
  const counters = { image: 0, video: 0, audio: 0 };
  const messages = body.messages.map((msg) => {
    if (!Array.isArray(msg.content)) return msg;
    const content = msg.content.map((part) => {
      const key = part.type === "input_audio" ? "input_audio" : part.type;
      const value = part.type === "input_audio" ? part.input_audio.data : (part[key] || {}).url;
      if (typeof value !== "string" || !(part.type === "input_audio" || value.startsWith("data:"))) return part;
      const item = names.get(value) || { kind: "image", name: "file" };
      counters[item.kind] += 1;
      const variable = `${item.kind.toUpperCase()}${counters[item.kind]}`;
      const prefix = part.type === "input_audio" ? "" : value.slice(0, value.indexOf(",") + 1);
      const placeholder = `@@${variable}@@`;
      refs.push({ variable, placeholder, prefix, name: item.name });
      if (part.type === "input_audio") {
        return { ...part, input_audio: { ...part.input_audio, data: placeholder } };
      }
      return { ...part, [key]: { ...part[key], url: placeholder } };
    });
    return { ...msg, content };
  });
  return { body: { ...body, messages }, refs };
}

const shellQuote = (s) => `'${s.replace(/'/g, "'\\''")}'`;

export function curlSnippet(body, names, baseUrl, withKey) {
  const { body: short, refs } = mediaRefs(body, names);
  const lines = refs.map((r) => `${r.variable}=$(base64 -w0 ${shellQuote(r.name)})`);
  let json = JSON.stringify(short, null, 2);
  // function replacements: a replacement string would treat "$'" specially
  for (const r of refs) json = json.replace(`"${r.placeholder}"`, () => `"${r.prefix}${r.placeholder}"`);
  let quoted = shellQuote(json);
  for (const r of refs) quoted = quoted.replace(r.placeholder, () => `'"$${r.variable}"'`);
  const auth = withKey ? ` \\\n  -H "Authorization: Bearer $VLSERVE_API_KEY"` : "";
  lines.push(`curl -N ${shellQuote(`${baseUrl}/chat/completions`)}${auth} \\\n  -H "Content-Type: application/json" ` +
    `-d ${quoted}`);
  return lines.join("\n");
}

// A JSON value as a Python literal (placeholders become expressions).
function py(value, refs, indent = "", flat = false) {
  const inner = `${indent}    `;
  if (value === null) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value === "string") {
    const ref = refs.find((r) => value === r.placeholder);
    if (ref) return ref.prefix ? `${JSON.stringify(ref.prefix)} + b64(${JSON.stringify(ref.name)})` :
      `b64(${JSON.stringify(ref.name)})`;
    return JSON.stringify(value);
  }
  if (typeof value === "number") return String(value);
  if (flat) return pyFlat(value, refs);
  const line = pyFlat(value, refs);
  if (line.length + indent.length < 80) return line; // short objects on one line
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return `[\n${value.map((v) => inner + py(v, refs, inner)).join(",\n")},\n${indent}]`;
  }
  const entries = Object.entries(value);
  if (!entries.length) return "{}";
  return `{\n${entries.map(([k, v]) => `${inner}${JSON.stringify(k)}: ${py(v, refs, inner)}`).join(",\n")},\n${indent}}`;
}

function pyFlat(value, refs) {
  if (Array.isArray(value)) return `[${value.map((v) => py(v, refs, "", true)).join(", ")}]`;
  return `{${Object.entries(value).map(([k, v]) => `${JSON.stringify(k)}: ${py(v, refs, "", true)}`).join(", ")}}`;
}

export function pythonSnippet(body, names, baseUrl, withKey) {
  const { body: short, refs } = mediaRefs(body, names);
  const { model, messages, stream, ...rest } = short;
  const lines = ["import base64", "import os", "", "from openai import OpenAI", ""];
  if (refs.length) {
    lines.push("", "def b64(path):", "    with open(path, \"rb\") as f:",
      "        return base64.b64encode(f.read()).decode()", "", "");
  }
  const key = withKey ? "os.environ[\"VLSERVE_API_KEY\"]" : "os.environ.get(\"VLSERVE_API_KEY\", \"none\")";
  lines.push(`client = OpenAI(base_url=${JSON.stringify(baseUrl)}, api_key=${key})`);
  lines.push(`stream = client.chat.completions.create(`);
  lines.push(`    model=${JSON.stringify(model)},`);
  lines.push(`    messages=${py(messages, refs, "    ")},`);
  lines.push(`    stream=${py(stream, refs)},`);
  for (const [k, v] of Object.entries(rest)) lines.push(`    ${k}=${py(v, refs, "    ")},`);
  lines.push(")");
  lines.push("for chunk in stream:");
  lines.push("    if chunk.choices:");
  lines.push("        print(chunk.choices[0].delta.content or \"\", end=\"\", flush=True)");
  lines.push("    if chunk.usage:");
  lines.push("        print(\"\\n\", chunk.usage)");
  return lines.join("\n");
}
