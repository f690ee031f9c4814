#!/usr/bin/env python3
"""mglaunch-rdzv's status page in a real headless Chromium (selenium + chromedriver): the page
asks for the daemon's token, then shows a real 2-node job appear, restart once and end, all
without a reload. Usage: status_page_test.py BIN_DIR FAKE_WORKER SCREENSHOT.png
Exits 77 (skipped, with a one-line reason) when Chromium, chromedriver or selenium is absent,
and fails then under CI=true (tests/support/skip.py)."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from skip import require_installed, require_program  # noqa: E402

BIN, FAKE, SHOT = sys.argv[1], sys.argv[2], sys.argv[3]
TOKEN = "status-page-token"

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
except ImportError:
    require_installed(False, "python3 module selenium", "python3-selenium")
require_program("/usr/bin/chromium", "chromium")
require_program("/usr/bin/chromedriver", "chromium-driver")


def wait_for(what, pred, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            value = pred()
            if value:
                return value
        except Exception:  # the DOM is replaced while we read it: try again
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


procs, driver = [], None
tmp = tempfile.mkdtemp()
try:
    env = dict(os.environ, MGLAUNCH_RDZV_TOKEN=TOKEN, MGLAUNCH_RECORD_DIR=tmp + "/records")
    daemon = subprocess.Popen([f"{BIN}/mglaunch-rdzv", "--listen", "127.0.0.1:0", "--http", "0"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs.append(daemon)
    endpoint = daemon.stdout.readline().split()[-1]
    url = daemon.stdout.readline().split()[-1]
    assert url.startswith("http://127.0.0.1:"), url

    # Chromium sometimes fails to start its renderer on a loaded machine ("session not
    # created"): that is the browser's start, not the page under test, so try three times,
    # each with a fresh profile (chromedriver picks the debugging port itself).
    for attempt in range(3):
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1100,760", f"--user-data-dir={tmp}/profile{attempt}"):
            options.add_argument(flag)
        try:
            driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
            break
        except Exception as err:  # selenium's SessionNotCreatedException and friends
            if attempt == 2:
                raise
            print(f"chromium did not start ({str(err).splitlines()[0]}); trying again")
            time.sleep(2)
    driver.set_page_load_timeout(60)
    driver.get(url)
    status = lambda: driver.find_element(By.ID, "status").text
    wait_for("the page to ask for the token", lambda: status() == "this daemon needs its token")
    assert TOKEN not in driver.current_url
    driver.find_element(By.ID, "token").send_keys("a wrong token")
    driver.find_element(By.ID, "connect").click()
    wait_for("the wrong token to be refused", lambda: status() == "wrong token")
    driver.find_element(By.ID, "token").clear()
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    driver.find_element(By.ID, "connect").click()
    wait_for("the page to connect", lambda: status() == "connected")

    go = os.path.join(tmp, "go")
    worker = [FAKE, "print", "up", "sleep-ms", "1500", "wait-file", go, "when-restart-below", "1", "exit", "3"]
    for i in (2, 3):
        procs.append(subprocess.Popen(
            [f"{BIN}/mglaunch", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
             "--rdzv_id=web", f"--local_addr=127.0.0.{i}", "--max_restarts=1"] + worker,
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    cell = lambda name: driver.find_element(By.CSS_SELECTOR, f'tr[data-job="web"] td.{name}').text
    wait_for("the job to appear, running round 1", lambda: cell("state") == "running" and cell("round") == "1")
    nodes = cell("nodes")
    assert "127.0.0.2" in nodes and "127.0.0.3" in nodes, nodes
    driver.save_screenshot(SHOT)  # the README's picture: a running 2-node job
    open(go, "w").close()  # both workers exit 3: the job restarts once
    wait_for("the restart", lambda: cell("restarts") == "1 of 1")
    wait_for("the end", lambda: cell("state") == "done" and cell("round") == "2")
    events = driver.find_element(By.ID, "events").text
    assert "failed with exit code 3" in events, events
    assert "job 'web' created" in events, events
    for p in procs[1:]:
        assert p.wait(timeout=60) == 0, p.args
    print("1 passed, 0 failed")
finally:
    if driver:
        driver.quit()
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    shutil.rmtree(tmp, ignore_errors=True)
