"""Screenshots of each kind of page of the docs site, in Debian's chromium.

``python3 tools/docs_screens.py [OUT]`` builds the site as ``nox -s docs`` does, opens each
page below in headless chromium (through chromium-driver, 1280x900) and saves a PNG of
what a reader sees first into OUT (docs/screens/ by default). Look at every one before
committing it: the point is what a person sees, which no test reads.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--hide-scrollbars",
    "--window-size=1280,900",
)

SCROLL_TO = """
document.documentElement.style.scrollBehavior = "auto";
window.scrollTo(0, document.getElementById(arguments[0]).getBoundingClientRect().top - 16);
"""

#: Each kind of page: the file the screenshot goes to, the page, and where it scrolls to.
PAGES = [
    ("start.png", "index.html", ""),
    ("tutorial.png", "tutorial.html", ""),
    ("how-to.png", "embedding.html", ""),
    ("reference-index.png", "api.html", ""),
    ("reference-group.png", "reference/values.html", "cronoq_store.TaskStatus"),
    ("explanation.png", "reliability.html", ""),
]


#: What ``nox -s docs`` runs: every warning an error, every cross-reference resolved.
SPHINX_BUILD = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html"]


def build(out: Path) -> None:
    subprocess.run(
        [*SPHINX_BUILD, "docs", str(out)],
        cwd=ROOT,
        check=True,
    )


def shoot(site: Path, screens: Path) -> list[Path]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    saved = []
    with tempfile.TemporaryDirectory(prefix="cronoq-screens-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            for name, page, anchor in PAGES:
                browser.get((site / page).as_uri())
                if anchor:
                    # At once: the theme scrolls smoothly, after the screenshot was taken.
                    browser.execute_script(SCROLL_TO, anchor)
                path = screens / name
                if not browser.save_screenshot(str(path)):
                    raise RuntimeError(f"chromium saved no screenshot of {page}")
                saved.append(path)
        finally:
            browser.quit()
    return saved


def main(argv: list[str]) -> int:
    screens = Path(argv[0]) if argv else ROOT / "docs" / "screens"
    screens.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cronoq-site-") as site:
        build(Path(site))
        for path in shoot(Path(site), screens):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
