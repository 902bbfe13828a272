"""The explorer in a real browser: Voilà serves tests/browser/explorer.ipynb, Chromium drives it.

The server and the browser are started and stopped here, on 127.0.0.1 only; every wait has a
deadline. Chromium is Debian's (installed with apt-get when missing and running as root), driven
by the Python ``playwright`` package through ``executable_path``: no browser is downloaded.
Screenshots go to ``tests/artifacts/``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "tests" / "browser" / "explorer.ipynb"
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium's own connections fail on a closed network.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
APT_S = 900  # apt-get update + install chromium on a fresh machine
SERVER_S = 60  # Voilà answering HTTP
RENDER_S = 420  # page request -> kernel start, two replays on CPU, widgets drawn
UPDATE_S = 30  # one widget interaction -> the views redrawn by the kernel
STACKS_S = RENDER_S - 15  # kernel start -> its stacks written (a failed render shows them)
TOKEN_ID = re.compile(r"token id (\d+)")
N_TOKENS = re.compile(r"\((\d+) tok")
_BLANK = ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)")


def _require_module(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.fail(
            f"the browser test needs the Python package {name!r}: "
            "pip install -e '.[notebook,dev]' (make install does)"
        )


@pytest.fixture(scope="module")
def chromium() -> Path:
    """Debian's Chromium, installed with apt-get when missing (CI must prove the browser path)."""
    if CHROMIUM.is_file():
        return CHROMIUM
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail(f"{CHROMIUM} is missing; install it: apt-get install -y chromium")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
            subprocess.run(cmd, env=env, check=True, timeout=APT_S, capture_output=True, text=True)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(err.cmd)} took more than {APT_S} s")
    except subprocess.CalledProcessError as err:
        pytest.fail(f"{' '.join(err.cmd)} failed ({err.returncode}):\n{err.stderr[-2000:]}")
    if not CHROMIUM.is_file():
        pytest.fail(f"apt-get installed chromium but {CHROMIUM} is missing")
    return CHROMIUM


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Stop Voilà and the kernels it started (jupyter_client puts each in its own session)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        child.kill()


def _log_tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else ""


def _dump_kernel_stacks(ipython_dir: Path, out: Path) -> None:
    """Make the notebook kernel write every thread's stack to ``out`` STACKS_S after it
    starts, shortly before RENDER_S runs out, so a render that times out says where the
    kernel was: an IPython startup file arms :func:`faulthandler.dump_traceback_later`,
    whose own thread writes even while the kernel's main thread holds the GIL in C code."""
    startup = ipython_dir / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-dump-stacks.py").write_text(
        "import faulthandler\n"
        f"_trace_replay_stacks = open({str(out)!r}, 'w')\n"
        f"faulthandler.dump_traceback_later({STACKS_S}, file=_trace_replay_stacks)\n"
    )


def _busiest_processes(n: int = 8) -> str:
    """The processes using the most CPU over one second: what competed with the kernel."""
    import psutil

    procs = list(psutil.process_iter(["pid", "name", "cmdline", "memory_info"]))
    for proc in procs:
        try:
            proc.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(1.0)
    rows = []
    for proc in procs:
        try:
            rows.append((proc.cpu_percent(None), proc.info))
        except psutil.Error:
            pass
    rows.sort(key=lambda row: -row[0])
    return "\n".join(
        f"{cpu:5.0f}% {info['pid']:>7} "
        f"{(info['memory_info'].rss if info['memory_info'] else 0) >> 20:>6} MiB "
        f"{' '.join(info['cmdline'] or [info['name'] or ''])[:120]}"
        for cpu, info in rows[:n]
    )


