"""The web page in a real browser: `widebeam serve` (a tiny model, an API key, a registered catalogue,
a small KV pool) on loopback, driven in headless Chromium (tests/e2e/browser.py).

A beam search's ranked list is the API's answer for the same request; the SVG tree has W nodes at a
step where W beams are live and marks exactly the tree's pruned nodes; greedy output streams to the
API's text; the capacity panel shows the numbers of /v1/stats (the engine's `stats()`), and the last
request's required vs peak blocks; the plan panel shows `plan`'s verdict; an infeasible request
shows the engine's own message. Without the key the page is refused (401, a Basic challenge).
"""

from __future__ import annotations

import httpx
import pytest
from browser import browser_missing, start_browser, wait_for
from conftest import API_KEY, ServerProcess


@pytest.fixture(scope="module", autouse=True)
def browser_installed():
    """`make setup` installs Chromium and its driver: a missing browser fails these tests, never skips
    them (a set-up that forgot it must show in CI)."""
    missing = browser_missing()
    assert missing is None, f"{missing}; run `make setup` (it installs chromium and chromium-driver)"

# 64 blocks of 16 tokens: a 16-wide beam search over 60 new tokens can never fit.
KV_BLOCK_BYTES = 2 * 2 * 8 * 2 * 4 * 16
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def ui_server(tiny_chat_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("server-ui")
    catalogue = directory / "colours.jsonl"
    catalogue.write_text('"red"\n"green"\n"blue sea"\n"yellow"\n')
    proc = ServerProcess(["--model", str(tiny_chat_model_dir), "--served-model-name", "tiny-chat",
                          "--kv-cache-memory", str(64 * KV_BLOCK_BYTES), "--max-seq-len", "128",
                          "--max-beam-width", "16", "--catalogue", f"colours={catalogue}"],
                         directory / "server.log", env={"WIDEBEAM_API_KEY": API_KEY}, api_key=API_KEY)
    yield proc.wait_ready()
    proc.stop()


@pytest.fixture(scope="module")
def page(ui_server):
    driver = start_browser()
    # the API key as Basic credentials: what a person types when the browser asks
    driver.get(ui_server.url.replace("http://", f"http://user:{API_KEY}@") + "/")
    wait_for(lambda: driver.execute_script("return document.body.dataset.ready"), what="the page's config")
    yield driver
    driver.quit()


def _fill(driver, element_id: str, value) -> None:
    element = driver.find_element("id", element_id)
    if element.tag_name == "select":
        from selenium.webdriver.support.ui import Select

        Select(element).select_by_value(str(value))
    else:
        element.clear()
        element.send_keys(str(value))


def _run_search(driver, **fields) -> None:
    driver.find_element("id", "tab-search").click()
    for element_id, value in fields.items():
        _fill(driver, element_id.replace("_", "-"), value)
    driver.execute_script("document.body.dataset.state = 'idle'")
    driver.find_element("id", "submit").click()
    wait_for(lambda: driver.execute_script("return document.body.dataset.state") == "done", 60, "the search")


def _beam_body(width: int, max_tokens: int, **extra) -> dict:
    return {"prompt": PROMPT, "use_beam_search": True, "temperature": 0, "beam_width": width, "n": width,
            "max_tokens": max_tokens, "length_penalty": 1.0, "early_stopping": False, "return_tree": True,
            **extra}


def test_page_needs_the_api_key(ui_server):
    response = httpx.get(ui_server.url + "/", timeout=10)
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Basic")
    assert httpx.get(ui_server.url + "/", auth=("anyone", API_KEY), timeout=10).status_code == 200
    assert httpx.get(ui_server.url + "/ui/app.js", headers=ui_server.headers, timeout=10).status_code == 200
    missing = httpx.get(ui_server.url + "/ui/nothing.js", headers=ui_server.headers, timeout=10)
    assert missing.status_code == 404


@pytest.mark.parametrize("width", [4, 16])
def test_beam_search_ranked_list_and_tree_match_the_api(page, ui_server, width):
    _run_search(page, mode="beam", width=width, max_tokens=6, prompt=PROMPT, catalogue="")
    assert not page.find_element("id", "error").is_displayed()
    with ui_server.client() as client:
        answer = client.post("/v1/completions", json=_beam_body(width, 6)).json()
    items = page.find_elements("css selector", "li.hyp")
    assert [(item.get_attribute("data-text"), float(item.get_attribute("data-score"))) for item in items] == \
        [(choice["text"], choice["beam_score"]) for choice in answer["choices"]]
    tree = answer["search_trees"][0]
    # a step where W beams are live: W nodes in its column that did not finish there
    live_steps = [step for step in range(1, tree["num_steps"] + 1)
                  if sum(1 for n in range(tree["num_nodes"])
                         if tree["step"][n] == step and not tree["finished"][n]) == width]
    assert live_steps
    step = live_steps[0]
    drawn = page.find_elements("css selector", f'circle.node[data-step="{step}"][data-finished="false"]')
    assert len(drawn) == width
    pruned = {str(n): str(tree["pruned_at"][n]) for n in range(tree["num_nodes"])
              if tree["pruned_at"][n] is not None}
    assert pruned, "some branches were pruned"
    marked = {c.get_attribute("data-node"): c.get_attribute("data-pruned-at")
              for c in page.find_elements("css selector", "circle.node.pruned")}
    assert marked == pruned
    ranked = {c.get_attribute("data-node"): c.get_attribute("data-rank")
              for c in page.find_elements("css selector", "circle.node.ranked")}
    assert ranked == {str(n): str(r) for n, r in enumerate(tree["rank"]) if r is not None}
    assert len(page.find_elements("css selector", "circle.node")) == tree["num_nodes"] + 1  # + the prompt


def test_catalogue_beams_are_items(page, ui_server):
    _run_search(page, mode="beam", width=4, max_tokens=6, catalogue="colours")
    texts = [item.get_attribute("data-text") for item in page.find_elements("css selector", "li.hyp")]
    assert texts and set(texts) <= {"red", "green", "blue sea", "yellow"}


def test_greedy_output_streams_the_api_text(page, ui_server):
    _run_search(page, mode="greedy", max_tokens=8)
    with ui_server.client() as client:
        body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8}
        answer = client.post("/v1/completions", json=body).json()
    assert page.find_element("id", "output").is_displayed()
    assert page.execute_script("return document.getElementById('output').textContent") == \
        answer["choices"][0]["text"]


