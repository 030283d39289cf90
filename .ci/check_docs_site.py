"""Open every page of the built docs site in headless Chromium, offline; check what readers see.

    python .ci/check_docs_site.py SITE_DIR [--screenshots DIR] [--chromium PATH]

Serves SITE_DIR on loopback, refuses every request that would leave the machine (so a page
that needs a CDN shows it), and fails when a page has:

* a Mermaid diagram that did not become an SVG, or shows Mermaid's error message;
* a literal Sphinx role (``:meth:`x```), or a blockquote nested in a blockquote (a doctest
  rendered as quoted text);
* an image that did not load;
* a table wider than the page's content column at 1280 px (columns pushed off-screen);
* a code block whose text is wider than its box at 1280 px (lines cut off behind a scroll bar);
* a heading wider than the page's content column at 1280 px (an API signature on one line);
* diagram text (Mermaid) drawn smaller than 11 px at 1280 px.

A full-page screenshot of each page goes to the screenshots folder (git-ignored).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

from playwright.sync_api import Page, Route, sync_playwright

ROLE = re.compile(r":(?:func|meth|class|attr|mod|exc|data|obj|py:\w+):(?=[`\w~.])")
DIAGRAM = re.compile(r"^\s*(?:sequenceDiagram|gantt|graph|flowchart|classDiagram|stateDiagram)")
MERMAID_ERRORS = ("Syntax error in text", "Parse error", "Lexical error")
SMALLEST_DIAGRAM_TEXT_PX = 11

CHECKS_JS = """
() => {
  const problems = [];
  for (const img of document.querySelectorAll("img")) {
    if (!img.complete || img.naturalWidth === 0) problems.push(`image not loaded: ${img.src}`);
  }
  const column = document.querySelector(".md-content__inner") || document.body;
  const limit = column.getBoundingClientRect().right + 1;
  for (const table of document.querySelectorAll("article table")) {
    const right = table.getBoundingClientRect().left + table.scrollWidth;
    if (right > limit) {
      const row = table.querySelector("tr") || table;
      const head = row.innerText.slice(0, 60).replace(/\\s+/g, " ");
      problems.push(`table wider than the page (${Math.round(right - limit)} px): ${head}`);
    }
  }
  for (const pre of document.querySelectorAll("article pre")) {
    if (pre.closest(".mermaid")) continue;
    const code = pre.querySelector("code") || pre;
    if (code.scrollWidth > pre.clientWidth + 1) {
      const lines = code.innerText.split("\\n");
      const widest = lines.reduce((a, b) => (b.length > a.length ? b : a), "").trim();
      const over = code.scrollWidth - pre.clientWidth;
      problems.push(`code block wider than its box (${over} px): ${widest.slice(0, 70)}`);
    }
  }
  for (const heading of document.querySelectorAll("article :is(h1, h2, h3, h4)")) {
    const right = heading.getBoundingClientRect().left + heading.scrollWidth;
    if (right > limit) {
      const text = heading.innerText.slice(0, 70).replace(/\\s+/g, " ");
      problems.push(`heading wider than the page (${Math.round(right - limit)} px): ${text}`);
    }
  }
  if (document.querySelector("article blockquote blockquote")) {
    problems.push("a blockquote nested in a blockquote (a doctest shown as quoted text)");
  }
  return problems;
}
"""

# The size a diagram's text is drawn at: its font size times the scale of the SVG transform
# that places it (a diagram shrunk to fit the column shrinks its text with it).
DIAGRAM_TEXT_JS = """
(smallest) => {
  const small = [];
  for (const block of document.querySelectorAll("div.mermaid")) {
    const root = block.shadowRoot || block;
    const svg = root.querySelector("svg");
    if (!svg) continue;
    const walker = document.createTreeWalker(svg, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const text = node.textContent.trim();
      const element = node.parentElement;
      if (!text || !element) continue;
      const placed = element.closest("foreignObject") || element.closest("text") || element;
      if (!placed.getScreenCTM) continue;
      const ctm = placed.getScreenCTM();
      if (!ctm) continue;
      const size = parseFloat(getComputedStyle(element).fontSize) * Math.hypot(ctm.a, ctm.b);
      if (size < smallest) small.push(`${size.toFixed(1)} px: ${text.slice(0, 40)}`);
    }
  }
  return small;
}
"""

# Material for MkDocs renders each diagram into the shadow root of a div.mermaid; a diagram
# it could not render stays a <pre> showing its source.
MERMAID_JS = """
() => ({
  rendered: Array.from(document.querySelectorAll("div.mermaid")).map((block) => {
    const root = block.shadowRoot || block;
    return {svg: !!root.querySelector("svg"), text: root.textContent.slice(0, 300)};
  }),
  sources: Array.from(document.querySelectorAll("pre")).map((pre) => pre.innerText.slice(0, 80)),
})
"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def pages_of(site: Path) -> list[str]:
    """The site's pages, as paths relative to its root (``""`` for the home page)."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        relative = index.parent.relative_to(site).as_posix()
        if relative.startswith(("assets", "search")) or relative == "404":
            continue
        pages.append("" if relative == "." else relative + "/")
    return pages


def check_page(page: Page, url: str, diagrams: int) -> list[str]:
    """The problems a reader would see on the page at ``url`` (``diagrams``: Mermaid blocks)."""
    page.goto(url, wait_until="load")
    problems: list[str] = []
    if diagrams:
        # Mermaid renders after load: give it a few seconds to draw every diagram.
        try:
            page.wait_for_function(
                f"() => document.querySelectorAll('div.mermaid').length >= {diagrams}",
                timeout=8000,
            )
            page.wait_for_timeout(500)
        except Exception:
            pass
    found = page.evaluate(MERMAID_JS)
    rendered = [block for block in found["rendered"] if block["svg"]]
    if len(rendered) < diagrams:
        problems.append(f"{diagrams - len(rendered)} of {diagrams} Mermaid diagrams not rendered")
    for source in found["sources"]:
        if DIAGRAM.match(source):
            problems.append(f"Mermaid source shown as text: {source.splitlines()[0]!r}")
    for block in found["rendered"]:
        if any(error in block["text"] for error in MERMAID_ERRORS):
            problems.append(f"a Mermaid diagram shows an error: {block['text'][:80]!r}")
    text = page.inner_text("article") if page.query_selector("article") else ""
    for role in sorted(set(ROLE.findall(text))):
        problems.append(f"literal Sphinx role {role}")
    problems += page.evaluate(CHECKS_JS)
    small = page.evaluate(DIAGRAM_TEXT_JS, SMALLEST_DIAGRAM_TEXT_PX)
    if small:
        problems.append(
            f"{len(small)} diagram label(s) under {SMALLEST_DIAGRAM_TEXT_PX} px, e.g. {small[0]}"
        )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("--screenshots", type=Path, default=Path("docs-screenshots"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    options = parser.parse_args()
    options.screenshots.mkdir(parents=True, exist_ok=True)
    server, root = serve(options.site)
    failures: dict[str, list[str]] = {}
    leaving: list[str] = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=options.chromium,
                args=[
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                ],
            )
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            # Material draws diagrams in closed shadow roots; open them so they can be read.
            page.add_init_script(
                "const attach = Element.prototype.attachShadow;"
                "Element.prototype.attachShadow = function (init) {"
                "  return attach.call(this, {...init, mode: 'open'}); };"
            )

            def offline(route: Route) -> None:
                host = urlparse(route.request.url).hostname
                if host in ("127.0.0.1", "localhost"):
                    route.continue_()
                else:  # the site must work without the network: no CDN
                    leaving.append(route.request.url)
                    route.abort()

            page.route("**/*", offline)
            for path in pages_of(options.site):
                html = (options.site / path / "index.html").read_text()
                problems = check_page(page, root + path, html.count('<pre class="mermaid">'))
                name = path.strip("/").replace("/", "-") or "index"
                page.screenshot(path=str(options.screenshots / f"{name}.png"), full_page=True)
                if problems:
                    failures[path or "/"] = problems
                print(f"{'FAIL' if problems else 'ok  '} /{path}")
            browser.close()
    finally:
        server.shutdown()
    for url in sorted(set(leaving)):
        print(f"request refused (offline): {url}")
    for path, problems in failures.items():
        for problem in problems:
            print(f"/{path.strip('/')}: {problem}")
    print(f"{len(failures)} page(s) with problems; screenshots in {options.screenshots}/")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
