"""The HTML report, opened in headless Chromium: the verdict is shown and every plot image decodes; a
screenshot of the "Why requests missed the SLO" section alone shows its text and its plot."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from tracer.report.build import build_report
from tracer.report.render import WHY_MISSED_TITLE, render

from .conftest import quick_options

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Counts the images that actually decoded (naturalWidth > 0) once the page has loaded.
_PROBE = (
    "<script>window.addEventListener('load', () => { document.body.dataset.decodedImages ="
    " [...document.images].filter(i => i.complete && i.naturalWidth > 0).length; });</script>"
)


# Leaves only the why-missed section on the page (its headings, what follows each up to the next
# heading, and its plot's figure), for a screenshot of that section alone.
_ONLY_WHY_MISSED = (
    "<script>window.addEventListener('load', () => { let keep = false;"
    " for (const el of [...document.body.children]) {"
    " if (el.tagName === 'H1' || el.tagName === 'H2') keep = el.textContent.startsWith(%r);"
    " const figure = el.tagName === 'FIGURE' && el.querySelector('img').alt === %r;"
    " if (!keep && !figure) el.style.display = 'none'; } });</script>"
) % (WHY_MISSED_TITLE, WHY_MISSED_TITLE)


def _chromium(page_file, profile, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=5000",
            *args,
            page_file.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def report_page(scenario_traces):
    if CHROMIUM is None:
        pytest.fail("chromium is not installed; scripts/setup.sh must install the `chromium` package")
    sc, path, _ = scenario_traces("strict-itl")
    return render(build_report([path], quick_options(sc)), "html")


def test_html_report_renders_verdict_and_plots_in_headless_chromium(report_page, tmp_path):
    page = report_page
    assert "http://" not in page and "https://" not in page  # self-contained
    probed = tmp_path / "report.html"
    probed.write_text(page.replace("</body>", _PROBE + "</body>"))
    dom = _chromium(probed, tmp_path / "profile", "--dump-dom").stdout
    assert re.search(r'id="verdict"[^>]*>Verdict: <strong>split \d:\d</strong>', dom)
    plots = re.findall(r'<img class="plot"', dom)
    # latency CDFs, stage breakdown, step time vs prefill tokens, why requests missed the SLO, goodput per option
    assert len(plots) == 5
    assert 'data-decoded-images="5"' in dom


def test_the_why_missed_section_is_readable_in_a_screenshot(report_page, tmp_path):
    """The section alone, as a browser paints it: its text (the heading, what the causes rest on, the
    table) and its stacked bar, which is drawn (not a blank or a broken image). The screenshot is the
    evidence a reader would get; its pixels are checked, not just the DOM."""
    from PIL import Image

    page = tmp_path / "why.html"
    page.write_text(report_page.replace("</body>", _ONLY_WHY_MISSED + _PROBE + "</body>"))
    dom = _chromium(page, tmp_path / "profile-dom", "--dump-dom").stdout
    assert 'data-decoded-images="5"' in dom  # the section's plot decodes with the rest
    shot = tmp_path / "why.png"
    _chromium(page, tmp_path / "profile-shot", "--hide-scrollbars", "--window-size=1100,1400", f"--screenshot={shot}")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1100, 1400)
    pixels = np.asarray(image).astype(int)  # [H, W, 3]
    dark = int(np.sum(pixels.sum(axis=2) < 200))  # text and axes
    coloured = int(np.sum(pixels.max(axis=2) - pixels.min(axis=2) > 80))  # the bar's cause colours
    assert dark > 2_000, f"{dark} dark pixels: the section's text is not painted"
    assert coloured > 5_000, f"{coloured} coloured pixels: the stacked bar is not painted"
