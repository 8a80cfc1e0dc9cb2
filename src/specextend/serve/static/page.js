// The page: documents, a conversation about the one shown, answers streamed from
// /v1/chat/completions with their numbers. Plain JavaScript; nothing is fetched from elsewhere.
"use strict";

const config = JSON.parse(document.getElementById("config").textContent);
const $ = (id) => document.getElementById(id);
const KEY_STORE = "specextend-api-key"; // sessionStorage: gone when the tab closes
const SYSTEM = "You answer questions about the document below. Quote it where that helps; say so when it "
  + "does not hold the answer.";

const state = { docs: [], current: -1, controller: null, countTimer: null, countSeq: 0 };

// ------------------------------------------------------------------ markdown, escaped

function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;")
    .replace(/'/g, "&#39;");
}

function inline(s) { // s is escaped already
  return s.replace(/`([^`\n]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>");
}

// A small markdown: fenced code, headings, lists, paragraphs, inline code, bold and italics.
// Everything is escaped first, so a model's text can never become markup.
function renderMarkdown(text) {
  const out = [];
  const lines = text.split("\n");
  let para = [], list = null;
  const flushPara = () => { if (para.length) { out.push("<p>" + inline(para.join("<br>")) + "</p>"); para = []; } };
  const flushList = () => { if (list) { out.push(`<${list.tag}>` + list.items.map((i) => "<li>" + inline(i) + "</li>").join("") + `</${list.tag}>`); list = null; } };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)/);
    if (fence) {
      flushPara(); flushList();
      const code = [];
      i++;
      while (i < lines.length && !/^\s*```/.test(lines[i])) code.push(lines[i++]);
      const lang = fence[1] ? ` class="language-${escapeHtml(fence[1])}"` : "";
      out.push(`<pre><code${lang}>` + escapeHtml(code.join("\n")) + "</code></pre>");
      continue;
    }
    const esc = escapeHtml(line);
    const heading = esc.match(/^(#{1,4})\s+(.*)$/);
    const bullet = esc.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = esc.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      flushPara(); flushList();
      const n = heading[1].length + 1; // h2..h5: the page's own title is the h1
      out.push(`<h${n}>` + inline(heading[2]) + `</h${n}>`);
    } else if (bullet || numbered) {
      flushPara();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      if (!list) list = { tag, items: [] };
      list.items.push((bullet || numbered)[1]);
    } else if (!esc.trim()) {
      flushPara(); flushList();
    } else {
      flushList();
      para.push(esc);
    }
  }
  flushPara(); flushList();
  return out.join("");
}

// ------------------------------------------------------------------ the server

function apiKey() { return sessionStorage.getItem(KEY_STORE) || ""; }

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function showKeyField() {
  $("key-box").hidden = false;
}

// A failed response as one sentence for a person: what went wrong and what to do.
async function describeError(resp) {
  let message = "";
  let code = null;
  try {
    const body = await resp.json();
    if (body && body.error) { message = body.error.message || ""; code = body.error.code; }
  } catch (e) { /* not JSON: the status says it */ }
  if (resp.status === 401) {
    showKeyField();
    return (apiKey() ? "The API key was refused. " : "This server needs an API key. ")
      + "Type it in the API key field above, then send again.";
  }
  if (resp.status === 429) {
    const wait = resp.headers.get("Retry-After");
    return "The server is busy" + (wait ? `; try again in ${wait} s.` : "; try again shortly.")
      + (message ? ` (${message})` : "");
  }
  if (resp.status === 413 || code === "context_length_exceeded" || code === "kv_budget_exceeded") {
    return "The document is too long for this server: " + (message || `HTTP ${resp.status}`)
      + ". Shorten it, or ask for fewer max tokens.";
  }
  return `The server answered ${resp.status}: ` + (message || resp.statusText || "no message");
}

// ------------------------------------------------------------------ documents

function newDoc(name, text) {
  state.docs.push({ name: name || `Document ${state.docs.length + 1}`, text: text || "", messages: [], count: null });
  selectDoc(state.docs.length - 1);
}

function doc() { return state.docs[state.current]; }

function selectDoc(i) {
  if (state.controller) return; // not while an answer streams
  state.current = i;
  $("doc-name").value = doc().name;
  $("doc-text").value = doc().text;
  renderTabs();
  renderMessages();
  showCount();
  scheduleCount(0);
}

function renderTabs() {
  const tabs = $("doc-tabs");
  tabs.replaceChildren();
  state.docs.forEach((d, i) => {
    const b = document.createElement("button");
    b.type = "button";
    b.setAttribute("role", "tab");
    b.setAttribute("aria-selected", i === state.current ? "true" : "false");
    b.textContent = d.name || `Document ${i + 1}`;
    b.title = d.name;
    b.addEventListener("click", () => selectDoc(i));
    tabs.appendChild(b);
  });
}

function documentMessage(d) {
  return { role: "system", content: `${SYSTEM}\n\n# ${d.name}\n\n${d.text}` };
}

// The conversation sent with a question: the document first (the same prefix every time, so the
// server's prefix cache reuses its prefill), then the earlier questions and answers, then this one.
function conversation(d, question) {
  const msgs = [documentMessage(d)];
  for (const m of d.messages) {
    if ((m.role === "user" || m.role === "assistant") && m.done) msgs.push({ role: m.role, content: m.content });
  }
  msgs.push({ role: "user", content: question });
  return msgs;
}

function scheduleCount(delay) {
  clearTimeout(state.countTimer);
  state.countTimer = setTimeout(countTokens, delay === undefined ? 400 : delay);
}

async function countTokens() {
  const d = doc();
  if (!d) return;
  if (!d.text.trim()) { d.count = null; showCount(); return; }
  const seq = ++state.countSeq;
  try {
    const resp = await fetch("/v1/tokenize", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ messages: [documentMessage(d), { role: "user", content: "?" }], ...settings() }),
    });
    if (seq !== state.countSeq) return;
    d.count = resp.ok ? await resp.json() : { error: await describeError(resp) };
  } catch (e) {
    if (seq !== state.countSeq) return;
    d.count = { error: "Cannot reach the server: " + e.message };
  }
  showCount();
}

