"""lm-eval's OpenAI API models run a small task through the server unchanged.

``local-completions`` and ``local-chat-completions`` are lm-eval's own clients; the task is a local
JSON file (no download). What lm-eval records as each answer must be what the server answers.
"""

import json

import openai
import pytest

from serving import serving

QUESTIONS = [("the old man said", "that"), ("water is", "the"), ("write a new", "line"), ("the first", "time")]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_task")
    with open(folder / "data.jsonl", "w") as f:
        for question, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    (folder / "r2r_tiny.yaml").write_text(f"""task: r2r_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "data.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
    return folder


@pytest.mark.parametrize("kind, path", [("local-completions", "completions"),
                                        ("local-chat-completions", "chat/completions")])
def test_lm_eval_runs_a_task_through_the_server(model, tok, task_dir, kind, path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with serving(model, tok) as (url, service):
        args = f"base_url={url}/v1/{path},model=tiny,tokenizer_backend=None,tokenized_requests=False,num_concurrent=2"
        results = simple_evaluate(model=kind, model_args=args, tasks=["r2r_tiny"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(task_dir)),
                                  apply_chat_template=kind.endswith("chat-completions"))
        samples = results["samples"]["r2r_tiny"]
        assert len(samples) == len(QUESTIONS) and "exact_match,none" in results["results"]["r2r_tiny"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for sample in samples:
            question = sample["doc"]["question"]
            if kind == "local-completions":
                direct = client.completions.create(model="tiny", prompt=question, max_tokens=6, temperature=0,
                                                   stop=["\n\n"]).choices[0].text
            else:
                direct = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                                        max_tokens=6, temperature=0,
                                                        stop=["\n\n"]).choices[0].message.content
            assert sample["resps"][0][0] == direct
        assert service.engine.steps_run > 0
