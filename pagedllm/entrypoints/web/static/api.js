// The server's API from the pages: the API key (asked once, kept in localStorage, sent as a Bearer token),
// fetch with a retry after a 401, OpenAI-shaped error messages, and small DOM helpers shared by both pages.

const KEY_STORAGE = "pagedllm.apiKey";

export function getKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

export function authHeaders(extra = {}) {
  const key = getKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// el("div", {class: "x", text: "..."}, child, ...): text goes through textContent, never HTML.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on") && typeof v === "function") node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

let dialogOpen = null;

// Asks for the API key in a modal dialog. Resolves to the key ("" if left empty), or null if cancelled.
export function askForKey(message) {
  if (dialogOpen) return dialogOpen;
  const input = el("input", { type: "password", id: "api-key-input", autocomplete: "off", placeholder: "API key" });
  const ok = el("button", { type: "submit", class: "primary", id: "api-key-save", text: "Save" });
  const cancel = el("button", { type: "button", id: "api-key-cancel", text: "Cancel" });
  const dialog = el("dialog", { id: "api-key-dialog" },
    el("form", { method: "dialog" },
      el("p", { text: message }),
      input,
      el("p", { class: "hint", text: "Kept in this browser's localStorage and sent as 'Authorization: Bearer …'." }),
      el("div", { class: "row" }, cancel, ok)));
  document.body.append(dialog);
  dialogOpen = new Promise((resolve) => {
    let result = null;
    dialog.querySelector("form").addEventListener("submit", () => { result = input.value.trim(); });
    cancel.addEventListener("click", () => dialog.close());
    dialog.addEventListener("close", () => {
      dialog.remove();
      dialogOpen = null;
      resolve(result);
    });
  });
  dialog.showModal();
  input.focus();
  return dialogOpen;
}

// fetch(path) with the key; on a 401 asks for a (new) key and tries again, until the user cancels.
export async function apiFetch(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
    if (response.status !== 401) return response;
    const key = await askForKey(getKey() ? "The server refused this API key. API key:" : "This server needs an API key:");
    if (!key) return response;
    setKey(key);
  }
}

// The message of an OpenAI-shaped error body ({"error": {"message", "param", ...}}), else the status line.
export async function errorMessage(response) {
  let text = "";
  try {
    text = await response.text();
    const body = JSON.parse(text);
    const err = body && body.error;
    if (err && err.message) return err.param ? `${err.message} (param: ${err.param})` : String(err.message);
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}${text ? ": " + text.slice(0, 300) : ""}`;
}

// Writes text to the clipboard (the async API needs a secure context; plain http on another host falls back).
export async function copyText(text) {
  try {
    if (navigator.clipboard && window.isSecureContext) {
      await navigator.clipboard.writeText(text);
      return true;
    }
  } catch (_) { /* fall back */ }
  const area = el("textarea", { class: "copy-buffer" });
  area.value = text;
  document.body.append(area);
  area.select();
  let ok = false;
  try { ok = document.execCommand("copy"); } catch (_) { ok = false; }
  area.remove();
  return ok;
}

export function copyButton(getText, label = "Copy") {
  const b = el("button", { type: "button", class: "small copy", text: label, title: "Copy to the clipboard" });
  b.addEventListener("click", async () => {
    const ok = await copyText(getText());
    b.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => { b.textContent = label; }, 1200);
  });
  return b;
}

// The key button in the header: change or forget the key.
export function wireKeyButton(button, onChange) {
  const refresh = () => { button.textContent = getKey() ? "API key ✓" : "API key"; };
  refresh();
  button.addEventListener("click", async () => {
    const key = await askForKey("API key for this server (empty to forget it):");
    if (key === null) return;
    setKey(key);
    refresh();
    if (onChange) onChange();
  });
  return refresh;
}
