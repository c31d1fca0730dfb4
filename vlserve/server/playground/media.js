// Files the user drops or picks -> OpenAI content parts carrying data URLs (the server takes image_url,
// video_url and input_audio parts). Limits come from /playground/config.json; the server checks again.
const AUDIO_FORMATS = {
  "audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/vnd.wave": "wav",
  "audio/mpeg": "mp3", "audio/mp3": "mp3", "audio/flac": "flac", "audio/x-flac": "flac",
  "audio/ogg": "ogg", "audio/opus": "ogg", "audio/webm": "webm", "audio/mp4": "m4a", "audio/x-m4a": "m4a",
  "audio/aac": "aac", "audio/aiff": "aiff", "audio/x-aiff": "aiff",
};
const AUDIO_EXTENSIONS = ["wav", "mp3", "flac", "ogg", "opus", "webm", "m4a", "aac", "aiff"];

export function kindOf(file) {
  const kind = (file.type || "").split("/")[0];
  return ["image", "video", "audio"].includes(kind) ? kind : null;
}

function audioFormat(file) {
  if (AUDIO_FORMATS[file.type]) return AUDIO_FORMATS[file.type];
  const ext = file.name.split(".").pop().toLowerCase();
  return AUDIO_EXTENSIONS.includes(ext) ? (ext === "opus" ? "ogg" : ext) : null;
}

export function formatBytes(n) {
  if (n >= 2 ** 20) return `${(n / 2 ** 20).toFixed(1)} MiB`;
  if (n >= 1024) return `${(n / 1024).toFixed(0)} KiB`;
  return `${n} B`;
}

// Why `file` cannot be sent (a message), or null. `counts`: media already in the conversation, by kind.
export function refusal(file, limits, counts) {
  const kind = kindOf(file);
  if (!kind) return `${file.name}: not a picture, video or audio file (${file.type || "unknown type"})`;
  if (kind === "audio" && !audioFormat(file)) return `${file.name}: unknown audio format ${file.type}`;
  if (!limits) return null;
  const max = kind === "video" ? limits.max_video_bytes : limits.max_media_bytes;
  if (max && file.size > max) {
    return `${file.name} is ${formatBytes(file.size)}; this server takes at most ${formatBytes(max)} per ${kind}`;
  }
  const most = (limits.mm_per_prompt || {})[kind];
  if (most !== undefined && (counts[kind] || 0) + 1 > most) {
    return `${file.name}: at most ${most} ${kind}(s) per conversation on this server (--limit-mm-per-prompt)`;
  }
  return null;
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

export async function readMedia(file) {
  const kind = kindOf(file);
  return {
    kind, name: file.name, size: file.size, format: kind === "audio" ? audioFormat(file) : null,
    dataUrl: await readAsDataUrl(file), objectUrl: URL.createObjectURL(file),
  };
}

export function toPart(item) {
  if (item.kind === "audio") {
    const data = item.dataUrl.slice(item.dataUrl.indexOf(",") + 1);
    return { type: "input_audio", input_audio: { data, format: item.format } };
  }
  const key = item.kind === "video" ? "video_url" : "image_url";
  return { type: key, [key]: { url: item.dataUrl } };
}

// Media items in OpenAI messages, by kind (what --limit-mm-per-prompt counts: the whole conversation is one prompt).
export function countMedia(messages) {
  const counts = { image: 0, video: 0, audio: 0 };
  for (const msg of messages) {
    if (!Array.isArray(msg.content)) continue;
    for (const part of msg.content) {
      if (part.type === "image_url") counts.image += 1;
      else if (part.type === "video_url") counts.video += 1;
      else if (part.type === "input_audio") counts.audio += 1;
    }
  }
  return counts;
}

// An element showing the item (thumbnails from blob: URLs, which the CSP allows).
export function preview(item) {
  if (item.kind === "image") {
    const img = document.createElement("img");
    img.src = item.objectUrl;
    img.alt = item.name;
    return img;
  }
  const el = document.createElement(item.kind);
  el.src = item.objectUrl;
  el.controls = true;
  el.preload = "metadata";
  return el;
}
