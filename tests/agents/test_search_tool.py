"""verl's retrieval tool (verl.tools.search_tool.SearchTool) against a real HTTP retrieval service run
here (http.server on a thread, a small corpus ranked by shared words): the request it sends, the text
the model reads, verl's metrics, retries, and every failure of the service as the model's error text.
The tool runs in real tool worker processes (ToolBox) and in the tool agent loop; verl's Search-R1
command line trains through `plait train` on the demo's tiny model against the same service. With
PLAIT_VERL_SOURCE (a verl checkout; verl 0.9.1's wheel has no search tool) the request, text and
metadata are compared with verl's own helper (verl/tools/utils/search_r1_like_utils.py) side by side."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from plait.agents.search_tool import format_passages, search_batch
from plait.agents.tool_parser import FunctionCall
from plait.agents.tools import ToolBox, ToolLimits
from plait.configtree import ConfigError
from plait.data.rewards import default_compute_score

REPO = Path(__file__).resolve().parents[2]

CORPUS = [
    "Eiffel Tower\nThe Eiffel Tower is a wrought-iron tower in Paris, France.",
    "Paris\nParis is the capital and largest city of France.",
    "Mount Everest\nMount Everest is the highest mountain on Earth, in the Himalayas.",
    "Python (language)\nPython is a programming language created by Guido van Rossum.\nIt was released in 1991.",
    "Nile\nThe Nile is a river in Africa, among the longest rivers in the world.",
    "Zürich\nZürich is the largest city of Switzerland.",
]


def rank(query: str, topk: int) -> list[dict]:
    """The topk passages sharing the most words with the query (ties: corpus order)."""
    words = set(str(query).lower().split())  # a model may send numbers or null in the list
    scored = [(len(words & set(doc.lower().replace(",", " ").replace(".", " ").split())), i)
              for i, doc in enumerate(CORPUS)]
    best = sorted(scored, key=lambda s: (-s[0], s[1]))[:topk]
    return [{"document": {"id": str(i), "contents": CORPUS[i]}, "score": float(n)} for n, i in best]


class Retriever(BaseHTTPRequestHandler):
    """/retrieve answers as Search-R1's retrieval_server.py; other paths misbehave as named."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        server.requests.append({"path": self.path, "body": body, "content_type": self.headers["Content-Type"]})
        if self.path == "/slow":
            time.sleep(3)
        if self.path == "/count":  # the most requests in flight at once
            with server.lock:
                server.in_flight += 1
                server.most = max(server.most, server.in_flight)
            time.sleep(0.5)
            with server.lock:
                server.in_flight -= 1
        if self.path == "/down" or (self.path == "/flaky" and len(server.requests) <= 2):
            return self.reply(503, b"unavailable")
        answers = {"/retrieve": {"result": [rank(q, body["topk"]) for q in body["queries"]]},
                   "/count": {"result": [rank(q, body["topk"]) for q in body["queries"]]},
                   "/flaky": {"result": [rank(q, body["topk"]) for q in body["queries"]]},
                   "/empty": {"result": []}, "/nothing": {}, "/odd": {"result": [[{"passage": "x"}]]}}
        if self.path == "/garbage":
            return self.reply(200, b"<html>not json</html>")
        if self.path not in answers and self.path != "/slow":
            return self.reply(404, b"no such path")
        self.reply(200, json.dumps(answers.get(self.path, {})).encode())

    def reply(self, status: int, data: bytes):
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # /slow: the client timed out and left
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def retriever():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Retriever)
    server.daemon_threads, server.requests = True, []
    server.lock, server.in_flight, server.most = threading.Lock(), 0, 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def url(server, path="/retrieve") -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/retrieve"


def tool_yaml(service: str, **config) -> str:
    """verl's examples/sglang_multiturn/config/tool_config/search_tool_config.yaml, the address ours
    (its schema's `item:` is verl's spelling; unknown schema keys are dropped, as verl's pydantic does)."""
    config = {"retrieval_service_url": service, "num_workers": 120, "rate_limit": 120, "timeout": 30, **config}
    lines = "".join(f"      {k}: {v}\n" for k, v in config.items())
    return ("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n    config:\n"
            f"{lines}      type: native\n"
            "    tool_schema:\n      type: function\n      function:\n        name: search\n"
            "        description: Searches the web for relevant information based on the given query.\n"
            "        parameters:\n          type: object\n          properties:\n            query_list:\n"
            "              type: array\n              item:\n                type: string\n"
            "              description: A list of fully-formed semantic queries.\n"
            "          required:\n            - query_list\n")


