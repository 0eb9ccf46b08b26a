// ringllm chat page: one conversation at a time against this server's OpenAI-compatible API.
//
//   GET  /v1/config             model, context, the server's default KV settings and the policies it has
//   POST /v1/chat/completions   stream: true, stream_options.include_usage; the chunk with finish_reason
//                               carries "timings" and "kv_stats", the usage chunk the cached prompt tokens
//
// Conversations and settings live in localStorage (the API key in sessionStorage unless "remember" is
// ticked). Model output is only ever written with textContent / text nodes, never parsed as HTML.
// Stop aborts the fetch; the server cancels a request whose client has gone between two tokens.
"use strict";

const CHATS_KEY = "ringllm.chats.v1";
const SETTINGS_KEY = "ringllm.settings.v1";
const API_KEY_KEY = "ringllm.apiKey";

// form fields sent as request fields: id -> "int" | "float"
const SAMPLING = { temperature: "float", top_p: "float", top_k: "int", max_tokens: "int", seed: "int" };
// form fields sent inside the request's "kv" object: id -> [KVConfig field, "int" | "str"]
const KV_FIELDS = { "kv-policy": ["policy", "str"], "kv-capacity": ["capacity", "int"],
                    "kv-sinks": ["sinks", "int"], "kv-positions": ["positions", "str"] };
// settings kept in localStorage (the API key is kept apart)
const SAVED = ["system", ...Object.keys(SAMPLING), ...Object.keys(KV_FIELDS), "cache-prompt"];

const NARROW = "(max-width: 900px)";   // style.css lays the panels over the chat below this width
const $ = (id) => document.getElementById(id);

const state = {
  config: null,       // GET /v1/config, null until it answers
  chats: [],          // [{id, title, messages: [{role, content, meta?, error?}]}], newest first
  current: null,      // id of the chat shown
  busy: null,         // {controller, answer} while an answer streams
};
const views = new WeakMap();   // message -> {content, meta} elements of the chat shown

// ------------------------------------------------------------------------------------ storage

function loadJSON(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw ? JSON.parse(raw) : fallback;
  } catch (e) {
    return fallback;
  }
}

function saveJSON(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (e) {
    notice(`Could not save in this browser's storage: ${e.message}`);
  }
}

function saveChats() {
  saveJSON(CHATS_KEY, { current: state.current, chats: state.chats });
}

function saveSettings() {
  const values = {};
  for (const id of SAVED) values[id] = $(id).type === "checkbox" ? String($(id).checked) : $(id).value;
  saveJSON(SETTINGS_KEY, values);
  const key = $("api-key").value.trim();
  sessionStorage.setItem(API_KEY_KEY, key);
  if ($("remember-key").checked && key) localStorage.setItem(API_KEY_KEY, key);
  else localStorage.removeItem(API_KEY_KEY);
}

function restoreSettings() {
  const values = loadJSON(SETTINGS_KEY, {});
  for (const id of SAVED) {
    if (typeof values[id] !== "string") continue;
    if ($(id).type === "checkbox") $(id).checked = values[id] !== "false";
    else $(id).value = values[id];
  }
  const remembered = localStorage.getItem(API_KEY_KEY);
  $("remember-key").checked = Boolean(remembered);
  $("api-key").value = remembered || sessionStorage.getItem(API_KEY_KEY) || "";
}

// ------------------------------------------------------------------------------------ server

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// The message of a failed response: the server's {"error": {"message"}} when it sent one.
async function errorMessage(resp) {
  let message = resp.statusText || "no message";
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (e) { /* not JSON: keep the status text */ }
  if (resp.status === 401) {
    showSettings(true);
    $("api-key").focus();
    return `This server requires an API key: enter it under Settings (${message}).`;
  }
  return `Error ${resp.status}: ${message}`;
}

async function loadConfig() {
  let resp;
  try {
    resp = await fetch("/v1/config", { headers: headers() });
  } catch (e) {
    notice(`Cannot reach the server: ${e.message}`);
    return;
  }
  if (!resp.ok) {
    notice(await errorMessage(resp));
    return;
  }
  state.config = await resp.json();
  notice(null);
  applyConfig(state.config);
}

