"""Screenshots of the web page's three views (search + tree, capacity, plan) for docs/ui.md.

Starts `widebeam serve` on loopback with a model (default: the default model, SmolLM2-135M-Instruct),
drives the page in headless Chromium (tests/e2e/browser.py: Debian's chromium and chromium-driver),
runs a beam search with its tree, a few more requests so the capacity panel has history, a plan,
and writes one PNG per view under benchmarks/results/ui/.

    python benchmarks/ui_screenshots.py [--model smollm2-135m-instruct] [--out benchmarks/results/ui]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from browser import start_browser, wait_for

PROMPT = "The three primary colours are"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, port: int, log_path: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "widebeam", "serve", "--model", model, "--port", str(port),
               "--kv-cache-memory", "96MiB", "--max-beam-width", "16", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not start")


def beam_request(url: str, width: int, max_tokens: int) -> None:
    body = {"prompt": PROMPT, "use_beam_search": True, "n": width, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True}
    httpx.post(url + "/v1/completions", json=body, timeout=300)


def set_value(driver, element_id: str, value) -> None:
    driver.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                          "e.dispatchEvent(new Event('change'));", element_id, str(value))


def shoot(driver, path: Path) -> None:
    """The whole page, not just the window."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1400, "height": 900, "deviceScaleFactor": 1, "mobile": False})
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1400, "height": max(900, min(height + 40, 2400)), "deviceScaleFactor": 1,
                            "mobile": False})
    time.sleep(0.5)
    driver.save_screenshot(str(path))
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ui")
    parser.add_argument("--width", type=int, default=6, help="beam width of the search screenshot")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args.model, port, Path(tempfile.mkdtemp()) / "server.log")
    driver = start_browser()
    try:
        driver.get(url + "/")
        wait_for(lambda: driver.execute_script("return document.body.dataset.ready"), what="the page")
        # overlapping requests of different widths, so the capacity panel has something to draw
        driver.find_element("id", "tab-capacity").click()
        threads = []
        for width, tokens in ((2, 48), (8, 40), (16, 32), (4, 64), (12, 24)):
            threads.append(threading.Thread(target=beam_request, args=(url, width, tokens)))
            threads[-1].start()
            time.sleep(1.5)
        for thread in threads:
            thread.join()
        time.sleep(3)
        shoot(driver, args.out / "capacity.png")
        driver.find_element("id", "tab-search").click()
        set_value(driver, "mode", "beam")
        set_value(driver, "width", args.width)
        set_value(driver, "max-tokens", 7)
        driver.find_element("id", "submit").click()
        wait_for(lambda: driver.execute_script("return document.body.dataset.state") == "done", 120,
                 "the search")
        node = driver.find_element("css selector", "circle.node.ranked")
        from selenium.webdriver import ActionChains

        ActionChains(driver).move_to_element(node).perform()  # the hover label
        shoot(driver, args.out / "search_tree.png")
        driver.find_element("id", "tab-plan").click()
        set_value(driver, "plan-model", args.model)
        for element_id, value in (("plan-memory", "2GiB"), ("plan-width", 256), ("plan-prompt-len", 4096),
                                  ("plan-max-new-tokens", 64)):
            set_value(driver, element_id, value)
        driver.find_element("id", "plan-submit").click()
        wait_for(lambda: driver.find_elements("id", "plan-verdict"), what="the plan")
        shoot(driver, args.out / "plan.png")
    finally:
        driver.quit()
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