@pytest.fixture
def searchbox(tmp_path):
    boxes = []

    def make(service, workers=1, **config):
        path = tmp_path / f"search{len(boxes)}.yaml"
        path.write_text(tool_yaml(service, **config))
        box = ToolBox.from_config(SimpleNamespace(tool_config_path=str(path), function_tool_path=None,
                                                  max_tool_response_length=4096, tool_response_truncate_side="middle"),
                                  ToolLimits(num_workers=workers))
        boxes.append(box)
        return box
    yield make
    for box in boxes:
        box.close()


def search(box, arguments, row="row 3", calls=1):
    call = FunctionCall("search", arguments if isinstance(arguments, str) else json.dumps(arguments))
    kwargs = {"search": {"create_kwargs": {"ground_truth": {"target": ["x"]}}}}
    results = asyncio.run(box.call([call] * calls, kwargs, row))
    return results[0] if calls == 1 else results


def result_of(res) -> str:
    return json.loads(res.text)["result"]


# -- a working service ---------------------------------------------------------------------------

def test_search_sends_verls_request_and_answers_verls_text(retriever, searchbox):
    box = searchbox(url(retriever), topk=2)
    assert box.schemas()[0]["function"]["parameters"]["properties"]["query_list"] == {
        "type": "array", "description": "A list of fully-formed semantic queries."}
    retriever.requests.clear()
    res = search(box, {"query_list": ["capital of France", "highest mountain"]})
    assert retriever.requests == [{"path": "/retrieve", "content_type": "application/json", "body": {
        "queries": ["capital of France", "highest mountain"], "topk": 2, "return_scores": True}}]
    assert result_of(res) == (
        "Doc 1 (Title: Paris)\nParis is the capital and largest city of France.\n\n"
        "Doc 2 (Title: Eiffel Tower)\nThe Eiffel Tower is a wrought-iron tower in Paris, France.\n---\n"
        "Doc 1 (Title: Mount Everest)\nMount Everest is the highest mountain on Earth, in the Himalayas.\n\n"
        "Doc 2 (Title: Eiffel Tower)\nThe Eiffel Tower is a wrought-iron tower in Paris, France.")
    assert res.reward == 0.0 and res.error is None
    assert res.metrics == {"query_count": 2, "status": "success", "total_results": 4, "api_request_error": None}


def test_topk_defaults_to_three_and_non_ascii_text_is_kept(retriever, searchbox):
    box = searchbox(url(retriever))
    retriever.requests.clear()
    res = search(box, {"query_list": ["Nile river"]})
    assert retriever.requests[0]["body"]["topk"] == 3 and result_of(res).count("Doc ") == 3
    text, meta = search_batch(url(retriever), ["Zürich"], 1, 5)
    assert text == '{"result": "Doc 1 (Title: Zürich)\\nZürich is the largest city of Switzerland."}'  # not \\u00fc
    assert meta["queries"] == ["Zürich"] and meta["total_results"] == 1


def test_format_passages_as_verl():
    passages = [{"document": {"contents": "T1\nline a\nline b"}}, {"document": {"contents": "only a title"}},
                {"document": {"contents": "T3\n  body  \n"}}]
    assert format_passages(passages) == "Doc 1 (Title: T1)\nline a\nline b\n\nDoc 2 (Title: only a title)\n\n\n" \
                                        "Doc 3 (Title: T3)\n  body"
    assert format_passages([]) == ""


@pytest.mark.parametrize("arguments", [{}, {"query_list": []}, {"query_list": "capital of France"}])
def test_a_call_without_a_query_list_is_verls_error_text(retriever, searchbox, arguments):
    box = searchbox(url(retriever))
    res = search(box, arguments)
    assert result_of(res) == "Error: 'query_list' is missing, empty, or not a list in parameters."
    assert res.reward == 0.0 and res.metrics == {} and res.error is None


