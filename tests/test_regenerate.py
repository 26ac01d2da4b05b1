"""python -m specforge.regenerate: self-distilled rows, resume, eval hold-out, features, backends.

Most tests swap the generation engine for a deterministic fake (answers depend on the prompt, so
conditioning on the regenerated history is visible); one runs the real engine on a tiny Llama.
"""

import http.server
import json
import socket
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specforge import regenerate as rg
from specforge.config import load_config
from specforge.data.heldout import heldout_sources
from specforge.data.prepare import prepare_dataset
from specforge.data.sharegpt import iter_conversations
from specforge.data.store import FeatureStore
from specforge.data.template import render, tokenize_conversation
from specforge.models import generate as engine
from specforge.models.target import TargetModel, capture
from tests.helpers.data import make_tokenizer

# ---------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from threads, and 2 threads on a shared 2-core box spin (10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def target(tok):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    model.lm_head.weight[tok.eos_token_id] = 0.0  # random weights chose eos first: empty answers otherwise
    return TargetModel(model=model, tokenizer=tok, aux_layer_ids=[0, 1, 2], device=torch.device("cpu"))


def conv(*turns):
    roles = ["human", "gpt"]
    return {"conversations": [{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]}


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def data_file(tmp_path):
    rows = [
        conv("hello one", "old answer one"),  # 0
        conv("hello two", "old answer two", "follow up two", "old second answer two"),  # 1: two turns
        "{broken",  # 2: bad json
        conv("hello three", "old answer three"),  # 3
        {"conversations": [{"from": "human", "value": "no reply"}]},  # 4: no assistant turn
        conv("question " * 120, "old long"),  # 5: first prompt too long for max_length 96
        conv("hello six", "old answer six", "world " * 60, "old"),  # 6: second prompt does not fit
        conv("hello seven", "old answer seven"),  # 7
        conv("eval question eight", "old answer eight"),  # 8: held out
        conv("eval question nine", "old answer nine"),  # 9: held out
    ]
    return write_rows(tmp_path / "data.jsonl", rows)


def make_cfg(tmp_path, data_file, *overrides):
    return load_config(None, [
        f"data.path={data_file}", "data.max_length=96", "data.num_eval=2", f"train.output_dir={tmp_path / 'run'}",
        f"regenerate.output={tmp_path / 'out.jsonl'}", f"store.dir={tmp_path / 'features'}",
        "regenerate.batch_size=2", "regenerate.max_new_tokens=32", *overrides,
    ])


class FakeEngine:
    """Stands in for specforge.models.generate.generate: answer = "re: <last user words>", + stop."""

    def __init__(self, tok, fail_on_call=None):
        self.tok, self.fail_on_call = tok, fail_on_call
        self.prompts: list[str] = []
        self.calls = 0

    def __call__(self, target, prompts, params, stop_ids, capture=False, batch_size=32, progress=None):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise KeyboardInterrupt
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            self.prompts.append(text)
            last_user = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
            ids = self.tok(f"re: {last_user[:14]}", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            reason = "stop" if len(ids) <= params.max_new_tokens else "length"
            ids = ids[: params.max_new_tokens]
            feats = _capture(target, list(p) + ids) if capture else None
            out.append(engine.Generation(list(p), ids, reason, feats))
            if progress:
                progress(len(ids))
        return out


def _capture(target, ids):
    return capture(target, torch.tensor([ids]))


@pytest.fixture
def fake(tok, monkeypatch):
    f = FakeEngine(tok)
    monkeypatch.setattr(engine, "generate", f)
    return f


def out_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- rows and the eval hold-out


@pytest.mark.parametrize("max_samples", [None, 7])
def test_heldout_rows_are_exactly_prepare_datasets_eval_split(tok, tmp_path, max_samples):
    rows = [conv(f"q{i}", f"a{i} hello") for i in range(9)]
    rows.insert(4, "{broken")
    rows.insert(8, conv("question " * 80, "no loss: cut before the answer"))  # unusable in the tail
    path = write_rows(tmp_path / "d.jsonl", rows)
    cfg = load_config(None, [f"data.path={path}", "data.max_length=64", "data.num_eval=3",
                             f"data.max_samples={'null' if max_samples is None else max_samples}"])
    held = heldout_sources(cfg.data, tok, tok.chat_template)
    prepared = prepare_dataset(cfg.data, tok, cache_dir=None, progress=False)
    by_row = {c.index: c.messages for c in iter_conversations(path) if c.ok}
    assert len(held) == 3
    got = sorted(tokenize_conversation(tok, by_row[i], 64)[0] for i in held)
    assert got == sorted(list(r) for r in prepared.eval["input_ids"])


def test_rows_skips_multi_turn_conditioning_and_output_format(tok, target, fake, tmp_path, data_file):
    cfg = make_cfg(tmp_path, data_file)
    s = rg.regenerate(cfg, target=target)
    rows = out_rows(tmp_path / "out.jsonl")
    assert sorted(r["source_row"] for r in rows) == [0, 1, 3, 6, 7]
    assert s.rows_done == 5 and s.turns_dropped == 1
    assert s.skipped == {"bad json": 1, "no assistant turn": 1, rg.PROMPT_TOO_LONG: 1, rg.HELD_OUT: 2}
    # no prompt of a held-out row reached the engine or the output
    assert not any("eval question" in p for p in fake.prompts)
    assert "eval question" not in (tmp_path / "out.jsonl").read_text()
    two = next(r for r in rows if r["source_row"] == 1)
    assert [t["from"] for t in two["conversations"]] == ["human", "gpt", "human", "gpt"]
    assert two["conversations"][1]["value"] == "re: hello two"
    # turn 2 was conditioned on the regenerated turn 1, not on the source answer
    turn2 = [p for p in fake.prompts if "follow up two" in p]
    assert len(turn2) == 1 and "re: hello two" in turn2[0] and "old answer two" not in turn2[0]
    assert two["generation"] == {"backend": "local", "model": cfg.model.target_path, "max_new_tokens": 32,
                                 "temperature": 0.0, "top_p": 1.0, "seed": 0, "finish_reasons": ["stop", "stop"]}
    six = next(r for r in rows if r["source_row"] == 6)  # its second prompt did not fit: one turn kept
    assert len(six["conversations"]) == 2
    # the data pipeline reads the output back as training conversations
    back = {c.index: c.messages for c in iter_conversations(tmp_path / "out.jsonl") if c.ok}
    assert len(back) == 5 and back[0][1] == {"role": "assistant", "content": "re: hello one"}


def prompt_len(tok, text):
    chat = render(tok, [{"role": "user", "content": text}], tok.chat_template, add_generation_prompt=True)
    return len(tok(chat, add_special_tokens=False)["input_ids"])


def test_answers_are_cut_to_fit_max_length(tok, target, fake, tmp_path):
    L = 40
    n = max(n for n in range(1, 40) if prompt_len(tok, "hello " * n) <= L - 3)  # room for ~3 new tokens
    data = write_rows(tmp_path / "d.jsonl", [conv("hello " * n, "x"), conv("short", "y"), conv("held out", "z")])
    rg.regenerate(make_cfg(tmp_path, data, f"data.max_length={L}", "data.num_eval=1"), target=target)
    rows = {r["source_row"]: r for r in out_rows(tmp_path / "out.jsonl")}
    # one engine call serves both rows at the larger cap (32); the tight row is cut to its own room
    assert rows[0]["generation"]["finish_reasons"] == ["length"] and rows[1]["generation"]["finish_reasons"] == ["stop"]
    assert FeatureStore(tmp_path / "features").lengths[0] == L


def test_a_template_that_refuses_a_turn_skips_or_ends_the_row(tok, target, fake, tmp_path):
    picky = make_tokenizer()
    picky.chat_template = ("{% for m in messages %}{% if 'forbidden' in m['content'] %}{{ raise_exception('no') }}"
                           "{% endif %}{% endfor %}" + picky.chat_template)
    strict = TargetModel(model=target.model, tokenizer=picky, aux_layer_ids=target.aux_layer_ids, device=target.device)
    data = write_rows(tmp_path / "d.jsonl", [conv("forbidden", "x"), conv("fine", "y", "forbidden later", "z"),
                                             conv("ok", "w"), conv("held out", "v")])
    s = rg.regenerate(make_cfg(tmp_path, data, "data.num_eval=1"), target=strict)
    rows = {r["source_row"]: r for r in out_rows(tmp_path / "out.jsonl")}
    assert sorted(rows) == [1, 2] and len(rows[1]["conversations"]) == 2  # row 1 ends before its 2nd turn
    assert s.skipped == {rg.TEMPLATE_FAILED: 1, rg.HELD_OUT: 1} and s.turns_dropped == 1


# ---------------------------------------------------------------- resume


def test_interrupted_run_resumes_without_redoing_rows(tok, target, tmp_path, data_file, monkeypatch):
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    monkeypatch.setattr(engine, "generate", FakeEngine(tok))
    rg.regenerate(make_cfg(ref_dir, data_file, "regenerate.capture_features=false"), target=target)
    want = {r["source_row"]: r for r in out_rows(ref_dir / "out.jsonl")}

    cfg = make_cfg(tmp_path, data_file, "regenerate.capture_features=false", "regenerate.batch_size=1")
    # 4-row chunks: call 1 = turn 1 of rows 0, 1, 3 (5 is too long), call 2 = turn 2 of row 1,
    # call 3 = rows 6, 7 (chunk 2): interrupted there
    monkeypatch.setattr(engine, "generate", FakeEngine(tok, fail_on_call=3))
    with pytest.raises(KeyboardInterrupt):
        rg.regenerate(cfg, target=target)
    first = out_rows(tmp_path / "out.jsonl")
    assert sorted(r["source_row"] for r in first) == [0, 1, 3]
    with open(tmp_path / "out.jsonl", "a") as f:  # a row torn mid-write by the kill
        f.write('{"id": "regen-7", "source_row": 7, "conv')
    second = FakeEngine(tok)
    monkeypatch.setattr(engine, "generate", second)
    s = rg.regenerate(cfg, target=target)
    assert s.rows_resumed == len(first) and s.rows_done == len(want) - len(first)
    assert len(second.prompts) == 2 and "hello six<" in second.prompts[0] and "hello seven<" in second.prompts[1]
    final = out_rows(tmp_path / "out.jsonl")
    assert sorted(r["source_row"] for r in final) == sorted(want)  # each once, the torn line gone
    assert {r["source_row"]: r for r in final} == want


def test_changed_settings_are_refused_on_resume(tok, target, fake, tmp_path, data_file):
    rg.regenerate(make_cfg(tmp_path, data_file, "regenerate.capture_features=false"), target=target)
    with pytest.raises(ValueError, match=r"temperature=0.0 \(now 0.7\)"):
        rg.regenerate(make_cfg(tmp_path, data_file, "regenerate.capture_features=false",
                               "regenerate.temperature=0.7"), target=target)


# ---------------------------------------------------------------- features


def test_features_go_to_the_store_with_the_training_loss_mask(tok, target, fake, tmp_path, data_file):
    cfg = make_cfg(tmp_path, data_file)
    rg.regenerate(cfg, target=target)
    store = FeatureStore(tmp_path / "features")
    rows = {r["source_row"]: r for r in out_rows(tmp_path / "out.jsonl")}
    assert store.ids == sorted(rows)
    assert store.meta.source.startswith("regenerated:") and store.meta.max_length == 96
    for sid, row in rows.items():
        got = store.read(sid)
        messages = [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
                    for t in row["conversations"]]
        ids, mask, _ = tokenize_conversation(tok, messages, 10_000)
        n = len(got["input_ids"])
        # the stored sequence = the training tokenization of the final conversation up to the last
        # answer's <|im_end|> (the template's trailing newline is not generated)
        assert got["input_ids"].tolist() == ids[:n] and len(ids) == n + 1
        assert got["loss_mask"].tolist() == mask[:n]
        if sid == 1:  # both assistant turns are in the loss: the regenerated first one inside the prompt
            assert len([i for i in range(1, n) if mask[i] and not mask[i - 1]]) == 2
        want = _capture(target, ids[:n])
        torch.testing.assert_close(got["aux_hidden"].float(), want.aux_hidden_BTKH[0], atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(got["last_hidden"].float(), want.last_hidden_BTH[0], atol=3e-2, rtol=2e-2)
        assert got["target_ids"].tolist() == want.target_ids_BT[0].tolist()


def test_rows_whose_features_were_lost_are_regenerated(tok, target, tmp_path, monkeypatch):
    letters = "abcdefg"  # g is held out; 4-row chunks: a-d in engine call 1, e-f in call 2
    data = write_rows(tmp_path / "d.jsonl", [conv(f"hello {c}", "old") for c in letters])
    tokens = [prompt_len(tok, f"hello {c}") + len(tok(f"re: hello {c}")["input_ids"]) + 1 for c in letters]
    shard_mb = (sum(tokens[:3]) - 0.5) * (4 * 64 * 2 + 9) / 2**20  # bf16 aux+last, int32 ids x2, uint8 mask
    cfg = make_cfg(tmp_path, data, "data.num_eval=1", "regenerate.batch_size=1", f"store.shard_mb={shard_mb!r}")
    monkeypatch.setattr(engine, "generate", FakeEngine(tok, fail_on_call=2))
    with pytest.raises(KeyboardInterrupt):
        rg.regenerate(cfg, target=target)
    assert [r["source_row"] for r in out_rows(tmp_path / "out.jsonl")] == [0, 1, 2, 3]
    # a, b, c filled a shard; d was still buffered when the run died
    assert FeatureStore(tmp_path / "features", allow_partial=True).ids == [0, 1, 2]
    again = FakeEngine(tok)
    monkeypatch.setattr(engine, "generate", again)
    s = rg.regenerate(cfg, target=target)
    assert (s.rows_resumed == 3
            and [p.split("user\n")[1][:7] for p in again.prompts] == ["hello d", "hello e", "hello f"])
    final = [r["source_row"] for r in out_rows(tmp_path / "out.jsonl")]
    assert final == FeatureStore(tmp_path / "features").ids == [0, 1, 2, 3, 4, 5]


def test_real_engine_greedy_equals_a_plain_argmax_loop(tok, target, tmp_path, data_file):
    rg.regenerate(make_cfg(tmp_path, data_file, "regenerate.max_new_tokens=6"), target=target)
    stop = rg.stop_token_ids(tok, tok.chat_template, target.model)
    store = FeatureStore(tmp_path / "features")
    single = [r for r in out_rows(tmp_path / "out.jsonl") if len(r["conversations"]) == 2]
    assert len(single) >= 3  # multi-turn prompts are rebuilt from decoded text: the fake tests pin them
    for row in single:
        chat = render(tok, [{"role": "user", "content": row["conversations"][0]["value"]}], tok.chat_template,
                      add_generation_prompt=True)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            for _ in range(6):
                nxt = int(target.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(nxt)
                if nxt in stop:
                    break
        assert store.read(row["source_row"])["input_ids"].tolist() == ids


@pytest.mark.slow
@pytest.mark.ray
def test_ray_workers_write_what_one_process_writes(tok, target, tmp_path, data_file, ray_session):
    """Two Ray workers regenerating the answers write, merged in source order, what one process writes.
    The runs join the session's cluster (tests/conftest.py), as a run does where Ray is already started
    (``start_ray``); a run that starts its own is the CLI tests' (tests/test_bad_input.py,
    tests/test_resume.py). 42.6 s in the 4ebf4f1 run, when each run started a cluster of its own and
    spawned its workers, 7.8 s in the 782977c run."""
    model_dir = tmp_path / "tiny"
    target.model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    common = [f"model.target_path={model_dir}", "model.aux_layer_ids=[0,1,2]", "regenerate.max_new_tokens=6"]
    rg.regenerate(make_cfg(tmp_path / "one", data_file, *common))
    s = rg.regenerate(make_cfg(tmp_path / "two", data_file, *common, "regenerate.num_workers=2"))
    one = sorted(out_rows(tmp_path / "one" / "out.jsonl"), key=lambda r: r["source_row"])
    two = out_rows(tmp_path / "two" / "out.jsonl")  # merged in source order
    assert two == one and s.rows_done == len(one)
    parts = [FeatureStore(tmp_path / "two" / "features" / f"worker-{k}-of-2") for k in range(2)]
    assert sorted(parts[0].ids + parts[1].ids) == [r["source_row"] for r in one]
    ref = FeatureStore(tmp_path / "one" / "features")
    for part in parts:
        for sid in part.ids:
            assert torch.equal(part.read(sid)["input_ids"], ref.read(sid)["input_ids"])
    again = rg.regenerate(make_cfg(tmp_path / "two", data_file, *common, "regenerate.num_workers=2"))
    assert again.rows_done == 0 and again.rows_resumed == len(one)
    with pytest.raises(ValueError, match="another regenerate.num_workers"):
        rg.regenerate(make_cfg(tmp_path / "two", data_file, *common))


# ---------------------------------------------------------------- OpenAI-compatible endpoint


class FakeServer:
    """A canned /v1/chat/completions on 127.0.0.1; after ``budget`` requests it drops connections."""

    def __init__(self, budget=10_000):
        self.bodies, self.budget = [], budget
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.budget <= 0:
                    self.close_connection = True  # no response at all: the client sees a reset
                    return
                outer.budget -= 1
                outer.bodies.append(body)
                last = body["messages"][-1]["content"]
                reply = {"choices": [{"message": {"role": "assistant", "content": f"srv: {last[:12]}"},
                                      "finish_reason": "stop"}], "usage": {"completion_tokens": 3}}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def openai_cfg(tmp_path, data_file, url, *overrides):
    return make_cfg(tmp_path, data_file, "regenerate.backend=openai", f"regenerate.endpoint={url}",
                    "regenerate.api_model=tiny", "regenerate.concurrency=2", "regenerate.retries=1",
                    "regenerate.timeout_s=5", *overrides)


def test_openai_backend_multi_turn_and_resume(tok, server, tmp_path, data_file, monkeypatch):
    from specforge.models import target as target_mod

    monkeypatch.setattr(target_mod, "load_tokenizer", lambda model_cfg: tok)
    cfg = openai_cfg(tmp_path, data_file, server.url)
    s = rg.regenerate(cfg)
    rows = {r["source_row"]: r for r in out_rows(tmp_path / "out.jsonl")}
    assert sorted(rows) == [0, 1, 3, 6, 7] and s.tokens == 3 * len(server.bodies)
    assert rows[1]["conversations"][3]["value"] == "srv: follow up tw"
    assert rows[1]["generation"]["model"] == "tiny" and rows[1]["generation"]["backend"] == "openai"
    turn2 = next(b for b in server.bodies if b["messages"][-1]["content"] == "follow up two")
    assert [m["content"] for m in turn2["messages"]] == ["hello two", "srv: hello two", "follow up two"]
    assert turn2["model"] == "tiny" and turn2["temperature"] == 0.0 and turn2["seed"] == rg.turn_seed(0, 1, 1)
    assert len({b["seed"] for b in server.bodies}) == len(server.bodies)  # sampling streams differ per row/turn
    assert all(1 <= b["max_tokens"] <= 32 for b in server.bodies)
    assert not (tmp_path / "features").exists()  # nothing to capture from an endpoint
    n = len(server.bodies)
    assert rg.regenerate(cfg).rows_resumed == 5 and len(server.bodies) == n  # a rerun sends nothing


def test_endpoint_that_goes_down_fails_clearly_and_keeps_finished_rows(tok, tmp_path, data_file, monkeypatch):
    from specforge.models import target as target_mod

    monkeypatch.setattr(target_mod, "load_tokenizer", lambda model_cfg: tok)
    flaky = FakeServer(budget=3)  # chunk 1 (rows 0, 1, 3, 5) needs 4 requests
    try:
        cfg = openai_cfg(tmp_path, data_file, flaky.url, "regenerate.concurrency=1")
        with pytest.raises(rg.EndpointError, match=rf"{flaky.url}/chat/completions failed after 2 attempts"):
            rg.regenerate(cfg)
    finally:
        flaky.close()
    kept = {r["source_row"] for r in out_rows(tmp_path / "out.jsonl")}
    assert kept == {0, 3}  # rows 0, 1, 3 got turn 1 answered, then the endpoint died before row 1's turn 2
    healthy = FakeServer()
    try:
        s = rg.regenerate(openai_cfg(tmp_path, data_file, healthy.url))
        asked = [b["messages"][0]["content"] for b in healthy.bodies]
        assert sorted(set(asked)) == ["hello seven", "hello six", "hello two"]  # only the unfinished rows
        assert s.rows_resumed == 2 and s.rows_done == 3
    finally:
        healthy.close()


def test_unreachable_endpoint_and_cli_error_line(tok, tmp_path, data_file, monkeypatch, capsys):
    from specforge.models import target as target_mod

    monkeypatch.setattr(target_mod, "load_tokenizer", lambda model_cfg: tok)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text("regenerate:\n  backend: openai\n")
    args = [f"data.path={data_file}", "data.num_eval=2", f"regenerate.output={tmp_path / 'o.jsonl'}",
            f"regenerate.endpoint=http://127.0.0.1:{port}/v1", "regenerate.retries=2"]
    assert rg.main(["--config", str(cfg_file), *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()  # the progress bar, then one error line
    assert err[-1].startswith("error: endpoint http://127.0.0.1:") and "Traceback" not in "".join(err)
    assert "failed after 3 attempts" in err[-1] and "Connection refused" in err[-1]
    assert rg.main(["--config", str(cfg_file), f"data.path={data_file}"]) == 1  # no endpoint given
    assert "regenerate.endpoint" in capsys.readouterr().err
