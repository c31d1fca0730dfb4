// The last request's numbers. TTFT and tokens/s are measured here; token counts and cached_tokens come from the
// server's usage. The encoder cache line is how much the server's own counters moved while the request ran
// (labelled so: other clients' requests count too), never a guess.
import { apiFetch } from "./auth.js";

function counter(text, name) {
  let total = null;
  for (const line of text.split("\n")) {
    if (line.startsWith(`vlserve:${name}{`) || line.startsWith(`vlserve:${name} `)) {
      total = (total || 0) + parseFloat(line.slice(line.lastIndexOf(" ") + 1));
    }
  }
  return total;
}

export async function encoderCounters() {
  try {
    const res = await apiFetch("metrics");
    if (!res.ok) return null;
    const text = await res.text();
    const hits = counter(text, "encoder_cache_hits_total");
    const queries = counter(text, "encoder_cache_queries_total");
    return hits === null || queries === null ? null : { hits, queries };
  } catch {
    return null;
  }
}

export class Timer {
  constructor() { this.start = performance.now(); this.first = null; this.end = null; }
  firstToken() { if (this.first === null) this.first = performance.now(); }
  done() { this.end = performance.now(); }
}

function set(id, text) {
  document.getElementById(id).textContent = text;
}

// status: "streaming" | "done" | "stopped" | "error"; usage: the stream's usage chunk or null.
export function showStats({ status, finishReason, timer, usage, before, after }) {
  set("stat-status", finishReason ? `${status} (finish_reason: ${finishReason})` : status);
  set("stat-ttft", timer.first === null ? "-" : `${Math.round(timer.first - timer.start)} ms`);
  const tokens = usage ? usage.completion_tokens : null;
  const span = timer.first !== null && timer.end !== null ? (timer.end - timer.first) / 1000 : 0;
  set("stat-tps", tokens > 1 && span > 0 ? `${((tokens - 1) / span).toFixed(1)}` : "-");
  set("stat-tokens", usage ? `${usage.prompt_tokens} / ${usage.completion_tokens}` : "- (no usage: not finished)");
  const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null;
  if (cached === null || cached === undefined) set("stat-prefix", "-");
  else if (cached > 0) set("stat-prefix", `hit: ${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  else set("stat-prefix", "miss: no prompt tokens cached");
  if (!before || !after) {
    set("stat-encoder", "-");
  } else {
    const queries = after.queries - before.queries;
    const hits = after.hits - before.hits;
    set("stat-encoder", queries > 0
      ? `${hits} of ${queries} media items hit (whole server, while this request ran)`
      : "no media looked up (whole server, while this request ran)");
  }
  document.getElementById("stats").dataset.status = status;
  document.getElementById("stats").dataset.cached = cached === null || cached === undefined ? "" : String(cached);
}