@pytest.mark.parametrize("config, most", [({"rate_limit": 1}, 1), ({}, 3),
                                          ({"rate_limit": 1, "enable_global_rate_limit": False}, 3)])
def test_rate_limit_caps_requests_in_flight_across_tool_workers(retriever, searchbox, config, most):
    box = searchbox(url(retriever, "/count"), workers=3, **config)
    retriever.most = 0
    results = search(box, {"query_list": ["Paris"]}, calls=3)
    assert [r.metrics["status"] for r in results] == ["success"] * 3
    assert retriever.most == most


# -- a failing service: the model reads why, nothing raises ------------------------------------------

def test_a_dead_service_is_error_text_after_verls_retries(searchbox):
    box = searchbox(dead_url(), max_retries=3, retry_delay=0.1)
    start = time.perf_counter()
    res = search(box, {"query_list": ["anything"]})
    assert time.perf_counter() - start >= 0.3  # slept 0.1 then 0.2 between the three attempts
    text = result_of(res)
    assert text.startswith("Search error: API Call Failed: Connection Error: HTTPConnectionPool(host='127.0.0.1'")
    assert "Connection refused" in text or "actively refused" in text
    assert res.metrics["status"] == "api_error" and res.metrics["api_request_error"] == text[len("Search error: "):]
    assert res.metrics["total_results"] == 0 and res.metrics["query_count"] == 1
    assert res.error is None and res.reward == 0.0  # a service's failure is no tool failure, as in verl


def test_a_slow_service_times_out_into_error_text(retriever, searchbox):
    box = searchbox(url(retriever, "/slow"), timeout=0.3, max_retries=2, retry_delay=0)
    retriever.requests.clear()
    res = search(box, {"query_list": ["capital"]})
    assert result_of(res).startswith("Search error: API Call Failed: Timeout Error: HTTPConnectionPool(")
    assert "Read timed out. (read timeout=0.3)" in result_of(res)
    assert len(retriever.requests) == 2 and res.metrics["status"] == "api_error"


def test_server_errors_are_retried_and_other_errors_are_not(retriever, searchbox):
    retriever.requests.clear()
    res = search(searchbox(url(retriever, "/flaky"), max_retries=3, retry_delay=0), {"query_list": ["Paris"]})
    assert len(retriever.requests) == 3 and res.metrics["status"] == "success"  # two 503s, then the passages
    retriever.requests.clear()
    res = search(searchbox(url(retriever, "/down"), max_retries=2, retry_delay=0), {"query_list": ["Paris"]})
    assert len(retriever.requests) == 2
    assert result_of(res) == "Search error: API Call Failed: API Request Error: Server Error (503) on attempt 2/2"
    retriever.requests.clear()
    res = search(searchbox(url(retriever, "/missing"), max_retries=5, retry_delay=0), {"query_list": ["Paris"]})
    assert len(retriever.requests) == 1  # a 4xx ends the call
    assert result_of(res).startswith("Search error: API Call Failed: API Request Error: 404 Client Error")


@pytest.mark.parametrize("path, text, status", [
    ("/garbage", "Search error: API Call Failed: API Request Error: Expecting value: line 1 column 1 (char 0)",
     "api_error"),
    ("/empty", "No search results found.", "no_results"),
    ("/nothing", "Unknown API state (no response and no error message).", "unknown_api_state"),
    ("/odd", "Error processing search results: 'document'", "processing_error"),
])
def test_answers_of_another_shape_are_verls_texts(retriever, path, text, status):
    answered, meta = search_batch(url(retriever, path), ["q"], 3, 5, max_retries=1)
    assert json.loads(answered) == {"result": text} and meta["status"] == status


