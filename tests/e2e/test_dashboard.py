"""The dashboard at ``/ui``, in a real browser against a real cluster, and its files checked in-process.

The browser test starts redis-server, two ``meshgate node`` agents (a, b) and a gateway with an admin key, then
drives Debian's ``chromium`` through ``/usr/bin/chromedriver`` with Selenium (never Selenium Manager, which would
download a browser): the page asks for the key, lists both nodes, previews the packaged Gemma 3 270M, places it
with the "place" button, shows it ready with its history from the audit stream, draws it on its node in the
cluster map, charts its load while requests run, and deletes it. A screenshot is saved under the test's
``tmp_path``.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import openai
import pytest
from litestar.testing import TestClient
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from meshgate.gateway.http.app import create_app
from meshgate.gateway.http.routes.ui import UI_DIR
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from tests.cluster.redis_server import RedisServer
from tests.cluster.test_cluster_e2e import FAST, Agent, wait_for
from tests.conftest import MODEL, Server

ADMIN_KEY = "dashboard-admin-key"
AUTH = {"authorization": f"Bearer {ADMIN_KEY}"}
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


class _Refs(HTMLParser):
    """Every ``src`` and ``href`` of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.refs += [value or "" for name, value in attrs if name in ("src", "href")]


def test_ui_is_public_static_html_that_loads_nothing_from_elsewhere(tmp_path):
    settings = Settings(
        data_dir=str(tmp_path), api_keys=("k",), disabled_plugins=("llama_cpp", "mlx", "vllm"), models=()
    )
    with TestClient(create_app(settings, build_plugin_manager(settings))) as client:
        page = client.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        parser = _Refs()
        parser.feed(page.text)
        assert set(parser.refs) == {"data:,", "/ui/dashboard.css", "/ui/dashboard.js"}  # data:, no favicon fetch
        for ref in set(parser.refs) - {"data:,"}:
            asset = client.get(ref)
            assert asset.status_code == 200 and asset.text
        served = {f.name: client.get(f"/ui/{f.name}").text for f in UI_DIR.iterdir() if f.suffix in (".js", ".css")}
        assert {"dashboard.js", "wire.js", "dashboard.css"} <= set(served)
        elsewhere = re.compile(r"https?://(?!www\.w3\.org/2000/svg\b)")  # the SVG namespace is a name, not a load
        assert not [name for name, text in served.items() if elsewhere.search(text)]
        assert not re.search(r"https?://", page.text)
        imports = {ref for text in served.values() for ref in re.findall(r'from "([^"]+)"', text)}
        assert imports == {f"/ui/{name}" for name in served if name.endswith(".js") and name != "dashboard.js"}
        script = "".join(text for name, text in served.items() if name.endswith(".js"))
        assert "EventSource(" not in script, "EventSource cannot send the admin key"
        assert client.get("/cluster").status_code == 401, "the data behind the page still needs the key"
        assert client.get("/cluster", headers={"authorization": "Bearer k"}).status_code == 200
        for outside in ("/ui/%2e%2e/routes/ui.py", "/ui/__init__.py", "/ui/nothing.js"):
            assert client.get(outside).status_code == 404, outside
        assert client.get("/").status_code == 200 and "Ollama" in client.get("/").text, "/ stays Ollama's probe"


# ------------------------------------------------------------------ the browser against a real cluster


