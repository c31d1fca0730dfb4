// The playground page: wires the form to this server's /v1 routes. Text from the server or the user is only ever
// set with textContent (never parsed as HTML), and no handler is inline (the CSP allows neither).
import { apiFetch, apiUrl, askForKey, getKey, setKey } from "./auth.js";
import { countMedia, formatBytes, preview, readMedia, refusal } from "./media.js";
import { buildBody, parseSchema, userMessage } from "./request.js";
import { curlSnippet, pythonSnippet } from "./snippets.js";
import { errorMessage, sseEvents } from "./sse.js";
import { encoderCounters, showStats, Timer } from "./stats.js";

const $ = (id) => document.getElementById(id);
const state = {
  config: null,
  history: [], // OpenAI messages of the finished turns
  pending: [], // media items attached to the next message
  names: new Map(), // data URL (or audio base64) -> item, to name files in the snippets
  controller: null, // AbortController of the request in flight
};

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function setState(name) {
  document.body.dataset.state = name;
  $("send").disabled = name !== "idle";
  $("stop").disabled = name !== "busy";
}

async function loadConfig() {
  const res = await fetch(apiUrl("playground/config.json"));
  state.config = res.ok ? await res.json() : { auth_required: false, limits: null };
  $("key-button").hidden = !state.config.auth_required;
}

async function loadModels(problem = "") {
  for (;;) {
    if (state.config.auth_required && (!getKey() || problem)) await askForKey(problem);
    const res = await apiFetch("v1/models");
    if (res.status === 401) {
      setKey("");
      problem = "That key was refused (401): enter it again.";
      continue;
    }
    if (!res.ok) throw new Error(`Could not list the models: ${await errorMessage(res)}`);
    const { data } = await res.json();
    const select = $("model");
    select.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
    $("model-label").textContent = data.length ? `${data[0].id} · context ${data[0].max_model_len} tokens` : "";
    return;
  }
}

function readSettings() {
  const maxTokens = Number.parseInt($("max-tokens").value, 10);
  const temperature = Number.parseFloat($("temperature").value);
  if (!(maxTokens > 0)) throw new Error("Max tokens must be a positive whole number");
  if (!(temperature >= 0)) throw new Error("Temperature must be a number >= 0");
  return { model: $("model").value, maxTokens, temperature, schema: parseSchema($("schema").value) };
}

// ---- attachments ----
async function addFiles(files) {
  showError("");
  for (const file of files) {
    const counts = countMedia([...state.history, userMessage("", state.pending)]);
    const why = refusal(file, state.config && state.config.limits, counts);
    if (why) {
      showError(why);
      continue;
    }
    const item = await readMedia(file);
    const key = item.kind === "audio" ? item.dataUrl.slice(item.dataUrl.indexOf(",") + 1) : item.dataUrl;
    state.names.set(key, item);
    state.pending.push(item);
  }
  renderAttachments();
}

function renderAttachments() {
  $("attachments").replaceChildren(...state.pending.map((item, i) => {
    const li = document.createElement("li");
    if (item.kind === "image") li.append(preview(item));
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = `${item.kind}: ${item.name} (${formatBytes(item.size)})`;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "small secondary";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `remove ${item.name}`);
    remove.addEventListener("click", () => {
      state.pending.splice(i, 1);
      renderAttachments();
    });
    li.append(name, remove);
    return li;
  }));
}

// ---- history ----
function bubble(role, text, items = []) {
  $("empty-hint").hidden = true;
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  if (items.length) {
    const media = document.createElement("div");
    media.className = "media";
    media.append(...items.map(preview));
    el.append(media);
  }
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const note = document.createElement("div");
  note.className = "note";
  note.hidden = true;
  el.append(body, note);
  $("history").append(el);
  el.scrollIntoView({ block: "end" });
  return { el, body, note };
}

function noteOn(b, text) {
  b.note.textContent = text;
  b.note.hidden = !text;
}

function updateSnippets(body) {
  const base = apiUrl("v1").href;
  const withKey = Boolean(state.config && state.config.auth_required);
  $("snippet-curl").textContent = curlSnippet(body, state.names, base, withKey);
  $("snippet-python").textContent = pythonSnippet(body, state.names, base, withKey);
}

