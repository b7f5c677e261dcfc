"""The HTML report, opened in headless Chromium: the verdict is shown and every plot image decodes."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tracer.report.build import build_report
from tracer.report.render import render

from .conftest import quick_options

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Counts the images that actually decoded (naturalWidth > 0) once the page has loaded.
_PROBE = (
    "<script>window.addEventListener('load', () => { document.body.dataset.decodedImages ="
    " [...document.images].filter(i => i.complete && i.naturalWidth > 0).length; });</script>"
)


def test_html_report_renders_verdict_and_plots_in_headless_chromium(scenario_traces, tmp_path):
    if CHROMIUM is None:
        pytest.fail("chromium is not installed; scripts/setup.sh must install the `chromium` package")
    sc, path, _ = scenario_traces("strict-itl")
    page = render(build_report([path], quick_options(sc)), "html")
    assert "http://" not in page and "https://" not in page  # self-contained
    probed = tmp_path / "report.html"
    probed.write_text(page.replace("</body>", _PROBE + "</body>"))
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
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=5000",
            "--dump-dom",
            probed.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert re.search(r'id="verdict"[^>]*>Verdict: <strong>split \d:\d</strong>', dom)
    plots = re.findall(r'<img class="plot"', dom)
    # latency CDFs, stage breakdown, step time vs prefill tokens, why requests missed the SLO, goodput per option
    assert len(plots) == 5
    assert 'data-decoded-images="5"' in dom
