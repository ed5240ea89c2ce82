"""The OpenAI path: ``smg launch`` (the SMG gateway) in front of a real server, driven by the OpenAI SDK —
completions and chat, plain and streaming — and the text equals the server's own greedy tokens decoded with the
checkpoint's tokenizer. The tiny checkpoint gets a small tokenizer (``model.tiny.write_char_tokenizer``) since it
has none."""


import pytest

from model.tiny import CHAT_TEMPLATE
from tests.support.rpc_helpers import ServerProcess, smg_gateway, with_tokenizer

CKPT = "tiny_deepseek"
MODEL = "tiny"


@pytest.fixture(scope="module")
def gateway(tiny_ckpts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smg")
    ckpt = with_tokenizer(tiny_ckpts[CKPT], tmp / "ckpt")
    srv = ServerProcess(str(ckpt), ["parallel=single", f"server.served_model_name={MODEL}"], tmp / "server.log")
    client = None
    try:
        client = srv.wait_ready()
        with smg_gateway(srv.target, ckpt, tmp / "smg.log", "--disable-retries", "--disable-circuit-breaker",
                         model=MODEL) as base:
            yield base, client, ckpt
    finally:
        if client is not None:
            client.close()
        srv.close()


def direct(client, ckpt, text: str, max_tokens: int):
    """(text, finish_reason, prompt ids) of the server's own greedy answer, decoded as smg does."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    out = client.generate(ids, max_tokens=max_tokens, temperature=0.0)
    return tok.decode(out.token_ids, skip_special_tokens=True), out.finish_reason, ids


def test_openai_completions(gateway):
    from openai import OpenAI

    base, client, ckpt = gateway
    oai = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    prompt = "Hello world"
    text, reason, ids = direct(client, ckpt, prompt, 8)
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text, reason)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens > 0
    chunks = list(oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]


def test_openai_chat(gateway):
    from jinja2 import Template
    from openai import OpenAI

    base, client, ckpt = gateway
    oai = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text, reason, _ = direct(client, ckpt, Template(CHAT_TEMPLATE).render(messages=messages,
                                                                        add_generation_prompt=True), 8)
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, reason)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]


def test_get_tokenizer_streams_the_files(gateway):
    _, client, ckpt = gateway
    files = client.tokenizer_files()  # the sha256 on the last chunk is checked by the client
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(files)
    assert files["tokenizer.json"] == (ckpt / "tokenizer.json").read_bytes()


def test_cached_tokens_reach_openai_usage(gateway):
    """A second chat turn that re-sends the first (the agent pattern): the worker's ``cached_tokens`` come through
    smg as ``usage.prompt_tokens_details.cached_tokens``, streamed and not."""
    from openai import OpenAI

    base, _, _ = gateway
    oai = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    history = [{"role": "system", "content": "You are a terse assistant that answers in one line."},
               {"role": "user", "content": "List three prime numbers below twenty, please."}]
    first = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And three more?"}]
    second = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0, second.usage
    streamed = list(oai.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens > 0