def test_a_config_without_the_service_address_is_one_config_error(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(tool_yaml("''"))
    with pytest.raises(ConfigError, match="retrieval_service_url is required") as err:
        ToolBox.from_config(SimpleNamespace(tool_config_path=str(path), function_tool_path=None,
                                            max_tool_response_length=256, tool_response_truncate_side="middle"),
                            ToolLimits(num_workers=1))
    assert err.value.key == "actor_rollout_ref.rollout.multi_turn.tool_config_path"


# -- in the tool agent loop: the call, the passages in the conversation, the answer's reward --------

def test_the_tool_agent_loop_searches_reads_and_answers(retriever, searchbox):
    from plait.agents.worker import AgentWorker
    from plait.config import PlaitConfig, SamplingConfig
    from plait.models import build_char_tokenizer
    from plait.types import PromptBatch
    from plait.workers.rollout_engine import Generation

    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    call = '<tool_call>{"name": "search", "arguments": {"query_list": ["capital of France"]}}</tool_call>'

    def model(text: str) -> str:  # the policy: search first, then answer the first passage's title
        if "<|tool|>" not in text:
            return call
        return "<answer> " + text.rsplit("<|tool|>", 1)[1].split("(Title: ", 1)[1].split(")", 1)[0] + " </answer>"

    def engine(ids, max_new_tokens, sampling):
        rows = [tok.encode(model(tok.decode(p)), add_special_tokens=False) + [tok.eos_token_id] for p in ids]
        width = max(len(r) for r in rows)
        out, mask = torch.full((len(rows), width), tok.pad_token_id), torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            out[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        return Generation(out, mask, -0.5 * mask, ["eos"] * len(rows))

    cfg = PlaitConfig()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 256, 1024
    cfg.actor_rollout_ref.rollout.agent.default_agent_loop = "tool_agent"
    box = searchbox(url(retriever), topk=1)
    worker = AgentWorker(cfg, tok, "qwen2", box)
    truth = {"target": ["Paris", "Paris, France"]}
    prompts = PromptBatch(prompt_ids=[[1]], data_sources=["searchR1_nq"], ground_truths=[truth], indices=[0],
                          extra_infos=[{"raw_prompt": [{"role": "user", "content": "What is the capital of France?"}]}],
                          agent_names=[])
    try:
        batch = worker.generate(prompts, SamplingConfig(n=1), engine, lambda: 0)
    finally:
        worker.thread.close()
    n = int(batch.attended[0].sum())
    text = tok.decode(batch.responses[0, :n])
    assert text == (call + tok.eos_token + '<|tool|>{"result": "Doc 1 (Title: Paris)\\nParis is the capital and '
                    'largest city of France."}<|end|>\n<|assistant|><answer> Paris </answer>' + tok.eos_token)
    assert batch.extra_infos[0]["tool_rewards"] == [0.0] and batch.agent_infos[0]["num_turns"] == 4
    response = text.rsplit("<|assistant|>", 1)[1]
    assert default_compute_score("searchR1_nq", response, truth) == 1.0


# -- verl's Search-R1 command line through `plait train` ---------------------------------------------

SEARCH_YAML = (Path(__file__).resolve().parents[1] / "fixtures" / "verl_configs" / "search_multiturn_grpo.yaml").read_text()

PREFIX = ("Answer the given question. Think inside <think> and </think>, search with the search tool when you lack "
          "knowledge, and give the answer inside <answer> and </answer>. Question: ")
QUESTIONS = [("nq", "What is the capital of France?", ["Paris"]), ("hotpotqa", "Where is the Eiffel Tower?", ["Paris"]),
             ("triviaqa", "What is the highest mountain?", ["Mount Everest", "Everest"]),
             ("popqa", "Who created Python?", ["Guido van Rossum"])]


def write_search_rows(path: Path, split: str, n: int) -> None:
    """Rows as verl's examples/data_preprocess/preprocess_search_r1_dataset.py writes them."""
    rows = []
    for i in range(n):
        source, question, answers = QUESTIONS[i % len(QUESTIONS)]
        truth = {"target": answers}
        rows.append({"data_source": f"searchR1_{source}", "ability": "fact-reasoning",
                     "prompt": [{"role": "system", "content": "You are a helpful and harmless assistant."},
                                {"role": "user", "content": PREFIX + question}],
                     "reward_model": {"style": "rule", "ground_truth": truth},
                     "extra_info": {"index": i, "need_tools_kwargs": True, "question": question, "split": split,
                                    "tools_kwargs": {"search": {"create_kwargs": {
                                        "ground_truth": truth, "question": question,
                                        "data_source": f"searchR1_{source}"}}}}})
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_verls_search_r1_command_line_trains(tmp_path, retriever):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "search_multiturn_grpo.yaml").write_text(SEARCH_YAML)
    (tmp_path / "search_tool_config.yaml").write_text(tool_yaml(url(retriever)))
    write_search_rows(tmp_path / "train.parquet", "train", 8)
    write_search_rows(tmp_path / "test.parquet", "test", 4)
    cmd = [sys.executable, "-m", "plait.cli", "train", f"--config-path={tmp_path / 'config'}",
           "--config-name=search_multiturn_grpo", "--no-progress",
           "algorithm.adv_estimator=grpo", "data.train_batch_size=2", "data.val_batch_size=4",
           "data.max_prompt_length=512", "data.max_response_length=24", "data.filter_overlong_prompts=True",
           "data.truncation=error", "data.return_raw_chat=True", "actor_rollout_ref.actor.optim.lr=1e-6",
           "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285",
           "actor_rollout_ref.model.use_remove_padding=True",
           "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
           "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
           "actor_rollout_ref.model.enable_gradient_checkpointing=True",
           "actor_rollout_ref.actor.fsdp_config.param_offload=False",
           "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
           "actor_rollout_ref.rollout.max_model_len=15000",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=hf",
           "actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "actor_rollout_ref.rollout.n=2",
           "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.ref.fsdp_config.param_offload=True",
           "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.val_before_train=False",
           "trainer.logger=[console]", "trainer.project_name=search_r1_like_async_rl", "trainer.experiment_name=tiny",
           "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.test_freq=2",
           f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'test.parquet'}",
           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'search_tool_config.yaml'}",
           "trainer.total_epochs=1",
           # what differs from verl's script: verl's rows have no agent_name column, so the tools need the tool loop
           # named as the default (verl 0.9.1 runs them single-turn otherwise), and that loop needs a call format
           # verl 0.9.1 parses (its yaml's `qwen` is none: Qwen2.5 writes hermes); a tiny model and two steps here
           "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
           "actor_rollout_ref.rollout.multi_turn.format=hermes", "trainer.total_training_steps=2",
           "demo.model_size=xs", "demo.warmstart_steps=0", f"trainer.default_local_dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "multi_turn" not in said and "single_turn_agent" not in said and "tools[0]" not in said, said[-3000:]
    from plait.trainers.lifecycle import read_metrics
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    train = [r for r in records if "num_turns/mean" in r]
    assert len(train) == 2 and all("critic/score/mean" in r for r in train)
    val = [r for r in records if any(k.startswith("val-core/searchR1_") for k in r)]
    assert val, "the validation rows are scored per searchR1_* data source"