function showCount() {
  const d = doc(), info = $("doc-info");
  info.classList.remove("bad");
  if (!d || !d.text.trim()) { info.textContent = "No document yet: paste one or open a file."; return; }
  const c = d.count;
  if (!c) { info.textContent = `${d.text.length.toLocaleString()} characters; counting tokens…`; return; }
  if (c.error) { info.textContent = c.error; info.classList.add("bad"); return; }
  const fits = `${c.tokens.toLocaleString()} tokens (with the instructions) of a ${c.context.toLocaleString()}-token context`;
  if (c.fits) {
    info.textContent = `${fits}: fits, with ${c.max_tokens.toLocaleString()} tokens for the answer.`;
  } else {
    info.textContent = `${fits}: too long (${c.message}).`;
    info.classList.add("bad");
  }
}

async function openFile(file) {
  const info = $("doc-info");
  info.classList.remove("bad");
  try {
    let text;
    if (/\.pdf$/i.test(file.name) || file.type === "application/pdf") {
      info.textContent = `Reading ${file.name} (PDF) on the server…`;
      const resp = await fetch("/v1/extract", {
        method: "POST", headers: headers({ "Content-Type": "application/pdf" }), body: file,
      });
      if (!resp.ok) throw new Error(await describeError(resp));
      text = (await resp.json()).text;
    } else {
      text = await file.text();
    }
    const d = doc();
    if (d && !d.text.trim() && !d.messages.length) { // an empty document takes the file
      d.name = file.name; d.text = text;
      selectDoc(state.current);
    } else {
      newDoc(file.name, text);
    }
  } catch (e) {
    info.textContent = `Cannot open ${file.name}: ${e.message}`;
    info.classList.add("bad");
  }
}

// ------------------------------------------------------------------ the conversation