@pytest.fixture(scope="module")
def voila(tmp_path_factory):
    """URL of a Voilà server on 127.0.0.1 serving the explorer notebook; its log path."""
    _require_module("voila")
    _require_module("ipywidgets")
    tmp = tmp_path_factory.mktemp("voila")
    port, log = _free_port(), tmp / "voila.log"
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_DATA_DIR=str(tmp / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        IPYTHONDIR=str(tmp / "ipython"),
        # one OpenMP thread in the kernel, as in the suite (conftest): on a busy 2-core
        # machine two spinning threads made its two replays overrun RENDER_S
        OMP_NUM_THREADS="1",
    )
    _dump_kernel_stacks(tmp / "ipython", tmp / "kernel_stacks.txt")
    cmd = [
        sys.executable,
        "-m",
        "voila",
        str(NOTEBOOK),
        "--no-browser",
        "--Voila.ip=127.0.0.1",
        f"--Voila.port={port}",
        "--Voila.port_retries=0",
        f"--VoilaExecutor.timeout={RENDER_S}",
        "--VoilaConfiguration.show_tracebacks=True",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + SERVER_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"voila exited with {proc.returncode}:\n{_log_tail(log)}")
            try:
                # Any HTTP answer means the server is up; "/" itself would run the notebook.
                urllib.request.urlopen(url + "api/kernelspecs", timeout=2).close()
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"voila did not answer within {SERVER_S} s:\n{_log_tail(log)}")
                time.sleep(0.5)
        yield url, log
    finally:
        _stop(proc)


def _loopback_only(route) -> None:
    """The page may fetch from the server only (Voilà's template links CDN fonts and MathJax)."""
    url = urlsplit(route.request.url)
    if url.scheme in ("data", "blob") or url.hostname == "127.0.0.1":
        route.continue_()
    else:
        route.abort()


# Voilà streams cell outputs and shows a failed cell's traceback as stderr, then stops.
_RENDERED_OR_FAILED = """() =>
    (document.querySelector('.tr-tokens .tr-highlight[data-step]')
     && document.querySelector('.tr-topk table'))
    || [...document.querySelectorAll('[data-mime-type="application/vnd.jupyter.stderr"]')]
        .some(e => e.textContent.includes('Traceback (most recent call last)'))"""


def _fail_render(page, log: Path, why: str) -> None:
    page.screenshot(path=ARTIFACTS / "explorer_failed.png", full_page=True)
    pytest.fail(
        f"{why}\npage text: {page.inner_text('body')[-3000:]}\n"
        f"voila log:\n{_log_tail(log)}\n"
        f"kernel stacks ({STACKS_S} s after it started):\n"
        f"{_log_tail(log.parent / 'kernel_stacks.txt', 12000) or '(none written)'}\n"
        f"busiest processes now:\n{_busiest_processes()}"
    )


@pytest.fixture(scope="module")
def page(chromium, voila):
    """The rendered explorer page; its first screenshot is explorer_initial.png."""
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "the browser test needs the Python package 'playwright': "
            "pip install -e '.[notebook,dev]' (make install does); it drives Debian's "
            "chromium, so `playwright install` is not needed"
        )
    url, log = voila
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(chromium), headless=True, args=CHROMIUM_ARGS, timeout=60_000
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(UPDATE_S * 1000)
            page.route("**/*", _loopback_only)
            try:
                page.goto(url, wait_until="commit", timeout=RENDER_S * 1000)
                page.wait_for_function(_RENDERED_OR_FAILED, polling=250, timeout=RENDER_S * 1000)
            except PlaywrightError as err:
                _fail_render(page, log, f"the explorer did not render within {RENDER_S} s: {err}")
            if page.locator(".tr-tokens .tr-highlight[data-step]").count() == 0:
                _fail_render(page, log, "a notebook cell failed")
            page.screenshot(path=ARTIFACTS / "explorer_initial.png", full_page=True)
            yield page
        finally:
            browser.close()


def _highlighted(page) -> tuple[int, int]:
    """(data-step, token id) of the highlighted token."""
    span = page.locator(".tr-tokens .tr-highlight")
    token_id = TOKEN_ID.search(span.get_attribute("title"))[1]
    return int(span.get_attribute("data-step")), int(token_id)


def _slider(page) -> tuple[int, int, int]:
    """(min, value, max) of the step slider, from its noUiSlider handle."""
    handle = page.locator(".tr-step .noUi-handle")
    return tuple(int(float(handle.get_attribute(f"aria-value{k}"))) for k in ("min", "now", "max"))