def test_infeasible_request_shows_the_engine_message(page, ui_server):
    _run_search(page, mode="beam", width=16, max_tokens=100, catalogue="")
    with ui_server.client() as client:
        response = client.post("/v1/completions", json=_beam_body(16, 100))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "kv_cache_capacity_exceeded"
    shown = page.find_element("id", "error")
    assert shown.is_displayed() and shown.text == error["message"]
    _fill(page, "max-tokens", 6)  # leave the form runnable for the other tests


def test_capacity_panel_shows_stats(page, ui_server):
    _run_search(page, mode="beam", width=4, max_tokens=6, catalogue="")
    page.find_element("id", "tab-capacity").click()
    ui_server.wait_idle()
    polls = int(page.execute_script("return document.body.dataset.statsPolls"))
    wait_for(lambda: int(page.execute_script("return document.body.dataset.statsPolls")) >= polls + 2,
             what="two polls after the requests ended")
    with ui_server.client() as client:
        stats = client.get("/v1/stats").json()
    for name, pool in stats["pools"].items():
        box = page.find_element("css selector", f'.pool[data-pool="{name}"]')
        for field in ("total_blocks", "free_blocks", "evictable_blocks", "pinned_blocks"):
            shown = box.find_element("css selector", f'td[data-field="{field}"]').text
            assert int(shown) == pool[field], field
        used = pool["total_blocks"] - pool["free_blocks"] - pool["pinned_blocks"]
        assert int(box.find_element("css selector", 'td[data-field="used_blocks"]').text) == used
        assert box.find_elements("css selector", "svg.chart polygon")
    last = stats["recent_requests"][-1]
    for pool, required in last["required_blocks"].items():
        row = page.find_element("css selector",
                                f'#recent tr[data-request="{last["request_id"]}"][data-pool="{pool}"]')
        assert int(row.find_element("css selector", 'td[data-field="required_blocks"]').text) == required
        assert int(row.find_element("css selector", 'td[data-field="peak_blocks"]').text) == \
            last["peak_blocks"][pool]
        assert 0 < last["peak_blocks"][pool] <= required


def test_plan_panel_shows_what_fits(page, ui_server, tiny_chat_model_dir):
    page.find_element("id", "tab-plan").click()
    _fill(page, "plan-model", str(tiny_chat_model_dir))
    for element_id, value in (("plan-memory", "1GiB"), ("plan-width", 64), ("plan-prompt-len", 100),
                              ("plan-max-new-tokens", 20)):
        _fill(page, element_id, value)
    page.find_element("id", "plan-submit").click()
    verdict = wait_for(lambda: page.find_elements("id", "plan-verdict"), what="the plan")[0]
    with ui_server.client() as client:
        plan = client.post("/v1/plan", json={"model": str(tiny_chat_model_dir), "memory": "1GiB",
                                             "beam_width": 64, "prompt_len": 100, "max_new_tokens": 20,
                                             "dtype": "bfloat16"}).json()
    assert ("does not fit" not in verdict.text) == plan["fits"]
    assert f"{plan['max_concurrent_requests']} such requests at once" in verdict.text
    rows = page.find_elements("css selector", "#plan-pools tr[data-pool]")
    assert [r.get_attribute("data-pool") for r in rows] == [p["name"] for p in plan["pools"]]
    _fill(page, "plan-memory", "1KiB")
    page.find_element("id", "plan-submit").click()
    error = wait_for(lambda: page.find_element("id", "plan-error").is_displayed()
                     and page.find_element("id", "plan-error"), what="the plan's error")
    assert "leaves nothing for the KV cache" in error.text
