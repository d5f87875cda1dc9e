// A small Markdown renderer for model output that can't inject HTML: it builds DOM nodes and puts every piece of
// model text in with textContent / createTextNode, never parsed as HTML. Raw HTML in the text stays text; links become
// anchors only for http(s) URLs; images are shown as links (nothing loads from model output).
//
// Blocks: paragraphs (single newlines kept as line breaks), ATX headings, fenced code (``` or ~~~, an unclosed fence
// while streaming renders as code so far), block quotes, bullet and numbered lists (nested by indentation), tables
// (GFM pipes), horizontal rules. Inline: `code`, **bold**, *italic* / _italic_, ~~strike~~, [links](url), bare
// http(s) URLs, backslash escapes.

import { copyButton, el } from "./api.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const HR = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

export function renderMarkdown(text, container) {
  const root = container || el("div");
  root.classList.add("md");
  root.replaceChildren(...blocks(String(text).replace(/\r\n?/g, "\n").split("\n")));
  return root;
}

function isBlockStart(line, next) {
  return FENCE.test(line) || HEADING.test(line) || HR.test(line) || QUOTE.test(line) || LIST_ITEM.test(line) ||
    (line.includes("|") && next !== undefined && TABLE_SEP.test(next) && next.includes("-"));
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) { i++; continue; }
    let m;
    if ((m = FENCE.exec(line))) {
      const fence = m[1];
      const body = [];
      i++;
      while (i < lines.length && !(lines[i].trim().startsWith(fence[0].repeat(fence.length)) &&
                                   /^\s*[`~]+\s*$/.test(lines[i]))) {
        body.push(lines[i]);
        i++;
      }
      i++; // the closing fence (or past the end)
      out.push(codeBlock(body.join("\n"), m[2]));
      continue;
    }
    if ((m = HEADING.exec(line))) {
      out.push(inline(m[2], el("h" + m[1].length)));
      i++;
      continue;
    }
    if (HR.test(line)) {
      out.push(el("hr"));
      i++;
      continue;
    }
    if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) { body.push(m[1]); i++; }
      out.push(el("blockquote", {}, ...blocks(body)));
      continue;
    }
    if ((m = LIST_ITEM.exec(line))) {
      const [node, next] = list(lines, i);
      out.push(node);
      i = next;
      continue;
    }
    if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      const [node, next] = table(lines, i);
      out.push(node);
      i = next;
      continue;
    }
    const para = [line.trim()];
    i++;
    while (i < lines.length && lines[i].trim() && !isBlockStart(lines[i], lines[i + 1])) {
      para.push(lines[i].trim());
      i++;
    }
    out.push(inline(para.join("\n"), el("p")));
  }
  return out;
}

function list(lines, start) {
  const first = LIST_ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.setAttribute("start", String(parseInt(first[2], 10)));
  let i = start;
  while (i < lines.length) {
    const m = LIST_ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const body = [m[3]];
    i++;
    // Continuation: lines indented deeper than the marker (sub-lists too), and blank lines followed by such.
    while (i < lines.length) {
      const l = lines[i];
      const lead = l.length - l.trimStart().length;
      if (l.trim() && lead > indent) { body.push(l.slice(Math.min(lead, indent + 2))); i++; continue; }
      if (!l.trim() && i + 1 < lines.length && lines[i + 1].trim() &&
          lines[i + 1].length - lines[i + 1].trimStart().length > indent) { body.push(""); i++; continue; }
      break;
    }
    const li = el("li");
    // A tight item (no blank line inside) shows its paragraphs as plain text beside any sub-list.
    const tight = !body.includes("");
    for (const b of blocks(body)) {
      if (tight && b.tagName === "P") li.append(...b.childNodes);
      else li.append(b);
    }
    node.append(li);
    while (i < lines.length && !lines[i].trim() && i + 1 < lines.length && LIST_ITEM.test(lines[i + 1]) &&
           LIST_ITEM.exec(lines[i + 1])[1].length === indent) i++;
  }
  return [node, i];
}

function cells(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(lines, start) {
  const head = cells(lines[start]);
  const aligns = cells(lines[start + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
  const node = el("table");
  const tr = el("tr");
  head.forEach((c, k) => tr.append(align(inline(c, el("th")), aligns[k])));
  node.append(el("thead", {}, tr));
  const tbody = el("tbody");
  let i = start + 2;
  while (i < lines.length && lines[i].trim() && lines[i].includes("|")) {
    const row = el("tr");
    const cs = cells(lines[i]);
    for (let k = 0; k < head.length; k++) row.append(align(inline(cs[k] || "", el("td")), aligns[k]));
    tbody.append(row);
    i++;
  }
  node.append(tbody);
  return [node, i];
}

function align(cell, how) {
  if (how) cell.style.textAlign = how;
  return cell;
}

function codeBlock(code, lang) {
  const codeEl = el("code", { text: code });
  if (lang && /^[\w+#.-]{1,30}$/.test(lang)) codeEl.className = "language-" + lang;
  return el("div", { class: "codeblock" },
    el("div", { class: "codehead" }, el("span", { text: lang || "code" }), copyButton(() => code)),
    el("pre", {}, codeEl));
}

function safeUrl(url) {
  try {
    const u = new URL(url, "http://invalid.invalid/");
    if ((u.protocol === "http:" || u.protocol === "https:") && /^https?:\/\//i.test(url)) return u.href;
  } catch (_) { /* not a URL */ }
  return null;
}

const ESCAPABLE = "\\`*_{}[]()#+-.!|~<>\"'";

// Appends the inline content of `text` to `parent` and returns parent.
export function inline(text, parent) {
  let plain = "";
  const flush = () => {
    if (plain) { parent.append(document.createTextNode(plain)); plain = ""; }
  };
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    const rest = text.slice(i);
    let m;
    if (c === "\\" && i + 1 < text.length && ESCAPABLE.includes(text[i + 1])) {
      plain += text[i + 1];
      i += 2;
      continue;
    }
    if (c === "\n") {
      flush();
      parent.append(el("br"));
      i++;
      continue;
    }
    if (c === "`" && (m = /^(`+)([\s\S]*?[^`])\1(?!`)/.exec(rest))) {
      flush();
      parent.append(el("code", { text: m[2].replace(/^ (.*) $/s, "$1") }));
      i += m[0].length;
      continue;
    }
    if ((c === "*" || c === "_" || c === "~") && (m = emphasis(text, i))) {
      flush();
      parent.append(inline(m.inner, el(m.tag)));
      i = m.end;
      continue;
    }
    if ((c === "[" || (c === "!" && text[i + 1] === "[")) &&
        (m = /^!?\[([^\]\n]{1,500})\]\(\s*<?([^()\s<>]{1,2000})>?(?:\s+"[^"\n]*")?\s*\)/.exec(rest))) {
      const url = safeUrl(m[2]);
      if (url) {
        flush();
        const a = el("a", { href: url, target: "_blank", rel: "noopener noreferrer nofollow" });
        inline(c === "!" ? "image: " + m[1] : m[1], a);
        parent.append(a);
        i += m[0].length;
        continue;
      }
    }
    if ((c === "h" || c === "H") && /[^\w/]$|^$/.test(text.slice(Math.max(0, i - 1), i)) &&
        (m = /^https?:\/\/[^\s<>()"']+[^\s<>()"'.,;:!?]/i.exec(rest))) {
      const url = safeUrl(m[0]);
      if (url) {
        flush();
        parent.append(el("a", { href: url, target: "_blank", rel: "noopener noreferrer nofollow", text: m[0] }));
        i += m[0].length;
        continue;
      }
    }
    plain += c;
    i++;
  }
  flush();
  return parent;
}

// **x** / __x__ (strong), *x* / _x_ (em), ~~x~~ (del) starting at text[i]: {tag, inner, end} or null.
function emphasis(text, i) {
  const c = text[i];
  const double = text[i + 1] === c;
  if (c === "~" && !double) return null;
  if (c === "_" && i > 0 && /\w/.test(text[i - 1])) return null; // snake_case stays as is
  const marker = double ? c + c : c;
  const startInner = i + marker.length;
  if (startInner >= text.length || /\s/.test(text[startInner])) return null;
  let j = startInner;
  while ((j = text.indexOf(marker, j + 1)) > 0) {
    if (/\s/.test(text[j - 1]) || text[j - 1] === "\\") continue;
    if (!double && text[j + 1] === c) { j++; continue; }
    if (c === "_" && j + marker.length < text.length && /\w/.test(text[j + marker.length])) continue;
    const inner = text.slice(startInner, j);
    if (!inner || inner.includes("\n\n")) return null;
    return { tag: c === "~" ? "del" : double ? "strong" : "em", inner, end: j + marker.length };
  }
  return null;
}
