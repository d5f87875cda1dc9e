// The chat playground: conversations in localStorage, streaming from /v1/chat/completions (SSE), stop, regenerate,
// edit, system prompt, sampling controls, JSON schema (response_format), extra request fields, per-message TTFT,
// tok/s and token counts. Model text only ever reaches the page through markdown.js (textContent).

import { apiFetch, copyButton, el, errorMessage, wireKeyButton } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { sseData } from "./sse.js";

const CONV_STORAGE = "pagedllm.conversations";
const SETTINGS_STORAGE = "pagedllm.settings";
const MAX_CONVERSATIONS = 50;

const $ = (id) => document.getElementById(id);
const NUMBER_FIELDS = [
  // [input id, request field, integer?]
  ["temperature", "temperature", false],
  ["top_p", "top_p", false],
  ["top_k", "top_k", true],
  ["min_p", "min_p", false],
  ["max_tokens", "max_tokens", true],
  ["seed", "seed", true],
];
const TEXT_FIELDS = ["stop_strings", "json_schema", "extra_body"];

// ---------------------------------------------------------------------------------------------- state
function load(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v === null || v === undefined ? fallback : v;
  } catch (_) {
    return fallback;
  }
}

function save(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (e) {
    showBanner(`Could not save to localStorage: ${e}`);
  }
}

const state = {
  conversations: load(CONV_STORAGE, []).filter((c) => c && Array.isArray(c.messages)),
  current: null,
  models: [],
  controller: null, // AbortController of the running generation
};

function newConversation() {
  const now = Date.now();
  return { id: `c${now.toString(36)}${Math.random().toString(36).slice(2, 7)}`, title: "", system: "",
           messages: [], created: now, updated: now };
}

function persist() {
  const conv = state.current;
  if (conv && conv.messages.length) {
    conv.updated = Date.now();
    if (!state.conversations.includes(conv)) state.conversations.unshift(conv);
  }
  state.conversations.sort((a, b) => b.updated - a.updated);
  state.conversations = state.conversations.slice(0, MAX_CONVERSATIONS);
  save(CONV_STORAGE, state.conversations);
  renderConversationList();
}

// ---------------------------------------------------------------------------------------------- settings
function readSettings() {
  const s = {};
  for (const [id] of NUMBER_FIELDS) s[id] = $(id).value;
  for (const id of TEXT_FIELDS) s[id] = $(id).value;
  return s;
}

function restoreSettings() {
  const s = load(SETTINGS_STORAGE, {});
  for (const [id] of NUMBER_FIELDS) if (typeof s[id] === "string") $(id).value = s[id];
  for (const id of TEXT_FIELDS) if (typeof s[id] === "string") $(id).value = s[id];
}

function unescapeStop(s) {
  return s.replace(/\\(n|t|\\)/g, (_, c) => (c === "n" ? "\n" : c === "t" ? "\t" : "\\"));
}

// The request's sampling fields from the panel. Throws Error(message) naming the bad field.
function samplingFields() {
  const body = {};
  for (const [id, field, integer] of NUMBER_FIELDS) {
    const raw = $(id).value.trim();
    if (!raw) continue;
    const v = Number(raw);
    if (!Number.isFinite(v) || (integer && !Number.isInteger(v))) {
      throw new Error(`${field} must be ${integer ? "an integer" : "a number"}, got ${JSON.stringify(raw)}.`);
    }
    body[field] = v;
  }
  const stops = $("stop_strings").value.split("\n").filter((s) => s.length).map(unescapeStop);
  if (stops.length) body.stop = stops;
  const schemaText = $("json_schema").value.trim();
  if (schemaText) {
    let schema;
    try {
      schema = JSON.parse(schemaText);
    } catch (e) {
      throw new Error(`JSON schema is not valid JSON: ${e.message}`);
    }
    if (schema && schema.type === "json_schema" && schema.json_schema) body.response_format = schema;
    else body.response_format = { type: "json_schema",
                                  json_schema: { name: (schema && schema.title) || "response", schema, strict: true } };
  }
  const extraText = $("extra_body").value.trim();
  if (extraText) {
    let extra;
    try {
      extra = JSON.parse(extraText);
    } catch (e) {
      throw new Error(`Extra request fields are not valid JSON: ${e.message}`);
    }
    if (!extra || typeof extra !== "object" || Array.isArray(extra)) throw new Error("Extra request fields must be a JSON object.");
    Object.assign(body, extra);
  }
  return body;
}

function checkSettings() {
  save(SETTINGS_STORAGE, readSettings());
  try {
    samplingFields();
    $("settings-error").textContent = "";
    return true;
  } catch (e) {
    $("settings-error").textContent = e.message;
    return false;
  }
}

// ---------------------------------------------------------------------------------------------- rendering
function showBanner(text) {
  const b = $("banner");
  b.textContent = text;
  b.hidden = !text;
}

