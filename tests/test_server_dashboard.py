"""The dashboard in a real headless browser (Debian's chromium via Selenium) after a real remote search."""

from __future__ import annotations

import shutil

import pytest
from server_harness import ThreadServer
from test_planner import BUDGET, Measure, landscape_space, predict

from atorch.strategy_search.search.remote import RemotePlanner

TOKEN = "dash-token"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture()
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip("no chromium/chromedriver: apt-get install -y chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_dashboard_shows_a_study_from_a_real_search(browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    space = landscape_space()
    with ThreadServer(f"sqlite:///{tmp_path / 'dash.db'}", token=TOKEN) as server:
        result = RemotePlanner(space, server_url=server.url, token=TOKEN, study_key="dash-study", predict=predict,
                               measure=Measure(), memory_budget=BUDGET, max_trials=3).search()
        browser.get(f"{server.url}/ui/")  # no cookie yet: refused
        assert "missing or wrong bearer token" in browser.page_source and "dash-study" not in browser.page_source
        browser.get(f"{server.url}/ui/login")  # the sign-in form: the token is POSTed, never in a URL
        field = browser.find_element(By.NAME, "token")
        field.send_keys(TOKEN)
        field.submit()  # sets the cookie, lands on /ui
        WebDriverWait(browser, 30).until(lambda d: "dash-study" in d.find_element(By.TAG_NAME, "body").text)
        body = browser.find_element(By.TAG_NAME, "body").text
        best = browser.find_element(By.CSS_SELECTOR, "b.best").text
        assert "parallel_mode" in best and f"mbs {result.candidate.micro_batch_size}" in best
        rows = browser.find_elements(By.CSS_SELECTOR, "table tr")
        assert len(rows) - 1 >= result.dry_runs and "measured samples/s" in body and "predicted peak MiB" in body
        # optuna-dashboard on the same storage: its front end lists the study.
        browser.get(f"{server.url}/dashboard")
        WebDriverWait(browser, 60).until(lambda d: "dash-study" in d.find_element(By.TAG_NAME, "body").text)