function settings() {
  const out = { method: $("method").value };
  const max = parseInt($("max-tokens").value, 10);
  if (max > 0) out.max_tokens = max;
  const t = parseFloat($("temperature").value);
  if (!Number.isNaN(t)) out.temperature = t;
  return out;
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const d = doc();
  if (!d || !d.messages.length) {
    const p = document.createElement("p");
    p.className = "info";
    p.textContent = "Ask a question about the document. The first question reads the whole document; "
      + "the next ones reuse it from the server's cache.";
    box.appendChild(p);
    return;
  }
  for (const m of d.messages) box.appendChild(renderMessage(m));
  box.scrollTop = box.scrollHeight;
}

function renderMessage(m) {
  const el = document.createElement("div");
  el.className = "msg " + m.role;
  m.el = el;
  if (m.role === "user") { el.textContent = m.content; return el; }
  if (m.role === "error") { el.setAttribute("role", "alert"); el.textContent = m.content; return el; }
  const body = document.createElement("div");
  body.className = "body";
  el.appendChild(body);
  updateAnswer(m);
  return el;
}

function updateAnswer(m) {
  const el = m.el;
  if (!el) return;
  const body = el.querySelector(".body");
  // A reasoning model's thought (reasoning_content) above its answer: open while it thinks, folded
  // once the answer starts unless the reader opened it.
  const thought = m.reasoning
    ? `<details class="thought"${(m.thoughtOpen ?? !m.content) ? " open" : ""}><summary>${
      m.content || m.done || m.stopped ? "Thought" : "Thinking…"}</summary><div>${escapeHtml(m.reasoning)}</div></details>`
    : "";
  body.innerHTML = thought + renderMarkdown(m.content) + (m.stopped ? "<p><em>(stopped)</em></p>" : "");
  const details = body.querySelector("details.thought");
  if (details) details.addEventListener("toggle", () => { m.thoughtOpen = details.open; });
  let bar = el.querySelector(".progress");
  if (m.progress && !m.content && !m.reasoning) {
    if (!bar) {
      bar = document.createElement("div");
      bar.className = "progress";
      bar.innerHTML = '<span class="label"></span><progress></progress>';
      el.appendChild(bar);
    }
    const [done, total] = m.progress;
    const p = bar.querySelector("progress");
    p.max = total; p.value = done;
    p.setAttribute("aria-label", "Reading the document");
    bar.querySelector(".label").textContent = `Reading the document: ${done.toLocaleString()} / ${total.toLocaleString()} tokens`;
  } else if (bar) {
    bar.remove();
  }
  if (!m.progress && !m.content && !m.reasoning && !m.done && !m.stopped) body.innerHTML = '<p class="info">Waiting for the first token…</p>';
  let stats = el.querySelector(".stats");
  if (m.stats) {
    if (!stats) { stats = document.createElement("div"); stats.className = "stats"; el.appendChild(stats); }
    stats.innerHTML = m.stats.map(([k, v, title]) => `<span title="${escapeHtml(title)}">${escapeHtml(k)} <b>${escapeHtml(v)}</b></span>`).join("");
  }
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function statsOf(m, usage) {
  const out = [];
  if (m.ttft !== undefined) out.push(["first token", `${m.ttft.toFixed(2)} s`, "time from sending to the first token of the answer"]);
  if (!usage) return out;
  const spec = usage.speculative || {};
  const cached = spec.cached_prompt_tokens ?? (usage.prompt_tokens_details || {}).cached_tokens ?? 0;
  out.push(["from cache", `${cached.toLocaleString()} / ${usage.prompt_tokens.toLocaleString()} prompt tokens`,
    "prompt tokens whose prefill the server reused from its prefix cache"]);
  if (spec.decode_s > 0) out.push(["decode", `${(usage.completion_tokens / spec.decode_s).toFixed(1)} tok/s`,
    `${usage.completion_tokens} tokens in ${spec.decode_s.toFixed(2)} s`]);
  if (spec.accepted_per_step) out.push(["per step", `${spec.accepted_per_step.toFixed(2)} tokens`,
    "tokens accepted per target forward pass (1 without speculation)"]);
  if (spec.method) out.push(["method", spec.method, "the decoding method that ran"]);
  return out;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("new-doc").disabled = busy;
  for (const b of $("doc-tabs").querySelectorAll("button")) b.disabled = busy;
}

function addMessage(d, m) {
  d.messages.push(m);
  if (d === doc()) {
    if (d.messages.length === 1) renderMessages();
    else $("messages").appendChild(renderMessage(m));
  }
  return m;
}

async function ask() {
  const d = doc();
  const question = $("question").value.trim();
  if (!d || !question || state.controller) return;
  if (!d.text.trim()) {
    addMessage(d, { role: "error", content: "There is no document yet: paste one or open a file first." });
    return;
  }
  const messages = conversation(d, question);
  $("question").value = "";
  addMessage(d, { role: "user", content: question, done: true });
  const m = addMessage(d, { role: "assistant", content: "", done: false });
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let usage = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal, headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ model: config.model, messages, stream: true, stream_options: { include_usage: true },
        ...settings() }),
    });
    if (!resp.ok) {
      d.messages.splice(d.messages.indexOf(m), 1);
      m.el.remove();
      addMessage(d, { role: "error", content: await describeError(resp) });
      return;
    }
    for await (const event of sse(resp.body)) {
      if (event.comment !== undefined) {
        const p = event.comment.match(/^prefill (\d+)\/(\d+)/);
        if (p) { m.progress = [parseInt(p[1], 10), parseInt(p[2], 10)]; updateAnswer(m); }
        continue;
      }
      if (event.data === "[DONE]") break;
      const chunk = JSON.parse(event.data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && (delta.content || delta.reasoning_content)) {
        if (m.ttft === undefined) m.ttft = (performance.now() - t0) / 1000;
        m.content += delta.content || "";
        m.reasoning = (m.reasoning || "") + (delta.reasoning_content || "");
        m.progress = null;
        updateAnswer(m);
      }
    }
    m.done = true;
  } catch (e) {
    if (e.name === "AbortError") {
      m.stopped = true;
    } else {
      addMessage(d, { role: "error", content: "The answer failed: " + e.message });
    }
  } finally {
    m.progress = null;
    m.stats = statsOf(m, usage);
    if (m.stopped) m.done = !!m.content; // a stopped answer stays in the conversation as far as it got
    updateAnswer(m);
    state.controller = null;
    setBusy(false);
    $("question").focus();
  }
}