function renderConversationList() {
  const list = $("conv-list");
  list.replaceChildren();
  const convs = [...state.conversations];
  if (state.current && !convs.includes(state.current)) convs.unshift(state.current);
  for (const conv of convs) {
    const del = el("button", { type: "button", class: "small danger", title: "Delete this conversation", text: "×" });
    del.addEventListener("click", (ev) => {
      ev.stopPropagation();
      if (state.controller && conv === state.current) return;
      state.conversations = state.conversations.filter((c) => c !== conv);
      if (conv === state.current) state.current = state.conversations[0] || newConversation();
      persist();
      renderAll();
    });
    const li = el("li", { class: conv === state.current ? "active" : "", dataset: { id: conv.id } },
      el("span", { class: "title", text: conv.title || "New chat" }), del);
    li.addEventListener("click", () => {
      if (state.controller) return; // finish or stop the running generation first
      state.current = conv;
      renderAll();
    });
    list.append(li);
  }
}

function fmtMs(ms) {
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}

function metaLine(meta) {
  const parts = [];
  if (meta.ttft_ms !== undefined && meta.ttft_ms !== null) parts.push(`TTFT ${fmtMs(meta.ttft_ms)}`);
  if (meta.tok_s) parts.push(`${meta.tok_s.toFixed(1)} tok/s`);
  if (meta.prompt_tokens !== undefined) parts.push(`${meta.prompt_tokens} prompt + ${meta.completion_tokens} completion tokens`);
  else if (meta.chunks) parts.push(`~${meta.chunks} tokens`);
  if (meta.finish_reason) parts.push(meta.finish_reason);
  return parts.join(" · ");
}

function messageNode(msg, index, conv) {
  const isLast = index === conv.messages.length - 1;
  const busy = state.controller !== null;
  const node = el("div", { class: `msg ${msg.role}`, dataset: { index: String(index), state: msg.state || "done" } });
  node.append(el("div", { class: "role", text: msg.role === "user" ? "You" : "Assistant" }));
  const bubble = el("div", { class: "bubble" });
  if (msg.role === "user") bubble.textContent = msg.content;
  else renderMarkdown(msg.content, bubble);
  if (msg.error) bubble.append(el("div", { class: "error", text: msg.error }));
  node.append(bubble);
  const meta = el("div", { class: "meta" }, el("span", { class: "stats", text: msg.meta ? metaLine(msg.meta) : "" }));
  const actions = el("span", { class: "actions" }, copyButton(() => msg.content));
  if (msg.role === "user" && !busy) {
    const edit = el("button", { type: "button", class: "small edit", text: "Edit" });
    edit.addEventListener("click", () => startEdit(node, bubble, index));
    actions.append(edit);
  }
  if (msg.role === "assistant" && isLast && !busy) {
    const regen = el("button", { type: "button", class: "small regenerate", text: "Regenerate" });
    regen.addEventListener("click", () => regenerate());
    actions.append(regen);
  }
  meta.append(actions);
  node.append(meta);
  return node;
}

function renderMessages() {
  const box = $("messages");
  const conv = state.current;
  box.replaceChildren();
  if (!conv.messages.length) {
    box.append(el("div", { class: "empty", text: "Send a message to start. Settings are on the right." }));
  }
  conv.messages.forEach((m, i) => box.append(messageNode(m, i, conv)));
  box.scrollTop = box.scrollHeight;
}

function renderAll() {
  $("system").value = state.current.system || "";
  renderConversationList();
  renderMessages();
  setBusy(state.controller !== null);
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("new-chat").disabled = busy;
}

// ---------------------------------------------------------------------------------------------- generation
function startEdit(node, bubble, index) {
  const conv = state.current;
  const area = el("textarea", { class: "edit" });
  area.value = conv.messages[index].content;
  const saveBtn = el("button", { type: "button", class: "small primary", text: "Save & send" });
  const cancel = el("button", { type: "button", class: "small", text: "Cancel" });
  bubble.replaceChildren(area, el("div", { class: "row" }, saveBtn, cancel));
  area.focus();
  cancel.addEventListener("click", () => renderMessages());
  saveBtn.addEventListener("click", () => {
    const text = area.value.trim();
    if (!text) return;
    conv.messages = conv.messages.slice(0, index);
    conv.messages.push({ role: "user", content: text });
    generate();
  });
}

function regenerate() {
  const conv = state.current;
  if (state.controller || !conv.messages.length) return;
  if (conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
  generate();
}

function requestMessages(conv) {
  const out = [];
  const system = conv.system.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of conv.messages) {
    if (m.role === "assistant" && (m.error || m.state === "error")) continue;
    if (m.role === "assistant" && !m.content) continue;
    out.push({ role: m.role, content: m.content });
  }
  return out;
}