// ---- one request ----
async function send(event) {
  event.preventDefault();
  if (state.controller) return;
  const text = $("prompt").value.trim();
  if (!text && !state.pending.length) return;
  let settings;
  try {
    settings = readSettings();
  } catch (e) {
    showError(e.message);
    return;
  }
  const message = userMessage(text, state.pending);
  const body = buildBody(settings, [...state.history, message]);
  const json = JSON.stringify(body);
  const limit = state.config && state.config.limits && state.config.limits.max_request_bytes;
  const size = new Blob([json]).size;
  if (limit && size > limit) {
    showError(`This request would be ${formatBytes(size)}; the server takes at most ${formatBytes(limit)} ` +
      "(--max-request-bytes). Remove a file or start a new chat.");
    return;
  }
  showError("");
  const items = state.pending;
  const userBubble = bubble("user", text, items);
  state.pending = [];
  renderAttachments();
  $("prompt").value = "";
  updateSnippets(body);

  const answer = bubble("assistant", "");
  answer.el.dataset.status = "streaming";
  const controller = new AbortController();
  state.controller = controller;
  setState("busy");
  const before = await encoderCounters();
  const timer = new Timer();
  let reply = "";
  let usage = null;
  let finishReason = null;
  let status = "done";
  try {
    const res = await apiFetch("v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: json, signal: controller.signal,
    });
    if (res.status === 401) setKey(""); // asked again below
    if (!res.ok) throw new Error(await errorMessage(res));
    for await (const chunk of sseEvents(res)) {
      if (chunk.error) throw new Error(`${chunk.error.code}: ${chunk.error.message}`);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        timer.firstToken();
        if (choice.delta && choice.delta.content) {
          reply += choice.delta.content;
          answer.body.textContent = reply;
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
    }
  } catch (e) {
    status = controller.signal.aborted ? "stopped" : "error";
    if (status === "error") {
      showError(e.message);
      noteOn(answer, e.message);
    } else {
      noteOn(answer, "stopped: the request was cancelled on the server");
    }
  }
  timer.done();
  state.controller = null;
  answer.el.dataset.status = status;
  if (status === "error") {
    userBubble.el.dataset.status = "error";
    // give the message back, so it can be fixed and sent again
    $("prompt").value = text;
    state.pending = items;
    renderAttachments();
  } else {
    state.history.push(message, { role: "assistant", content: reply });
    if (finishReason) noteOn(answer, `finish_reason: ${finishReason}`);
  }
  const after = status === "error" ? null : await encoderCounters();
  showStats({ status, finishReason, timer, usage, before, after });
  setState("idle"); // last: "idle" means this request's numbers are shown
  if (!getKey() && state.config.auth_required) loadModels("That key was refused (401): enter it again.");
}

function stop() {
  if (state.controller) state.controller.abort();
}

function newChat() {
  stop();
  state.history = [];
  state.pending = [];
  renderAttachments();
  $("history").replaceChildren($("empty-hint"));
  $("empty-hint").hidden = false;
  showError("");
}

async function copy(id) {
  const text = $(id).textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard (plain http off localhost): select it for Ctrl+C
    window.getSelection().selectAllChildren($(id));
  }
}

// ---- wiring ----
function wire() {
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", newChat);
  $("file-input").addEventListener("change", async (e) => {
    await addFiles([...e.target.files]);
    e.target.value = "";
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("composer").requestSubmit();
  });
  // Drops anywhere on the page attach the files (a missed drop would otherwise open the file in the tab).
  const zone = $("drop-zone");
  window.addEventListener("dragover", (e) => {
    e.preventDefault();
    zone.classList.add("over");
  });
  window.addEventListener("dragleave", (e) => {
    if (!e.relatedTarget) zone.classList.remove("over");
  });
  window.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    if (e.dataTransfer && e.dataTransfer.files.length) addFiles([...e.dataTransfer.files]);
  });
  $("key-button").addEventListener("click", () => askForKey().then(() => loadModels())
    .catch((e) => showError(e.message)));
  $("key-forget").addEventListener("click", () => {
    setKey("");
    $("key-input").value = "";
  });
  $("copy-curl").addEventListener("click", () => copy("snippet-curl"));
  $("copy-python").addEventListener("click", () => copy("snippet-python"));
}

async function main() {
  wire();
  setState("loading");
  try {
    await loadConfig();
    await loadModels();
  } catch (e) {
    showError(e.message);
  }
  setState("idle");
}

main();