@pytest.fixture(scope="module")
def cluster(data_dir: Path, packaged_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Redis, agents a and b (1.5 GiB each) and a gateway that needs ``ADMIN_KEY``; up once both links are
    measured."""
    logs = tmp_path_factory.mktemp("dashboard-logs")
    with RedisServer(tmp_path_factory.mktemp("dashboard-redis")) as redis:
        agents = [Agent(redis.url, name, data_dir, logs) for name in ("a", "b")]
        gateway = Server(
            data_dir, "--redis", redis.url, "--plugin", "tests.scripted_plugin", "--api-key", ADMIN_KEY, env=FAST
        )
        try:
            wait_for(lambda: len(httpx.get(f"{gateway.url}/cluster", headers=AUTH).json()["links"]) >= 2, 60, "links")
            yield gateway
        finally:
            gateway.stop()
            for agent in agents:
                agent.stop()


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    assert shutil.which(CHROMEDRIVER) and Path(CHROMIUM).exists(), "apt-get install -y chromium chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _texts(driver: webdriver.Chrome, selector: str, attribute: str = "textContent") -> list[str]:
    """What the matching elements hold, read in one script (rows are re-rendered live: no stale handles)."""
    return driver.execute_script(
        "const [selector, name] = arguments;"
        "return Array.from(document.querySelectorAll(selector), e => e[name] ?? e.getAttribute(name))",
        selector,
        attribute,
    )


def _number(text: str) -> float:
    return float(text) if re.fullmatch(r"\d+(\.\d+)?", text) else 0.0


def _text(driver: webdriver.Chrome, selector: str) -> str:
    return " ".join(t.strip() for t in _texts(driver, selector))


def test_the_dashboard_places_a_model_and_shows_it_ready(cluster, browser, tmp_path):
    gateway, until = cluster, WebDriverWait(browser, 30, poll_frequency=0.2)
    browser.get(f"{gateway.url}/ui")
    until.until(lambda d: "admin key" in _text(d, "#status"))  # the API refuses the page until it has a key
    browser.find_element(By.ID, "api-key").send_keys(ADMIN_KEY)
    browser.find_element(By.ID, "save-key").click()

    until.until(lambda d: set(_texts(d, "#nodes tr[data-node]", "data-node")) == {"a", "b"})
    assert "1.50 GiB" in _text(browser, "#nodes tbody")  # each agent offers 1.5 GiB
    until.until(lambda d: len(_texts(d, "#links tr[data-link]")) >= 2)
    assert re.search(r"bit/s", _text(browser, "#links .bandwidth")) and "ms" in _text(browser, "#links .latency")

    browser.find_element(By.ID, "preview-model").send_keys(MODEL)
    browser.find_element(By.ID, "preview-button").click()
    place = until.until(expected_conditions.element_to_be_clickable((By.CSS_SELECTOR, "#candidates button.place")))
    assert "single" in _text(browser, "#candidates tr.fits")
    place.click()

    row = "#instances tr[data-instance]"
    WebDriverWait(browser, 180, poll_frequency=0.5).until(lambda d: _text(d, f"{row} .state") == "ready")
    [instance_id] = _texts(browser, row, "data-instance")
    listed = httpx.get(f"{gateway.url}/instances/{instance_id}", headers=AUTH)
    assert listed.json()["state"]["state"] == "ready"
    node = listed.json()["placement"]["shards"][0]["node_id"]
    assert f"{node}: layers [0:18]" in _text(browser, f"{row} .placement")  # Gemma 3 270M: 18 blocks
    placed = f'#nodes tr[data-node="{node}"] .placed'  # the memory the node's placements reserve
    until.until(lambda d: _text(d, placed) not in ("", "0 MiB"))
    assert _text(browser, f"{row} .memory") == f"{node}: {_text(browser, placed)}"
    _the_map_draws_it(browser, until, instance_id, node)
    _the_charts_sample_it(browser, gateway, instance_id)
    until.until(lambda d: "ready" in _text(d, f"{row} .history"))  # the instance's history from the audit stream
    assert "placed" in _text(browser, f"{row} .history")
    assert "instance.ready" in _text(browser, "#events")

    # Rates: from the page's /metrics scrapes (every 2 s, over 10 s), after two generations; "-" without /metrics.
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=ADMIN_KEY, max_retries=0, timeout=120)
    for _ in range(2):
        reply = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens
    try:
        until.until(lambda d: _number(_text(d, f"{row} .rps")) > 0 and _number(_text(d, f"{row} .tps")) > 0)
    except TimeoutException:
        counters = [
            line for line in httpx.get(f"{gateway.url}/metrics", headers=AUTH).text.splitlines() if "_total{" in line
        ]
        raise AssertionError(f"no rates shown: {_text(browser, row)!r}; /metrics has {counters}") from None

    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot))
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000

    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/metrics*"]})  # as a gateway without /metrics
    until.until(lambda d: _text(d, f"{row} .rps") == "-" and _text(d, f"{row} .tps") == "-")
    assert "live:" in _text(browser, "#status"), "no /metrics is no error"

    WebDriverWait(browser, 10, ignored_exceptions=[StaleElementReferenceException]).until(
        lambda d: d.find_element(By.CSS_SELECTOR, f"{row} button.delete").click() or True  # again if re-rendered
    )
    until.until(expected_conditions.alert_is_present()).accept()
    until.until(lambda d: not _texts(d, row))
    wait_for(
        lambda: httpx.get(f"{gateway.url}/instances", headers=AUTH).json() == [],
        30,
        "the instance gone from the API",
    )


def _the_map_draws_it(driver: webdriver.Chrome, until: WebDriverWait, instance_id: str, node: str) -> None:
    """The SVG cluster map: both nodes with their memory, the measured link between them, and the ready instance
    on the node that holds its shard, with its request counts."""
    until.until(lambda d: set(_texts(d, "#cluster-map g.node", "data-node")) == {"a", "b"})
    assert "1.50 GiB" in _text(driver, f'#cluster-map g.node[data-node="{node}"] .memory')
    assert {"a>b", "b>a"} <= set(" ".join(_texts(driver, "#cluster-map g.link", "data-link")).split())
    assert "ms" in _text(driver, "#cluster-map g.link text") and "bit/s" in _text(driver, "#cluster-map g.link text")
    replica = f'#cluster-map g.node[data-node="{node}"] g.replica[data-instance="{instance_id}"]'
    until.until(lambda d: "state-ready" in " ".join(_texts(d, replica, "class")))
    assert "running" in _text(driver, replica) and "waiting" in _text(driver, replica)
    assert MODEL in _text(driver, "#cluster-map desc")  # what a screen reader is told


def _the_charts_sample_it(driver: webdriver.Chrome, gateway: Server, instance_id: str) -> None:
    """While completions run back to back, the charts get a sample a second with the running request and a
    tokens/s above 0 (cluster-wide ``load``, or this gateway's queue and /metrics rate where there is none)."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=ADMIN_KEY, max_retries=0, timeout=60)
    done, failures, chunks = threading.Event(), [], []  # chunks: how many each stream relayed

    def generate() -> None:  # short streams back to back, each left at once when the test is done
        while not done.is_set():
            try:
                prompt = "List the colours of a rainbow:"
                with client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True) as stream:
                    chunks.append(0)
                    for _ in stream:
                        chunks[-1] += 1
                        if done.is_set():
                            break
            except Exception as exc:  # reported by the test below: a thread cannot fail it
                failures.append(exc)
                return

    def peak(metric: str) -> tuple[float, int]:
        """The instance's line in one chart: its highest value and its number of samples."""
        line = f'#load-charts svg[data-metric="{metric}"] path[data-instance="{instance_id}"]'
        peaks, points = _texts(driver, line, "data-peak"), _texts(driver, line, "data-points")
        return (float(peaks[0]), int(points[0])) if peaks else (0.0, 0)

    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    try:
        WebDriverWait(driver, 30, poll_frequency=0.5).until(
            lambda d: failures or (peak("running")[0] >= 1 and peak("running")[1] >= 5 and peak("tokensPerS")[0] > 0)
        )
    except TimeoutException:
        charted = [peak(m) for m in ("tokensPerS", "running", "queued")]
        served = httpx.get(f"{gateway.url}/instances/{instance_id}", headers=AUTH).json()
        load, queue = served.get("load"), served.get("queue")
        raise AssertionError(
            f"charted {charted}; load {load}, queue {queue}; chunks of each stream: {chunks}"
        ) from None
    finally:
        done.set()
        worker.join(30)
    assert not failures, failures
    assert "tok/s" in _text(driver, f'#load-charts .legend li[data-instance="{instance_id}"]')
