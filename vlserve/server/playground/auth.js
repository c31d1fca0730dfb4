// The API key: kept in this tab's sessionStorage (gone when the tab closes), never in the URL, and sent only to
// this page's own origin (apiFetch refuses any other; the CSP's connect-src 'self' would block it too).
const STORE = "vlserve.apiKey";

export function getKey() {
  return sessionStorage.getItem(STORE) || "";
}

export function setKey(key) {
  if (key) sessionStorage.setItem(STORE, key);
  else sessionStorage.removeItem(STORE);
}

// `path` is relative ("v1/models"), so the page also works behind a proxy that serves it under a prefix.
export function apiUrl(path) {
  const url = new URL(path, document.baseURI);
  if (url.origin !== location.origin) throw new Error(`refusing to send a request to ${url.origin}`);
  return url;
}

export function apiFetch(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const key = getKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  return fetch(apiUrl(path), { ...init, headers, credentials: "same-origin", referrerPolicy: "no-referrer" });
}

// Shows the key dialog; resolves once a key was entered. `problem`: why it is asked again (a refused key).
export function askForKey(problem = "") {
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  const error = document.getElementById("key-error");
  error.textContent = problem;
  error.hidden = !problem;
  input.value = "";
  if (!dialog.open) dialog.showModal();
  input.focus();
  return new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault(); // the key must never become a form submission (URL or body)
      const key = input.value.trim();
      if (!key) return;
      setKey(key);
      input.value = "";
      dialog.close();
      resolve(key);
    };
  });
}
