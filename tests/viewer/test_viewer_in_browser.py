"""The HTML viewer driven in a real headless Chromium: it loads without script errors, shows
every node, opens the details panel on click, searches, zooms and pans.

Needs Debian's chromium and chromium-driver and the selenium package; `.ci/run` installs them and
sets LUCID_FX_REQUIRE_TOOLS=1, which turns a missing browser into a failure instead of a skip.
"""

import os
import shutil
import tempfile

import pytest
import torch

import lucid_fx
from models import ResNetLike

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:  # pragma: no cover - depends on the machine
    webdriver = None

MISSING = [what for what, found in (("chromium", CHROMIUM), ("chromedriver", DRIVER), ("selenium", webdriver)) if not found]
if MISSING and os.environ.get("LUCID_FX_REQUIRE_TOOLS") == "1":
    raise RuntimeError(f"LUCID_FX_REQUIRE_TOOLS=1 but {', '.join(MISSING)} missing: apt install chromium chromium-driver")
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (.ci/run installs them)")


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--window-size=1400,900",
    ):
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="lucid-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """A converted ResNet-like model with a comparison: the graph a user would open."""
    torch.manual_seed(0)
    model = ResNetLike().eval()
    data = [torch.randn(1, 3, 64, 64) for _ in range(2)]
    q = lucid_fx.quantize(model, (data[0],), data, progress=False)
    comparison = lucid_fx.compare(model, q, data[:1])
    path = lucid_fx.visualize(q, tmp_path_factory.mktemp("viewer") / "resnet.html", compare=comparison)
    return path, lucid_fx.to_networkx(q, comparison=comparison)


def _severe(driver):
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_loads_without_errors_and_shows_every_node(browser, page):
    path, graph = page
    browser.get(path.as_uri())
    assert _severe(browser) == []
    assert browser.title == "lucid_fx: QuantizedModule"
    shown = browser.execute_script(
        "return Array.from(document.querySelectorAll('g.node')).map(g => {"
        "  const b = g.getBBox(); return [g.getAttribute('data-name'), b.width, b.height]; });"
    )
    assert sorted(name for name, _, _ in shown) == sorted(graph.nodes)
    assert all(w > 30 and h > 20 for _, w, h in shown)
    edges = browser.execute_script("return document.querySelectorAll('path.edge').length")
    assert edges == graph.number_of_edges()


def test_clicking_a_node_opens_its_details(browser, page):
    path, graph = page
    browser.get(path.as_uri())
    target = next(n for n, a in graph.nodes(data=True) if a.get("lowering") == "conv2d+add+relu")
    assert browser.find_element(By.ID, "details").get_attribute("class") == "hidden"
    browser.find_element(By.ID, "search").send_keys(target + Keys.ENTER)  # brings it into view
    browser.find_element(By.CSS_SELECTOR, f'g.node[data-name="{target}"]').click()  # a real mouse click
    panel = browser.find_element(By.ID, "details")
    assert panel.is_displayed()
    assert panel.find_element(By.TAG_NAME, "h2").text == target
    cells = {row.find_elements(By.TAG_NAME, "td")[0].text: row.find_elements(By.TAG_NAME, "td")[1].text
             for row in panel.find_elements(By.TAG_NAME, "tr")}
    attrs = graph.nodes[target]
    assert cells["lowering"] == "conv2d+add+relu" and cells["qparams"] == attrs["qparams"]
    assert cells["observer"] == attrs["observer"] and cells["domain"] == "int8"
    assert float(cells["sqnr_db"]) == pytest.approx(attrs["sqnr_db"])
    assert cells["inputs"] == ", ".join(graph.predecessors(target))
    assert "selected" in browser.find_element(By.CSS_SELECTOR, f'g.node[data-name="{target}"]').get_attribute("class")
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    assert browser.find_element(By.ID, "details").get_attribute("class") == "hidden"
    assert _severe(browser) == []


def test_search_highlights_matches(browser, page):
    path, graph = page
    browser.get(path.as_uri())
    box = browser.find_element(By.ID, "search")
    box.send_keys("conv2d_add")
    expected = sorted(n for n, a in graph.nodes(data=True) if "conv2d_add" in n or "conv2d_add" in a.get("op", ""))
    matched = browser.execute_script("return Array.from(document.querySelectorAll('g.node.match')).map(g => g.dataset.name)")
    assert sorted(matched) == expected and len(expected) >= 4
    assert browser.find_element(By.ID, "found").text == f"{len(expected)} matches"
    dimmed = browser.execute_script("return document.querySelectorAll('g.node.dim').length")
    assert dimmed == graph.number_of_nodes() - len(expected)


def test_wheel_zooms_and_drag_pans(browser, page):
    path, _ = page
    browser.get(path.as_uri())
    view = lambda: [float(v) for v in browser.execute_script(  # noqa: E731
        "return document.querySelector('#canvas svg').getAttribute('viewBox')").split()]
    before = view()
    browser.execute_script(
        "document.getElementById('canvas').dispatchEvent(new WheelEvent('wheel', "
        "{deltaY: -100, clientX: 600, clientY: 400, bubbles: true, cancelable: true}));"
    )
    zoomed = view()
    assert zoomed[2] == pytest.approx(before[2] / 1.15, rel=1e-3)
    browser.execute_script(
        "const c = document.getElementById('canvas');"
        "c.dispatchEvent(new PointerEvent('pointerdown', {clientX: 500, clientY: 500, bubbles: true}));"
        "window.dispatchEvent(new PointerEvent('pointermove', {clientX: 400, clientY: 300, bubbles: true}));"
        "window.dispatchEvent(new PointerEvent('pointerup', {bubbles: true}));"
    )
    panned = view()
    assert panned[0] > zoomed[0] and panned[1] > zoomed[1] and panned[2] == zoomed[2]
    browser.find_element(By.ID, "fit").click()
    assert view()[2:] == pytest.approx(browser.execute_script(
        "const b = document.querySelector('#canvas svg'); return [b.viewBox.baseVal.width, b.viewBox.baseVal.height]"))
    assert _severe(browser) == []