def _expect_table_shows(page, token_id: int) -> None:
    """Both top-k tables (fp32 and bf16 sides) are captioned with that trace token."""
    from playwright.sync_api import expect

    captions = page.locator(".tr-topk caption")
    expect(captions).to_have_count(2)
    for i in range(2):
        expect(captions.nth(i)).to_contain_text(f"(id {token_id})")


def test_step_slider_moves_highlight_and_topk(page):
    """Arrow keys on the step slider move the highlighted token and the top-k table to that step."""
    from playwright.sync_api import expect

    low, start, high = _slider(page)
    assert high > low, "the served trace needs at least two steps"
    target = min(start + 3, high) if start < high else low
    topk = page.locator(".tr-topk")
    topk_before = topk.text_content()
    handle = page.locator(".tr-step .noUi-handle")
    handle.focus()
    for _ in range(abs(target - start)):
        handle.press("ArrowRight" if target > start else "ArrowLeft")
    # The kernel redraws the tokens, then the plot, then the table: wait for each in turn.
    expect(page.locator(".tr-tokens .tr-highlight")).to_have_attribute("data-step", str(target))
    _, token_id = _highlighted(page)
    _expect_table_shows(page, token_id)
    expect(page.locator(".tr-step .widget-readout")).to_have_text(str(target))
    assert page.locator(".tr-tokens .tr-highlight").count() == 1
    assert topk.text_content() != topk_before
    page.screenshot(path=ARTIFACTS / "explorer_after_slider.png", full_page=True)


def test_trace_dropdown_switches_tokens_and_topk(page):
    """Picking another trace redraws the coloured strip and the table for it; highlight = slider."""
    from playwright.sync_api import expect

    select = page.locator(".tr-trace select")
    current = select.input_value()
    other = next(
        v
        for v in select.locator("option").evaluate_all("os => os.map(o => o.value)")
        if v != current
    )
    trace_id = other.split(" (")[0]
    strip = page.locator(".tr-tokens .tr-strip")
    strip_before, topk_before = strip.text_content(), page.locator(".tr-topk").text_content()
    select.select_option(value=other)
    expect(page.locator(".tr-tokens .tr-legend")).to_contain_text(f"trace {trace_id} ")
    step, token_id = _highlighted(page)
    _expect_table_shows(page, token_id)
    assert step == _slider(page)[1]
    assert strip.text_content() != strip_before
    tokens = page.locator(".tr-tokens .tr-tok")
    expect(tokens).to_have_count(int(N_TOKENS.search(other)[1]))
    colours = tokens.evaluate_all("ts => ts.map(t => getComputedStyle(t).backgroundColor)")
    assert any(c not in _BLANK for c in colours), colours
    assert page.locator(".tr-topk").text_content() != topk_before
    page.screenshot(path=ARTIFACTS / "explorer_after_trace.png", full_page=True)


# Remove the mark with the fix in explorer.py: a bare Figure has no image repr in the kernel
# unless pyplot's inline backend happens to be loaded, so the Output shows its text repr.
def test_plot_output_shows_the_figure_as_an_image(page):
    """The plot Output under the token strip shows the trace's figure as an image."""
    from playwright.sync_api import expect

    expect(page.locator(".tr-tokens ~ .widget-output img")).to_be_visible(timeout=5_000)


def test_divergence_strip_follows_the_metric_control(page):
    """With distributions, the selected step's divergences are listed under the top-k tables
    and picking another metric redraws the figure (its divergence strip)."""
    from playwright.sync_api import expect

    expect(page.locator(".tr-topk .tr-step-notes")).to_contain_text("full distributions (bounded)")
    image = page.locator(".tr-tokens ~ .widget-output img")
    expect(image).to_be_visible(timeout=5_000)
    before = image.get_attribute("src")
    page.locator(".tr-metric select").select_option(label="tv")
    expect(image).not_to_have_attribute("src", before)
    page.screenshot(path=ARTIFACTS / "explorer_divergence_tv.png", full_page=True)