// Fill the KV choices and placeholders from the server's own defaults and limits.
function applyConfig(c) {
  $("model-name").textContent = c.model;
  document.title = `${c.model} · ringllm`;
  $("server-info").textContent = `context ${c.n_ctx} · server KV ${kvSummary(c.kv)}`;
  const fill = (select, values, current) => {
    const keep = select.value;
    select.replaceChildren(new Option(`default (${current})`, ""), ...values.map((v) => new Option(v, v)));
    select.value = values.includes(keep) ? keep : "";
  };
  fill($("kv-policy"), c.policies, c.kv.policy);
  fill($("kv-positions"), c.positions, c.kv.positions);
  $("kv-sinks").placeholder = String(c.kv.sinks);
  $("max_tokens").placeholder = String(c.default_max_tokens);
  $("max_tokens").max = String(c.max_tokens_cap);
  $("kv-settings").hidden = false;
  const saved = loadJSON(SETTINGS_KEY, {});      // the saved choices can be selected now that their options exist
  if (c.policies.includes(saved["kv-policy"])) $("kv-policy").value = saved["kv-policy"];
  if (c.positions.includes(saved["kv-positions"])) $("kv-positions").value = saved["kv-positions"];
  capacityHint();
}

// The capacity an empty field means: the server's, the context for a full store, or none (an
// eviction policy needs one; the server says so with a 400).
function capacityHint() {
  const c = state.config;
  if (!c) return;
  const policy = $("kv-policy").value || c.kv.policy;
  $("kv-capacity").placeholder = c.kv.capacity != null ? String(c.kv.capacity)
    : policy === "full" ? `${c.n_ctx} (context)` : `needed by ${policy}`;
}

function kvSummary(kv) {
  return kv.policy === "full" ? `full${kv.capacity ? ` ${kv.capacity}` : ""}` : `${kv.policy} ${kv.capacity}`;
}

// A number field's value (undefined when empty); an Error naming the field when it is not one.
function readNumber(id, kind) {
  const el = $(id);
  const raw = el.value.trim();
  if (el.validity.badInput) throw new Error(`${id} is not a number`);
  if (raw === "") return undefined;
  const v = Number(raw);
  if (!Number.isFinite(v) || (kind === "int" && !Number.isInteger(v))) {
    throw new Error(`${id} must be ${kind === "int" ? "an integer" : "a number"}, got ${raw}`);
  }
  return v;
}

// The request fields the settings give (sampling, kv); fields left empty are the server's defaults.
function requestSettings() {
  const out = {};
  for (const [id, kind] of Object.entries(SAMPLING)) {
    const v = readNumber(id, kind);
    if (v !== undefined) out[id] = v;
  }
  if (state.config) {
    const kv = {};
    for (const [id, [field, kind]] of Object.entries(KV_FIELDS)) {
      const v = kind === "int" ? readNumber(id, kind) : $(id).value || undefined;
      if (v !== undefined) kv[field] = v;
    }
    if (Object.keys(kv).length) out.kv = kv;
    if (!$("cache-prompt").checked) out.cache_prompt = false;     // llama-server's field; the server's default is on
  }
  return out;
}

function apiMessages(chat) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of chat.messages) {
    if (m.error || !m.content) continue;
    out.push({ role: m.role, content: m.content });
  }
  return out;
}

// The data of each server-sent event of a response, as text.
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const lines = buf.slice(0, end).split("\n");
      buf = buf.slice(end + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

// Stream one answer into `answer`, rendering it as it grows.
async function streamAnswer(answer, body) {
  const controller = new AbortController();
  state.busy = { controller, answer };
  setBusy(true);
  const t0 = performance.now();
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!resp.ok) {
      answer.error = await errorMessage(resp);
      return;
    }
    for await (const data of sseData(resp.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        answer.error = `Error: ${chunk.error.message || "the server stopped this answer"}`;
        break;
      }
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) answer.content += choice.delta.content;
        if (choice.finish_reason) answer.meta.finish = choice.finish_reason;
      }
      if (chunk.timings) answer.meta.timings = chunk.timings;
      if (chunk.kv_stats) answer.meta.kv = chunk.kv_stats;
      if (chunk.usage) answer.meta.usage = chunk.usage;
      scheduleRender(answer);
    }
    if (!answer.meta.finish && !answer.error) answer.error = "The connection closed before the answer was finished.";
  } catch (e) {
    if (e.name === "AbortError") answer.meta.finish = "stopped";
    else answer.error = `The request failed: ${e.message}`;
  } finally {
    answer.meta.wall_s = (performance.now() - t0) / 1000;
    state.busy = null;
    setBusy(false);
    saveChats();
    renderMessage(answer);
  }
}

// ------------------------------------------------------------------------------------ chats

function currentChat() {
  return state.chats.find((c) => c.id === state.current) || null;
}

