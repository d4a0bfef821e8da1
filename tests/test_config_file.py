"""`pageserve serve --config FILE`: vLLM's YAML of flags, under the command line's."""

import json

import pytest

from pageserve.app.cli import build_parser, main
from pageserve.app.config_file import config_path

pytestmark = pytest.mark.unit


def parse(argv: list[str]):
    config, argv = config_path(argv)
    return build_parser(config).parse_args(argv)


def test_the_file_s_flags_under_the_command_line_s(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "port: 8301\nmax_num_seqs: 7\napi-key: [k1, k2]\n--served-model-name: [a, b]\n"
        "enable-prefix-caching: false\ndisable-frontend: true\ndtype: float32\n"
        'speculative-config: {"method": "ngram", "num_speculative_tokens": 3}\n')
    ns = parse(["serve", "--config", str(tmp_path / "c.yaml"), "./m", "--port", "9000", "--api-key", "k3"])
    assert (ns.port, ns.max_num_seqs, ns.dtype, ns.model_tag) == (9000, 7, "float32", "./m")
    assert ns.api_key == ["k1", "k2", "k3"] and ns.served_model_name == ["a", "b"]
    assert ns.enable_prefix_caching is False and ns.disable_frontend is True
    assert json.loads(ns.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    (tmp_path / "no.yaml").write_text("no-enable-prefix-caching: true\nno_enable_chunked_prefill: false\n")
    ns = parse(["serve", "--config", str(tmp_path / "no.yaml")])
    assert ns.enable_prefix_caching is False and ns.enable_chunked_prefill is True
    ns = parse(["serve", f"--config={tmp_path / 'c.yaml'}", "--no-enable-prefix-caching", "--served-model-name", "z"])
    assert ns.port == 8301 and ns.served_model_name == ["z"]
    assert parse(["serve"]).port == 8000  # the file's values are one parser's, not the next one's
    (tmp_path / "empty.yaml").write_text("")
    assert parse(["serve", "--config", str(tmp_path / "empty.yaml")]).port == 8000


@pytest.mark.parametrize("text, message", [
    ("prot: 1\n", "--config {f}: 'prot' is not a flag of pageserve serve"),
    ("trust-remote-code: true\n", "--config {f}: 'trust-remote-code' is vLLM's: pageserve runs its own code"),
    ("config: other.yaml\n", "--config {f}: 'config' is not a flag of pageserve serve"),
    ("- port\n", "--config {f}: the file must be a mapping of flag names to values, not a list"),
    ("port: [1, 2]\n", "--config {f}: port: wants one value, not a list"),
    ("disable-frontend: 1\n", "--config {f}: disable-frontend: wants true or false"),
    ("api-key: []\n", "--config {f}: api-key: wants at least one value"),
    ("port: null\n", "--config {f}: port: wants a value"),
    ("a: [\n", "--config {f}: while parsing a flow node"),
])
def test_a_bad_file_is_one_error_line(tmp_path, capsys, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    assert main(["serve", "--config", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pageserve serve: error: " + message.format(f=f)), err


def test_a_value_the_flag_does_not_take_and_a_missing_file(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("port: abc\n")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--config", str(tmp_path / "c.yaml")])
    assert exit_.value.code == 2 and "argument --port: invalid int value: 'abc'" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "No such file or directory" in capsys.readouterr().err
    assert main(["serve", "--config"]) == 2 and "--config needs a file" in capsys.readouterr().err


def test_the_docs_yaml_examples_are_flags_serve_takes(tmp_path):
    import re
    from pathlib import Path

    from pageserve.app.config_file import config_args
    from pageserve.app.flag_table import serve_parser

    docs = Path(__file__).resolve().parent.parent / "docs"
    examples = [m.group(1) for page in docs.glob("*.md") for m in re.finditer(r"```yaml\n(.*?)```", page.read_text(),
                                                                                re.S)]
    assert examples
    for i, text in enumerate(examples):
        (tmp_path / f"{i}.yaml").write_text(text)
        args = config_args(str(tmp_path / f"{i}.yaml"), serve_parser())
        serve_parser().parse_args(args)


def test_values_that_look_like_flags_or_booleans_and_two_files(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("api-key: '-k3y'\nchat-template: '-x'\n")
    ns = parse(["serve", "--config", str(tmp_path / "c.yaml")])
    assert ns.api_key == ["-k3y"] and ns.chat_template == "-x"
    (tmp_path / "host.yaml").write_text("host: no\n")
    assert main(["serve", "--config", str(tmp_path / "host.yaml")]) == 2
    assert "host: wants a value, not true or false" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "c.yaml"), f"--config={tmp_path / 'c.yaml'}"]) == 2
    assert "--config is given twice" in capsys.readouterr().err
    (tmp_path / "vllm.yaml").write_text("tokenizer-mode: auto\n")
    assert main(["serve", "--config", str(tmp_path / "vllm.yaml")]) == 2
    assert "'tokenizer-mode' is vLLM's: the tokenizer loads through" in capsys.readouterr().err