// Server-sent events from a response body: {data} for a data line, {comment} for a comment line.
async function* sse(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let at;
    while ((at = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, at);
      buf = buf.slice(at + 2);
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) yield { comment: line.slice(1).trim() };
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { data: data.join("\n") };
    }
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

// ------------------------------------------------------------------ wiring

function init() {
  for (const name of config.methods) {
    const o = document.createElement("option");
    o.value = o.textContent = name;
    $("method").appendChild(o);
  }
  $("method").value = config.method;
  $("max-tokens").value = config.max_tokens;
  $("temperature").value = config.temperature;
  if (config.needs_key || apiKey()) showKeyField();
  $("api-key").value = apiKey();
  $("api-key").addEventListener("input", (e) => {
    const v = e.target.value.trim();
    if (v) sessionStorage.setItem(KEY_STORE, v); else sessionStorage.removeItem(KEY_STORE);
    scheduleCount();
  });
  for (const id of ["method", "max-tokens"]) $(id).addEventListener("change", () => scheduleCount(0));
  $("doc-text").addEventListener("input", (e) => { doc().text = e.target.value; doc().count = null; showCount(); scheduleCount(); });
  $("doc-name").addEventListener("input", (e) => { doc().name = e.target.value; renderTabs(); scheduleCount(); });
  $("new-doc").addEventListener("click", () => { newDoc(); $("doc-text").focus(); });
  $("file").addEventListener("change", (e) => { if (e.target.files[0]) openFile(e.target.files[0]); e.target.value = ""; });
  $("send").addEventListener("click", ask);
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => { if (!state.controller) { doc().messages = []; renderMessages(); } });
  $("question").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); ask(); }
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
  newDoc();
}

init();
