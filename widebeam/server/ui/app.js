// The search view: the form becomes one OpenAI-style call (/v1/completions, or /v1/chat/completions
// with "chat"); sampled and greedy output streams as server-sent events, beam search comes back whole
// with its ranked hypotheses and, with return_tree, the search tree drawn by tree.js.
"use strict";

const $ = (id) => document.getElementById(id);

function showView(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === name);
  for (const view of document.querySelectorAll(".view")) view.classList.toggle("active", view.id === `view-${name}`);
}

function updateModeFields() {
  const mode = $("mode").value;
  for (const el of document.querySelectorAll(".beam-only")) el.hidden = mode !== "beam";
  for (const el of document.querySelectorAll(".sampling-only")) el.hidden = mode !== "sampling";
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function requestBody() {
  const mode = $("mode").value;
  const chat = $("chat").checked;
  const body = {max_tokens: Number($("max-tokens").value)};
  if (chat) body.messages = [{role: "user", content: $("prompt").value}];
  else body.prompt = $("prompt").value;
  const schemaText = $("schema").value.trim();
  if (schemaText) {
    let schema;
    try { schema = JSON.parse(schemaText); } catch (error) { throw new Error(`JSON schema: ${error.message}`); }
    body.response_format = {type: "json_schema", json_schema: {name: "schema", schema}};
  }
  if (mode === "beam") {
    const width = Number($("width").value);
    const early = $("early-stopping").value;
    Object.assign(body, {use_beam_search: true, temperature: 0, beam_width: width, n: width,
                         length_penalty: Number($("length-penalty").value), return_tree: true,
                         early_stopping: early === "never" ? "never" : early === "true"});
    if ($("catalogue").value) body.catalogue = $("catalogue").value;
  } else {
    body.stream = true;
    body.temperature = mode === "greedy" ? 0 : Number($("temperature").value);
  }
  return {chat, body};
}

function choiceText(choice, chat) {
  if (chat) return (choice.message || choice.delta || {}).content || "";
  return choice.text || "";
}

async function readStream(response, chat, onText) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return;
      const payload = JSON.parse(data);
      if (payload.error) throw new Error(payload.error.message);
      for (const choice of payload.choices || []) onText(choiceText(choice, chat));
    }
  }
}

function renderHypotheses(choices, chat) {
  const list = $("hypotheses");
  for (const choice of choices) {
    const item = document.createElement("li");
    item.className = "hyp";
    item.dataset.rank = choice.index;
    item.dataset.score = choice.beam_score;
    item.dataset.text = choiceText(choice, chat);
    item.innerHTML = '<span class="score"></span><span class="text"></span><span class="reason"></span>';
    item.querySelector(".score").textContent = Number(choice.beam_score).toFixed(4);
    item.querySelector(".text").textContent = JSON.stringify(choiceText(choice, chat));
    item.querySelector(".reason").textContent = choice.finish_reason;
    list.appendChild(item);
  }
}

async function submitSearch(event) {
  event.preventDefault();
  $("error").hidden = true;
  $("output").hidden = true;
  $("output").textContent = "";
  $("hypotheses").innerHTML = "";
  $("tree-wrap").hidden = true;
  $("status").textContent = "running...";
  document.body.dataset.state = "running";
  try {
    const {chat, body} = requestBody();
    const response = await api(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
    if (!response.ok) {
      const answer = await response.json().catch(() => ({}));
      throw new Error((answer.error && answer.error.message) || `error ${response.status}`);
    }
    if (body.stream) {
      $("output").hidden = false;
      await readStream(response, chat, (text) => { $("output").textContent += text; });
    } else {
      const answer = await response.json();
      renderHypotheses(answer.choices, chat);
      const tree = (answer.search_trees || [])[0];
      if (tree) {
        $("tree-summary").textContent = window.widebeamTree.drawTree($("tree"), tree, $("tip"));
        $("tree-wrap").hidden = false;
      }
    }
    $("status").textContent = "done";
  } catch (error) {
    showError(error.message);
    $("status").textContent = "";
  } finally {
    document.body.dataset.state = "done";
  }
}

async function loadConfig() {
  const response = await api("/v1/ui/config");
  if (!response.ok) return;
  const config = await response.json();
  $("model-name").textContent = `${config.model}: beams up to ${config.max_beam_width}, ` +
                                `${config.max_seq_len} tokens`;
  $("width").max = config.max_beam_width;
  for (const name of config.catalogues) {
    const option = document.createElement("option");
    option.value = option.textContent = name;
    $("catalogue").appendChild(option);
  }
  for (const name of config.plan_models) {
    const option = document.createElement("option");
    option.value = option.textContent = name;
    $("plan-model").appendChild(option);
  }
  $("chat").disabled = !config.chat;
  document.body.dataset.ready = "true";
}

document.addEventListener("DOMContentLoaded", () => {
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showView(tab.dataset.view));
  $("mode").addEventListener("change", updateModeFields);
  $("search-form").addEventListener("submit", submitSearch);
  $("plan-form").addEventListener("submit", window.widebeamPanels.submitPlan);
  updateModeFields();
  loadConfig();
  window.widebeamPanels.startCapacity();
});