# -- beside verl's own helper ----------------------------------------------------------------------

VERL_SOURCE = os.environ.get("PLAIT_VERL_SOURCE")  # a verl checkout: its wheel (0.9.1) ships no search tool
VERL_HELPER = Path(VERL_SOURCE or ".") / "verl" / "tools" / "utils" / "search_r1_like_utils.py"


@pytest.mark.skipif(not VERL_HELPER.is_file(), reason="verl's source not given: set PLAIT_VERL_SOURCE to a verl "
                    "checkout (b178a3c was checked) to compare with its search_r1_like_utils.py")
def test_search_batch_equals_verls_helper_side_by_side(retriever):
    """verl's perform_single_search_batch (its retry count and delay set as ours) and search_batch on the same
    services: the same text, metadata and number of requests."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("verl_search_r1_like_utils", VERL_HELPER)
    verl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verl)  # it imports requests and the standard library only
    verl.MAX_RETRIES, verl.INITIAL_RETRY_DELAY = 3, 0
    cases = [(url(retriever, p), q, k, 5) for p in ("/retrieve", "/empty", "/nothing", "/odd", "/garbage", "/missing",
                                                    "/down") for q, k in ((["capital of France", "Nile"], 2),
                                                                          (["Zürich"], 1), ([3, None], 3))]
    cases += [(url(retriever, "/slow"), ["x"], 3, 0.3), (dead_url(), ["x"], 3, 5)]
    for service, queries, topk, timeout in cases:
        retriever.requests.clear()
        theirs = verl.perform_single_search_batch(service, queries, topk, timeout=timeout)
        sent = len(retriever.requests)
        retriever.requests.clear()
        ours = search_batch(service, queries, topk, timeout, max_retries=3, retry_delay=0)
        assert (ours, len(retriever.requests)) == (theirs, sent), service