async function generate() {
  const conv = state.current;
  if (state.controller) return;
  let fields;
  try {
    fields = samplingFields();
  } catch (e) {
    $("settings-error").textContent = e.message;
    renderMessages();
    return;
  }
  const model = $("model").value;
  const body = { ...fields, model: model || undefined, messages: requestMessages(conv), stream: true,
                 stream_options: { include_usage: true } };
  if (!conv.title) {
    const first = conv.messages.find((m) => m.role === "user");
    conv.title = first ? first.content.slice(0, 60) : "New chat";
  }
  const msg = { role: "assistant", content: "", state: "streaming", meta: {} };
  conv.messages.push(msg);
  const controller = new AbortController();
  state.controller = controller;
  persist();
  renderAll();
  const box = $("messages");
  let node = box.lastElementChild;
  let pending = false;
  const redraw = () => {
    pending = false;
    const fresh = messageNode(msg, conv.messages.indexOf(msg), conv);
    if (node && node.parentNode === box) box.replaceChild(fresh, node);
    node = fresh;
    const nearBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    if (nearBottom) box.scrollTop = box.scrollHeight;
  };
  const schedule = () => {
    if (!pending) { pending = true; requestAnimationFrame(redraw); }
  };
  const t0 = performance.now();
  let tFirst = null;
  let chunks = 0;
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: controller.signal });
    if (!response.ok) {
      msg.error = await errorMessage(response);
      msg.state = "error";
    } else {
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        let ev;
        try { ev = JSON.parse(data); } catch (_) { continue; }
        if (ev.error) {
          msg.error = ev.error.message || JSON.stringify(ev.error);
          msg.state = "error";
          break;
        }
        for (const choice of ev.choices || []) {
          const delta = choice.delta && choice.delta.content;
          if (delta) {
            if (tFirst === null) {
              tFirst = performance.now();
              msg.meta.ttft_ms = tFirst - t0;
            }
            msg.content += delta;
            chunks++;
            msg.meta.chunks = chunks;
            schedule();
          }
          if (choice.finish_reason) msg.meta.finish_reason = choice.finish_reason;
        }
        if (ev.usage) {
          msg.meta.prompt_tokens = ev.usage.prompt_tokens;
          msg.meta.completion_tokens = ev.usage.completion_tokens;
        }
      }
      if (msg.state === "streaming") msg.state = "done";
    }
  } catch (e) {
    if (e && e.name === "AbortError") {
      msg.state = "stopped";
      msg.meta.finish_reason = "stopped";
    } else {
      msg.state = "error";
      msg.error = `Request failed: ${e}`;
    }
  } finally {
    const tEnd = performance.now();
    const n = msg.meta.completion_tokens !== undefined ? msg.meta.completion_tokens : chunks;
    // Decode speed: the tokens after the first over the time after the first.
    if (tFirst !== null && n > 1 && tEnd > tFirst) msg.meta.tok_s = (n - 1) / ((tEnd - tFirst) / 1000);
    msg.meta.total_ms = tEnd - t0;
    state.controller = null;
    persist();
    renderAll();
  }
}

function send() {
  if (state.controller) return;
  const input = $("input");
  const text = input.value.trim();
  if (!text) return;
  if (!checkSettings()) return;
  input.value = "";
  state.current.messages.push({ role: "user", content: text });
  generate();
}

function stop() {
  if (state.controller) state.controller.abort();
}

// ---------------------------------------------------------------------------------------------- start-up
async function loadModels() {
  const select = $("model");
  try {
    const r = await apiFetch("/v1/models");
    if (!r.ok) {
      showBanner(`Can't list models: ${await errorMessage(r)}`);
      return;
    }
    const body = await r.json();
    state.models = (body.data || []).map((m) => m.id);
    const prev = select.value;
    select.replaceChildren(...state.models.map((id) => el("option", { value: id, text: id })));
    if (state.models.includes(prev)) select.value = prev;
    showBanner("");
    document.body.dataset.ready = "true";
  } catch (e) {
    showBanner(`Can't reach the server: ${e}`);
  }
}

function init() {
  restoreSettings();
  state.current = state.conversations[0] || newConversation();
  $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    if (state.controller) return;
    state.current = newConversation();
    renderAll();
    $("input").focus();
  });
  $("system").addEventListener("input", () => {
    state.current.system = $("system").value;
    if (state.current.messages.length) persist();
  });
  for (const [id] of NUMBER_FIELDS) $(id).addEventListener("input", checkSettings);
  for (const id of TEXT_FIELDS) $(id).addEventListener("input", checkSettings);
  $("reset-settings").addEventListener("click", () => {
    for (const [id] of NUMBER_FIELDS) $(id).value = "";
    for (const id of TEXT_FIELDS) $(id).value = "";
    checkSettings();
  });
  wireKeyButton($("key-button"), loadModels);
  renderAll();
  checkSettings();
  loadModels();
}

init();
