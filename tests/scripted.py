"""A scripted model for tests: the tiny random-weight Llama, run by the real runner (forward,
KV cache, grammar mask, sampling), whose sampled rows get a large bonus on the next token of a
fixed script: whatever the prompt, the output is the script, then EOS. Where a grammar mask
forbids the script's token the model's own logits choose among the allowed ones, so a test
sees exactly where a grammar applies (a script that thinks `<think>...</think>` and then
writes what the grammar forbids).

Test-only: nothing in the package reads the script. `scripted_runner()` makes
LLMEngine.from_engine_args build a ScriptedRunner while it is active; `scripted_llm` and
`scripted_server` use it for the offline API and for the real HTTP server (in process)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from unittest import mock

import torch

from pageserve.loadtest.tiny_model import build_tiny_model, build_tokenizer
from pageserve.runtime import engine_setup
from pageserve.runtime.model_runner import ModelRunner

SCRIPT_FILE = "pageserve_test_script.json"
THINK_TAGS = ("<think>", "</think>")
SCRIPT_BONUS = 1000.0  # beats any logit of the random model; a masked token stays -inf
_TURNS = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# as Qwen3's: the model opens <think> itself; enable_thinking false puts an empty block in the prompt
# (and a reasoning_effort is written before the turn, as a template that reads one would)
QWEN3_STYLE_TEMPLATE = _TURNS + (
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# as DeepSeek-R1's: the prompt opens <think>, the model only closes it
R1_STYLE_TEMPLATE = _TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"


def build_scripted_model(path: Path, script: str | list[int], think_tokens: bool = True,
                         chat_template: str | None = None) -> Path:
    """The tiny model in `path`, scripted to answer `script` (text, or token ids). With
    `think_tokens`, `<think>` and `</think>` are added tokens of their own (not special, as in
    DeepSeek-R1's and Qwen3's tokenizers); without, the tags are several BPE tokens."""
    from transformers import AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    extra = len(THINK_TAGS) if think_tokens else 0
    vocab = len(build_tokenizer(path)) + extra  # the same deterministic tokenizer again below
    build_tiny_model(path, vocab_size=vocab)
    tok = AutoTokenizer.from_pretrained(path)
    if think_tokens:
        tok.add_tokens(list(THINK_TAGS))
        assert len(tok) == vocab
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(path)
    write_script(path, script)
    return path


def write_script(path: Path, script: str | list[int]) -> list[int]:
    """Store the script (text is tokenized by the model's tokenizer) and return its ids."""
    from transformers import AutoTokenizer

    ids = (AutoTokenizer.from_pretrained(path).encode(script, add_special_tokens=False)
           if isinstance(script, str) else list(script))
    (path / SCRIPT_FILE).write_text(json.dumps({"token_ids": ids}))
    return ids


class ScriptedRunner(ModelRunner):
    """The real runner, with the script's next token favoured in every sampled row: the token
    at the request's output position, or its first EOS once the script is done. Tests may set
    `script` (token ids) between requests."""

    def __init__(self, model_cfg, *args, **kwargs):
        super().__init__(model_cfg, *args, **kwargs)
        self.script: list[int] = json.loads((Path(model_cfg.path) / SCRIPT_FILE).read_text())["token_ids"]

    def sample_logits(self, hidden: torch.Tensor, out) -> torch.Tensor:
        logits = super().sample_logits(hidden, out)
        targets = []
        for r in out.requests:
            if r.sample:
                at = len(r.request_tokens) - r.num_prompt_tokens  # the output position sampled now
                targets.append(self.script[at] if at < len(self.script) else r.eos_token_ids[0])
        logits[torch.arange(len(targets)), torch.tensor(targets)] += SCRIPT_BONUS
        return logits


@contextlib.contextmanager
def scripted_runner():
    """Engines built meanwhile run a ScriptedRunner (their model directory holds the script)."""
    with mock.patch.object(engine_setup, "ModelRunner", ScriptedRunner):
        yield


def scripted_llm(model_dir: Path, **engine_args):
    from pageserve.runtime import LLM

    args = dict(dtype="float32", kv_cache_memory=0.01, max_model_len=512, debug_checks=True)
    with scripted_runner():
        return LLM(str(model_dir), **{**args, **engine_args})


def scripted_server(model_dir: Path, engine_args: dict | None = None, **settings):
    """The real server (tests/live_server.InProcessServer) on the scripted model."""
    from pageserve.runtime.engine_args import EngineArgs
    from tests.live_server import InProcessServer

    args = dict(model=str(model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=512,
                swap_space=0, debug_checks=True)
    with scripted_runner():
        return InProcessServer(EngineArgs(**{**args, **(engine_args or {})}), **settings)
