// The chat page's Markdown renderer (the first <script> of app/static/chat.html), run in
// Node: what it renders, and that nothing the model writes becomes markup.
// Run: node --test tests/node/markdown.test.mjs
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import vm from "node:vm";

const page = readFileSync(new URL("../../app/static/chat.html", import.meta.url), "utf8");
const source = /<script>([\s\S]*?)<\/script>/.exec(page)[1];
const sandbox = { module: { exports: {} } };
vm.runInNewContext(source, sandbox);
const { renderMarkdown } = sandbox.module.exports;

// every tag the renderer may write; anything else in the output came from the model
const OWN_TAGS = new Set(["p", "br", "pre", "code", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "blockquote",
  "ul", "ol", "li", "strong", "em", "del", "a", "table", "thead", "tbody", "tr", "th", "td"]);

function tags(html) {
  return [...html.matchAll(/<\/?([a-zA-Z][a-zA-Z0-9]*)([^>]*)>/g)].map((m) => ({ name: m[1].toLowerCase(), attrs: m[2] }));
}

function assertSafe(html) {
  for (const { name, attrs } of tags(html)) {
    assert.ok(OWN_TAGS.has(name), `unexpected tag <${name}> in ${html}`);
    assert.doesNotMatch(attrs, /\bon\w+\s*=/i, html);
    const href = /href="([^"]*)"/.exec(attrs);
    if (href) assert.match(href[1], /^https?:\/\//, html);
  }
}

test("paragraphs, emphasis, inline code and headings", () => {
  assert.equal(renderMarkdown("Hello **bold** and *it* and `x < y`"),
    "<p>Hello <strong>bold</strong> and <em>it</em> and <code>x &lt; y</code></p>");
  assert.equal(renderMarkdown("# Title\ntext"), "<h1>Title</h1><p>text</p>");
  assert.equal(renderMarkdown("a\nb\n\nc"), "<p>a<br>b</p><p>c</p>");
  assert.equal(renderMarkdown("snake_case_name stays"), "<p>snake_case_name stays</p>");
});

test("fenced code is kept as code, markup inside it escaped, and an open fence is code too", () => {
  const closed = renderMarkdown("Look:\n```python\nif a < b and **c**:\n    print('<b>')\n```\nafter");
  assert.equal(closed, '<p>Look:</p><pre><code class="language-python">if a &lt; b and **c**:\n' +
    "    print(&#39;&lt;b&gt;&#39;)</code></pre><p>after</p>");
  // mid-stream: the closing fence has not arrived yet
  assert.equal(renderMarkdown("```js\nlet x = 1;\n# not a heading"),
    '<pre><code class="language-js">let x = 1;\n# not a heading</code></pre>');
});

test("lists, nested lists, quotes, rules and tables", () => {
  assert.equal(renderMarkdown("- one\n- two **2**"), "<ul><li>one</li><li>two <strong>2</strong></li></ul>");
  assert.equal(renderMarkdown("3. c\n4. d"), '<ol start="3"><li>c</li><li>d</li></ol>');
  assert.equal(renderMarkdown("- a\n  - b"), "<ul><li>a<ul><li>b</li></ul></li></ul>");
  assert.equal(renderMarkdown("> quoted\n\n---"), "<blockquote><p>quoted</p></blockquote><hr>");
  assert.equal(renderMarkdown("| a | b |\n|---|:-:|\n| 1 | `2` |"),
    "<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>1</td><td><code>2</code></td></tr></tbody></table>");
});

test("links only to http(s)", () => {
  assert.equal(renderMarkdown("[docs](https://example.com/a?b=1&c=2)"),
    '<p><a href="https://example.com/a?b=1&amp;c=2" target="_blank" rel="noopener noreferrer">docs</a></p>');
  assert.equal(renderMarkdown("[x](javascript:alert(1))"), "<p>[x](javascript:alert(1))</p>");
});

test("no markup from the model gets through", () => {
  const attacks = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "**<img src=x onerror=alert(1)>**",
    "`</code><img src=x onerror=alert(1)>`",
    "```\n</code></pre><script>alert(1)</script>\n```",
    '[a" onmouseover="alert(1)](https://x.example/"onmouseover="alert(1))',
    "[x](https://example.com/\"><script>alert(1)</script>)",
    "- <iframe src=javascript:alert(1)>\n> <svg onload=alert(1)>",
    "| <b>h</b> |\n|---|\n| <style>*{}</style> |",
    "\u0000" + "0\u0000 `code` \u00000\u0000",
    "# <a href=javascript:alert(1)>x</a>",
  ];
  for (const text of attacks) {
    const html = renderMarkdown(text);
    assertSafe(html);
    assert.doesNotMatch(html, /<(script|img|iframe|svg|style|b)\b/i, html);
  }
});

test("every prefix of an answer, as it streams, renders without model markup", () => {
  const answer = "# Plan\n1. **read** the `<input>`\n   - nested <b>x</b>\n\n```html\n<div onclick=\"x\">\n```\n" +
    "> <img src=x onerror=alert(1)> [ok](https://example.com)\n| a | <i>b</i> |\n|---|---|\n| 1 | 2 |\n";
  for (let n = 0; n <= answer.length; n++) assertSafe(renderMarkdown(answer.slice(0, n)));
  assert.equal(renderMarkdown("- a\n  - b\n    - c\n- d"), "<ul><li>a<ul><li>b<ul><li>c</li></ul></li></ul></li><li>d</li></ul>");
});
