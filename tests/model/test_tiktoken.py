"""A Kimi-style ``tiktoken.model`` checkpoint (``model/tiny_tiktoken.py``): the worker reads it (ids equal those of
a ``tiktoken.Encoding`` built the way Kimi's ``tokenization_kimi.py`` builds it, special ids from
``tokenizer_config.json``), detokenizes it incrementally across a character split over several tokens, ships it
through ``GetTokenizer``, and it serves through smg with stop strings that stop."""


import pytest

from engine.stop_strings import IncrementalDetokenizer
from model.tiny_tiktoken import SPECIALS, write_tiktoken_checkpoint
from model.tokenizer import KIMI_PATTERN, TiktokenTokenizer, load_tokenizer, read_ranks
from tests.engine.test_stop_strings import spanning_stop, where_it_stops
from tests.support.rpc_helpers import ServerProcess, smg_gateway


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiktoken_checkpoint(tmp_path_factory.mktemp("kimi_tiktoken"))


def test_ids_equal_kimis_own_construction(ckpt):
    import tiktoken

    tok = load_tokenizer(ckpt)
    assert isinstance(tok, TiktokenTokenizer)
    ranks = read_ranks(ckpt / "tiktoken.model")
    base = len(ranks)
    names = {base + k: v for k, v in SPECIALS.items()}
    special = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + 256)}
    ref = tiktoken.Encoding("ref", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special)
    text = "<|im_user|>user<|im_middle|>def load_tokenizer(ckpt):\n    return 你好 42<|im_end|>"
    assert tok.encode(text) == ref.encode(text, allowed_special="all")
    assert tok.encode("<|im_end|>") == [base + 2] and tok.encode(f"<|reserved_token_{base + 5}|>") == [base + 5]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "userdef load_tokenizer(ckpt):\n    return 你好 42"


def test_incremental_text_waits_for_a_whole_character(ckpt):
    tok = load_tokenizer(ckpt)
    ids = tok.encode("a 你好")
    assert len(ids) >= 4  # the Chinese characters are raw bytes here: 3 tokens each
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == "a 你好" and "\ufffd" not in "".join(pieces) and pieces.count("") >= 4


def test_get_tokenizer_ships_the_tiktoken_files(ckpt, tmp_path):
    srv = ServerProcess(str(ckpt), ["parallel=single", "model=hf"], tmp_path / "server.log")
    try:
        client = srv.wait_ready()
        files = client.tokenizer_files()
        assert {"tiktoken.model", "tokenizer_config.json", "config.json", "generation_config.json"} <= set(files)
        assert files["tiktoken.model"] == (ckpt / "tiktoken.model").read_bytes()
        client.close()
    finally:
        srv.close()


def test_a_tiktoken_checkpoint_serves_through_smg_and_its_stop_strings_stop(ckpt, tmp_path):
    from openai import OpenAI

    srv = ServerProcess(str(ckpt), ["parallel=single", "model=hf", "server.served_model_name=kimi"],
                        tmp_path / "server.log")
    try:
        client = srv.wait_ready()
        tok = load_tokenizer(ckpt)
        prompt = "def stop(self):\n    return"
        out = client.generate(tok.encode(prompt), temperature=0.0, max_tokens=40, ignore_eos=True).token_ids
        stop = spanning_stop(tok, out)
        n = where_it_stops(tok, out, stop, 0)
        with smg_gateway(srv.target, ckpt, tmp_path / "smg.log") as base:
            sdk = OpenAI(base_url=f"{base}/v1", api_key="none")
            done = sdk.completions.create(model="kimi", prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                                          extra_body={"ignore_eos": True})
        assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == n, (stop, done)
        assert stop not in done.choices[0].text
        client.close()
    finally:
        srv.close()