function newChat() {
  const chat = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`,
                 title: "New chat", messages: [] };
  state.chats.unshift(chat);
  state.current = chat.id;
  return chat;
}

function selectChat(id) {
  stop();
  state.current = id;
  saveChats();
  renderAll();
}

function deleteChat(id) {
  if (state.busy && currentChat() && currentChat().id === id) stop();
  state.chats = state.chats.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.chats.length ? state.chats[0].id : null;
  saveChats();
  renderAll();
}

async function send(text, chat) {
  let settings;
  try {
    settings = requestSettings();
  } catch (e) {
    notice(`Settings: ${e.message}`);
    showSettings(true);
    return;
  }
  notice(null);
  if (text !== null) {
    chat.messages.push({ role: "user", content: text });
    if (chat.title === "New chat") chat.title = text.replace(/\s+/g, " ").slice(0, 60);
  }
  const body = { messages: apiMessages(chat), stream: true, stream_options: { include_usage: true }, ...settings };
  const answer = { role: "assistant", content: "", meta: {} };
  chat.messages.push(answer);
  saveChats();
  renderAll();
  await streamAnswer(answer, body);
}

function regenerate() {
  const chat = currentChat();
  if (!chat || state.busy) return;
  while (chat.messages.length && chat.messages[chat.messages.length - 1].role === "assistant") chat.messages.pop();
  if (chat.messages.length) send(null, chat);
}

function stop() {
  if (state.busy) state.busy.controller.abort();
}

// ------------------------------------------------------------------------------------ rendering

// Text with ``` fences as <pre> blocks; every piece goes in as text, never as HTML.
function renderText(el, text) {
  el.replaceChildren();
  const parts = text.split("```");
  parts.forEach((part, i) => {
    if (i % 2 === 0) {      // prose; the line breaks that frame a fence are the block's own
      if (i > 0) part = part.replace(/^\n+/, "");
      if (i < parts.length - 1) part = part.replace(/\n+$/, "");
      if (part) el.append(document.createTextNode(part));
      return;
    }
    const nl = part.indexOf("\n");
    const pre = document.createElement("pre");
    const code = document.createElement("code");
    code.textContent = nl >= 0 ? part.slice(nl + 1) : part;
    const lang = nl > 0 ? part.slice(0, nl).trim() : "";
    if (lang) pre.dataset.lang = lang;
    pre.append(code);
    el.append(pre);
  });
}

function fmt(x, digits = 1) {
  return typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : "–";
}

function fmtBytes(n) {
  return n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : `${Math.round(n / 1024)} KiB`;
}

// The line under an answer: speed, prompt, KV store, how it ended.
function renderMeta(el, m) {
  el.replaceChildren();
  const add = (cls, text, title) => {
    const span = document.createElement("span");
    span.className = cls;
    span.textContent = text;
    if (title) span.title = title;
    el.append(span);
  };
  const meta = m.meta || {};
  if (m.error) add("error", m.error);
  const t = meta.timings;
  if (t) {
    add("speed", `${t.gen_tokens} tokens · ${fmt(t.gen_tok_s)} tok/s`, "generated tokens per second (decode)");
    // usage counts the whole prompt, timings the tokens prefilled: the rest came from the prompt cache
    const u = meta.usage;
    const cached = u && u.prompt_tokens_details ? u.prompt_tokens_details.cached_tokens : 0;
    const speed = `in ${fmt(t.prompt_s, 2)} s, ${fmt(t.prompt_tok_s)} tok/s`;
    add("prompt", cached ? `prompt ${u.prompt_tokens} tok (${cached} from cache) · ${t.prompt_tokens} prefilled ${speed}`
                         : `prompt ${t.prompt_tokens} tok ${speed}`,
        "prompt tokens; those the server's prompt cache held are not prefilled again");
    if (t.compile_s > 0.05) add("compile", `compile ${fmt(t.compile_s)} s`, "first-run kernel compilation");
  } else if (state.busy && state.busy.answer === m) {
    add("speed", "generating…");
  }
  const kv = meta.kv;
  if (kv) {
    // held/capacity; evicted in tokens: the ones seen and no longer held (evicted_total counts the
    // slots of every layer and head, in the tooltip with the rest of kv_stats)
    const capacity = kv.capacity != null ? kv.capacity : state.config ? state.config.n_ctx : "?";
    let text = `KV ${kv.policy} ${kv.length}/${capacity}`;
    if (kv.tokens_seen > kv.length) text += ` · ${kv.tokens_seen - kv.length} tokens evicted`;
    if (kv.bytes) text += ` · ${fmtBytes(kv.bytes)}`;
    add("kv", text, JSON.stringify(kv, null, 1));
  }
  if (meta.finish === "stopped") add("finish", `stopped after ${fmt(meta.wall_s)} s`);
  else if (meta.finish === "length") add("finish", "cut at max_tokens");
}

function messageView(m, last) {
  const el = document.createElement("article");
  el.className = `msg ${m.role}`;
  const content = document.createElement("div");
  content.className = "content";
  renderText(content, m.content);
  el.append(content);
  const view = { content, meta: null };
  if (m.role === "assistant") {
    const meta = document.createElement("div");
    meta.className = "meta";
    renderMeta(meta, m);
    view.meta = meta;
    const actions = document.createElement("div");
    actions.className = "actions";
    if (navigator.clipboard && m.content) actions.append(button("Copy", () => navigator.clipboard.writeText(m.content)));
    if (last && !state.busy) actions.append(button("Regenerate", regenerate));
    el.append(meta, actions);
  }
  views.set(m, view);
  return el;
}

function button(text, onclick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "quiet small";
  b.textContent = text;
  b.addEventListener("click", onclick);
  return b;
}

let pending = null;
function scheduleRender(m) {
  if (pending) return;
  pending = requestAnimationFrame(() => {
    pending = null;
    renderMessage(m);
  });
}

function renderMessage(m) {
  const view = views.get(m);
  if (!view) return;       // not in the chat shown
  const box = $("messages");
  const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
  renderText(view.content, m.content);
  if (view.meta) renderMeta(view.meta, m);
  if (!state.busy && m.role === "assistant") renderChat();    // finished: actions (regenerate) come back
  if (atEnd) box.scrollTop = box.scrollHeight;
}

function renderChat() {
  const box = $("messages");
  const chat = currentChat();
  if (!chat || !chat.messages.length) {
    box.replaceChildren(emptyNote);
    return;
  }
  const last = chat.messages.length - 1;
  box.replaceChildren(...chat.messages.map((m, i) => messageView(m, i === last && m.role === "assistant")));
  box.scrollTop = box.scrollHeight;
}

function renderChatList() {
  const list = $("chat-list");
  list.replaceChildren(...state.chats.map((c) => {
    const li = document.createElement("li");
    if (c.id === state.current) li.className = "current";
    const open = button(c.title, () => selectChat(c.id));
    open.className = "open";
    open.title = c.title;
    const del = button("×", () => deleteChat(c.id));
    del.title = "Delete this chat";
    del.setAttribute("aria-label", `Delete chat ${c.title}`);
    li.append(open, del);
    return li;
  }));
}

function renderAll() {
  renderChatList();
  renderChat();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  for (const b of document.querySelectorAll(".msg .actions button")) b.disabled = busy;
}

function notice(text) {
  const el = $("notice");
  el.textContent = text || "";
  el.hidden = !text;
}

// Panels: shown beside the chat on wide screens, over it on narrow ones; the toggles flip the default.
function showSettings(show) {
  document.body.classList.toggle("settings-flip", matchMedia(NARROW).matches ? show : !show);
}

// ------------------------------------------------------------------------------------ start

const emptyNote = $("empty");

function start() {
  const saved = loadJSON(CHATS_KEY, null);
  if (saved && Array.isArray(saved.chats)) {
    state.chats = saved.chats;
    state.current = saved.current;
  }
  restoreSettings();
  renderAll();

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.busy) return;
    $("input").value = "";
    send(text, currentChat() || newChat());
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    stop();
    const empty = state.chats.find((c) => !c.messages.length);
    if (empty) state.current = empty.id;
    else newChat();
    saveChats();
    renderAll();
    document.body.classList.remove("chats-flip");
    $("input").focus();
  });
  $("clear-chats").addEventListener("click", () => {
    if (!state.chats.length || !confirm("Delete all chats kept in this browser?")) return;
    stop();
    state.chats = [];
    state.current = null;
    saveChats();
    renderAll();
  });
  $("toggle-chats").addEventListener("click", () => document.body.classList.toggle("chats-flip"));
  $("toggle-settings").addEventListener("click", () => document.body.classList.toggle("settings-flip"));
  $("close-settings").addEventListener("click", () => showSettings(false));
  $("settings-form").addEventListener("change", saveSettings);
  $("kv-policy").addEventListener("change", capacityHint);
  $("settings-form").addEventListener("submit", (e) => e.preventDefault());
  $("api-key").addEventListener("change", loadConfig);
  $("reset-settings").addEventListener("click", () => {
    for (const id of SAVED) {
      if ($(id).type === "checkbox") $(id).checked = true;
      else if (id !== "system") $(id).value = "";
    }
    saveSettings();
    capacityHint();
  });
  $("main").addEventListener("click", (e) => {     // a click beside a panel laid over a narrow page closes it
    if (matchMedia(NARROW).matches && !e.target.closest("#bar button")) {
      document.body.classList.remove("chats-flip", "settings-flip");
    }
  });
  document.addEventListener("keydown", (e) => {     // Escape closes the panels laid over a narrow page
    if (e.key === "Escape" && matchMedia(NARROW).matches) document.body.classList.remove("chats-flip", "settings-flip");
  });
  loadConfig();
}

start();
