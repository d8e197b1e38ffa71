"""The check of a built book site: every page visited in headless Chromium (Playwright, Debian's
chromium), and a static scan for resources loaded from other hosts.

`check_site` serves the site on 127.0.0.1 and visits every page: every image must decode, every
same-origin link must answer 200, nothing may be fetched from another host, and each page is
screenshotted to OUT/screenshots. The result is a SiteReport.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from distlab import paths
from distlab.launch import process
from distlab.publish.book_build import html_pages

CHROMIUM = Path(os.environ.get("DISTLAB_CHROMIUM", "/usr/bin/chromium"))
ENSURE_PACKAGES = paths.REPO_ROOT / "tools" / "ensure_debian_packages.sh"
# The closed network here refuses chromium's background connections unless they are switched off.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@dataclass
class SiteReport:
    html_dir: Path
    base_url: str = ""
    pages: list[str] = field(default_factory=list)
    images_checked: int = 0
    links_checked: int = 0
    broken_images: list[tuple[str, str]] = field(default_factory=list)  # (page, src)
    broken_links: list[tuple[str, str, str]] = field(default_factory=list)  # (page, url, status)
    failed_resources: list[tuple[str, str, str]] = field(default_factory=list)  # (page, url, why)
    external_requests: list[tuple[str, str]] = field(default_factory=list)  # (page, url): blocked
    page_errors: list[tuple[str, str]] = field(default_factory=list)  # uncaught JS exceptions
    console_errors: list[tuple[str, str]] = field(default_factory=list)
    screenshots: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        out = [f"{p}: image does not render: {s}" for p, s in self.broken_images]
        out += [f"{p}: link {u} -> {st}" for p, u, st in self.broken_links]
        seen = set()
        for p, u, why in self.failed_resources:
            if (p, u) not in seen:
                seen.add((p, u))
                out.append(f"{p}: resource {u} failed ({why})")
        out += [f"{p}: needs {u} from another host (blocked: pages must render offline)"
                for p, u in self.external_requests]
        out += [f"{p}: JavaScript error: {e}" for p, e in self.page_errors]
        if not self.pages:
            out.append(f"no HTML pages in {self.html_dir}")
        return out

    def summary(self) -> str:
        head = (f"checked {len(self.pages)} pages, {self.images_checked} images, "
                f"{self.links_checked} internal links; {len(self.screenshots)} screenshots")
        probs = self.problems()
        if not probs:
            return head + ": all good"
        return head + f": {len(probs)} problem(s)\n" + "\n".join(f"  {p}" for p in probs[:60])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(directory: str | Path, host: str = "127.0.0.1", timeout_s: float = 15.0) -> Iterator[str]:
    """Serve `directory` with `python -m http.server` on a free port; yield its base URL; always
    stop the server (it runs in a session of its own and is killed as a group)."""
    directory = Path(directory).resolve()
    for _attempt in range(5):
        port = free_port(host)
        proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", host, "--directory", str(directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout_s
            up = False
            while time.monotonic() < deadline and proc.poll() is None:
                with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
                    up = True
                    break
                time.sleep(0.05)
            if up:
                yield f"http://{host}:{port}"
                return
        finally:
            process.kill_group(proc.pid, grace_s=2.0)
            proc.wait()
    raise RuntimeError(f"could not start an HTTP server for {directory}")


def ensure_chromium(executable: str | Path = CHROMIUM, script: str | Path = ENSURE_PACKAGES) -> tuple[Path | None, str]:
    """Debian's chromium, installing it with tools/ensure_debian_packages.sh when missing.
    Returns (path, "") or (None, why it is not available)."""
    executable = Path(executable)
    if executable.exists():
        return executable, ""
    script = Path(script)
    if not script.exists():
        return None, f"{executable} is missing and {script} does not exist"
    res = process.run(["bash", str(script), f"{executable}:chromium"], timeout_s=900, echo=False, check=False)
    if executable.exists():
        return executable, ""
    last = "; ".join(ln for ln in res.tail[-5:] if ln.strip())
    return None, f"{executable} is missing and {script} could not install it (exit {res.returncode}: {last})"


_IMAGES_JS = """
async () => {
  const imgs = Array.from(document.images);
  for (const img of imgs) { if (img.loading === 'lazy') img.loading = 'eager'; }
  await Promise.all(imgs.map(img => img.complete ? null : new Promise(done => {
    img.addEventListener('load', done, {once: true});
    img.addEventListener('error', done, {once: true});
    setTimeout(done, 10000);
  })));
  return imgs.map(img => ({src: img.currentSrc || img.src || img.getAttribute('src') || '',
                           width: img.naturalWidth}));
}
"""
_LINKS_JS = "() => Array.from(document.querySelectorAll('a[href]')).map(a => a.href)"


def check_site(html_dir: str | Path, *, screenshots_dir: str | Path | None = None,
               chromium: str | Path | None = None, viewport: tuple[int, int] = (1280, 900),
               page_timeout_s: float = 30.0) -> SiteReport:
    """Serve a built site and visit every HTML page in headless chromium (Playwright, the system
    browser: Playwright's own download is never used). Every <img> must have decoded
    (naturalWidth > 0), every same-origin link must answer HTTP 200, no request may leave the
    origin (such requests are blocked and reported), no uncaught JavaScript error. A screenshot of
    each page goes to `screenshots_dir` (default: next to the html folder, `screenshots/`)."""
    from playwright.sync_api import Error as PlaywrightError  # deferred: only the site check needs a browser
    from playwright.sync_api import sync_playwright  # deferred: only the site check needs a browser

    html_dir = Path(html_dir).resolve()
    shots = Path(screenshots_dir) if screenshots_dir else html_dir.parent / "screenshots"
    if shots.exists():
        shutil.rmtree(shots)
    shots.mkdir(parents=True)
    exe = Path(chromium or CHROMIUM)
    if not exe.exists():
        raise FileNotFoundError(f"{exe} is missing (run tools/ensure_debian_packages.sh)")
    report = SiteReport(html_dir=html_dir)
    pages = html_pages(html_dir)
    links: dict[str, str] = {}  # url -> first page linking it

    with serve(html_dir) as base, sync_playwright() as pw:
        report.base_url = base
        origin = urllib.parse.urlsplit(base)[:2]
        browser = pw.chromium.launch(executable_path=str(exe), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]},
                                          service_workers="block")
            current = {"page": ""}

            def route(r) -> None:
                url = r.request.url
                if url.startswith(("data:", "blob:", "about:")) or urllib.parse.urlsplit(url)[:2] == origin:
                    r.continue_()
                else:
                    report.external_requests.append((current["page"], url))
                    r.abort()

            context.route("**/*", route)
            page = context.new_page()
            page.on("pageerror", lambda e: report.page_errors.append((current["page"], str(e))))
            page.on("console", lambda m: report.console_errors.append((current["page"], m.text))
                    if m.type == "error" else None)
            page.on("response", lambda resp: report.failed_resources.append(
                (current["page"], resp.url, f"HTTP {resp.status}"))
                if resp.status >= 400 and urllib.parse.urlsplit(resp.url)[:2] == origin else None)
            aborted: list[tuple[str, str]] = []

            def request_failed(req) -> None:
                if urllib.parse.urlsplit(req.url)[:2] != origin:
                    return
                if "ERR_ABORTED" in (req.failure or ""):
                    # Chromium aborts what a page still loads when the next navigation starts (a
                    # redirect page, a lazy font): re-fetched below, reported only if it is broken.
                    aborted.append((current["page"], req.url))
                else:
                    report.failed_resources.append((current["page"], req.url, req.failure or "failed"))

            page.on("requestfailed", request_failed)

            for path in pages:
                rel = path.relative_to(html_dir).as_posix()
                current["page"] = rel
                report.pages.append(rel)
                try:
                    resp = page.goto(f"{base}/{urllib.parse.quote(rel)}", wait_until="load",
                                     timeout=page_timeout_s * 1000)
                except PlaywrightError as exc:
                    report.broken_links.append((rel, rel, f"did not load: {str(exc).splitlines()[0]}"))
                    continue
                if resp is None or resp.status != 200:
                    report.broken_links.append((rel, rel, f"HTTP {resp.status if resp else 'no response'}"))
                    continue
                for img in _evaluate(page, _IMAGES_JS):
                    report.images_checked += 1
                    if not img["width"]:
                        report.broken_images.append((rel, img["src"]))
                if page.url.split("#")[0] != f"{base}/{urllib.parse.quote(rel)}":
                    current["page"] = f"{rel} -> {page.url.removeprefix(base + '/')}"  # a redirect
                for href in _evaluate(page, _LINKS_JS):
                    parts = urllib.parse.urlsplit(href)
                    if parts.scheme in ("http", "https") and parts[:2] == origin:
                        links.setdefault(urllib.parse.urlunsplit(parts._replace(fragment="")), rel)
                shot = shots / (rel.replace("/", "__").removesuffix(".html") + ".png")
                page.screenshot(path=str(shot))
                report.screenshots.append(shot)
                _settle(page, page_timeout_s)
        finally:
            browser.close()

        for page_rel, url in aborted:
            status = _http_status(url)
            if status != 200:
                report.failed_resources.append((page_rel, url, f"aborted, then {status}"))

        for url, first_page in sorted(links.items()):
            report.links_checked += 1
            status = _http_status(url)
            if status != 200:
                report.broken_links.append((first_page, url, str(status)))
    return report


def _evaluate(page, script: str, attempts: int = 5):
    """page.evaluate that survives a navigation under way (a redirect page such as index.html)."""
    from playwright.sync_api import Error  # deferred: only the site check needs a browser

    for i in range(attempts):
        try:
            return page.evaluate(script)
        except Error as exc:
            if "context was destroyed" not in str(exc) or i == attempts - 1:
                raise
            page.wait_for_load_state("load")
    return None


def _settle(page, timeout_s: float) -> None:
    """Let a page finish what it loads after `load` (MathJax, web fonts) before the next visit."""
    from playwright.sync_api import Error  # deferred: only the site check needs a browser

    try:
        page.wait_for_load_state("networkidle", timeout=timeout_s * 1000)
    except Error:
        pass  # a page that never goes idle is not broken; anything it lost is re-fetched later


def _http_status(url: str, timeout_s: float = 10.0) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            resp.read(1)
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError) as exc:
        return f"error {exc}"


def external_references(html_dir: str | Path) -> dict[str, list[str]]:
    """Static scan: absolute http(s) URLs that pages load as scripts, styles, images or fonts
    (not plain links), by page. Empty when the site is self-contained."""
    pat = re.compile(r"<(?:script|link|img|iframe|source)\b[^>]*?\b(?:src|href)=[\"'](https?:)?//([^\"']+)[\"']",
                     re.IGNORECASE)
    found: dict[str, list[str]] = {}
    for p in html_pages(html_dir):
        text = p.read_text(encoding="utf-8", errors="replace")
        for m in pat.finditer(text):
            tag = m.group(0)
            loads = re.search(r"rel=[\"'](stylesheet|preload|icon|modulepreload)", tag, re.I)
            if re.match(r"<link\b", tag, re.I) and not loads:
                continue  # <link rel="canonical"> and the like load nothing
            found.setdefault(p.relative_to(html_dir).as_posix(), []).append("//" + m.group(2))
    return found
