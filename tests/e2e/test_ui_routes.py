"""The page's routes without a browser or a model (a scripted engine, tests/e2e/e2e_helpers.py): `/`
and its files with the UI on, none with `--no-ui` (the JSON endpoints stay), the package's files are
the ones served, /v1/stats is the engine's stats(), /v1/plan answers `plan` or a 400 naming the
field, and return_tree is refused for sampling."""

from __future__ import annotations

import pytest
from e2e_helpers import ScriptedEngine
from fastapi.testclient import TestClient

from widebeam.server.api import create_app
from widebeam.server.ui_routes import UI_DIR, UI_FILES


@pytest.fixture(params=[True, False], ids=["ui", "no-ui"])
def client(request):
    engine = ScriptedEngine()
    with TestClient(create_app(engine, model_name="m", ui=request.param)) as client:
        client.ui = request.param
        yield client


def test_page_and_files_only_with_the_ui(client):
    for path, name in (("/", "index.html"), *((f"/ui/{n}", n) for n in UI_FILES)):
        response = client.get(path)
        if client.ui:
            assert response.status_code == 200, path
            assert response.text == (UI_DIR / name).read_text(), path
        else:
            assert response.status_code == 404, path
    assert client.get("/ui/../api.py").status_code == 404


def test_json_endpoints_either_way(client):
    stats = client.get("/v1/stats").json()
    assert stats["pools"] == ScriptedEngine().stats()["pools"] and "time" in stats
    assert client.get("/v1/ui/config").json()["model"] == "m"
    plan = client.post("/v1/plan", json={"model": "smollm2-135m-instruct", "memory": "2GiB", "beam_width": 8})
    assert plan.status_code == 200 and plan.json()["fits"] is True
    bad = client.post("/v1/plan", json={"model": "no-such-model", "memory": "2GiB"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
    small = client.post("/v1/plan", json={"model": "smollm2-135m-instruct", "memory": "1KiB"})
    assert small.status_code == 400 and small.json()["error"]["param"] == "memory"
    assert "leaves nothing for the KV cache" in small.json()["error"]["message"]


def test_return_tree_is_beam_search_only(client):
    response = client.post("/v1/completions", json={"prompt": "x", "return_tree": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "return_tree"


def test_every_ui_file_ships_in_the_package():
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    patterns = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["widebeam.server"]
    for name in ("index.html", *UI_FILES):
        assert (UI_DIR / name).is_file()
        assert any(fnmatch(f"ui/{name}", pattern) for pattern in patterns), name
