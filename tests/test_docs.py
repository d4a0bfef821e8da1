"""Docs that run. The README's and docs/'s examples that talk to a server (curl in ```sh/```bash
blocks, ```python with the openai client or `from pageserve import LLM`, ```js/```ts with the
openai npm package or the AI SDK) run against one served tiny random-weight model, their URLs,
ports and model names rewritten to it. An example that cannot run here says why in the line
before its block: `<!-- docs-test: skip REASON -->`, REASON one of SKIP_REASONS.

Beside them: docs/serving.md's flag tables equal what the parser makes, every `pageserve serve`
command in the docs parses, every internal link and anchor resolves, and every page starts with
its two-line summary."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NODE_DIR = ROOT / "tests" / "node"
DEFAULT_NAME = "SmolLM2-135M-Instruct"  # the examples' model: the served model's name here
SKIP_REASONS = {
    "gpu": "needs a GPU",
    "hub": "downloads a model from the Hugging Face hub",
    "nodes": "needs several machines",
    "files": "needs model or adapter files that are not in the repository",
}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SKIP = re.compile(r"<!-- docs-test: skip (\S+) -->\s*$")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    skip: str | None  # the reason named before the block

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str | None:
        """How the block talks to a server, or None where it does not."""
        if self.lang in ("sh", "bash") and re.search(r"^\s*curl\b", self.code, re.M):
            return "curl"
        if self.lang == "python" and ("OpenAI(" in self.code or "Anthropic(" in self.code
                                      or "from pageserve import LLM" in self.code):
            return "python"
        if self.lang in ("js", "ts", "javascript", "typescript") and re.search(r"from \"(openai|@ai-sdk/[\w-]+)\"",
                                                                              self.code):
            return "node"
        return None


def blocks() -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            out.append(Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2),
                             skip.group(1) if skip else None))
    return out


BLOCKS = blocks()
EXAMPLES = [b for b in BLOCKS if b.kind or b.skip]


def _params():
    for b in EXAMPLES:
        marks = [pytest.mark.skip(reason=f"{b.skip}: {SKIP_REASONS.get(b.skip, '?')}")] if b.skip else []
        yield pytest.param(b, id=b.name, marks=marks)


# ---- the examples, against one served tiny model ----

def _rewrite(code: str, server) -> str:
    code = re.sub(r"(?:http://)?(?:localhost|127\.0\.0\.1):8000", server.url, code)
    return code.replace(DEFAULT_NAME, server.model)


@pytest.fixture
def tiny_pageserve_llm(tiny_model_dir, monkeypatch):
    """`from pageserve import LLM` gives an LLM on the tiny model, whatever the example asks for."""
    import pageserve
    from pageserve.runtime import LLM

    made = []

    def tiny(model=None, **_):
        made.append(LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=512))
        return made[-1]
    monkeypatch.setattr(pageserve, "LLM", tiny, raising=False)
    yield made


@pytest.mark.server
@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", list(_params()))
def test_example_runs(block, tiny_server, tmp_path, request):
    code = _rewrite(block.code, tiny_server)
    if block.kind == "curl":
        code = re.sub(r"^(\s*)curl\b", r"\1curl -sS --fail-with-body --max-time 60", code, flags=re.M)
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], capture_output=True, text=True,
                              timeout=90)
        assert proc.returncode == 0, f"{block.name}:\n{code}\n{proc.stdout}\n{proc.stderr}"
        out = proc.stdout
    elif block.kind == "python":
        if "from pageserve import LLM" in code:
            request.getfixturevalue("tiny_pageserve_llm")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, block.name, "exec"), {"__name__": "docs_example"})
        out = printed.getvalue()
    else:
        node = shutil.which("node")
        assert node, "node is needed for this test (make test installs the npm packages)"
        assert (NODE_DIR / "node_modules" / "openai").is_dir(), "run `make test` (npm ci in tests/node)"
        (tmp_path / "node_modules").symlink_to(NODE_DIR / "node_modules")
        script = tmp_path / "example.mjs"
        script.write_text(code)
        proc = subprocess.run([node, str(script)], capture_output=True, text=True, timeout=90, cwd=tmp_path)
        assert proc.returncode == 0, f"{block.name}:\n{code}\n{proc.stdout}\n{proc.stderr}"
        out = proc.stdout
    assert out.strip(), f"{block.name} printed nothing"
    tiny_server.wait_idle()


@pytest.mark.unit
def test_examples_are_found_and_skips_are_named():
    """The README's three examples are among those run; every skip names a known reason."""
    kinds = {b.kind for b in EXAMPLES if b.page.name == "README.md" and not b.skip}
    assert kinds == {"curl", "python", "node"}, kinds
    unknown = [f"{b.name}: {b.skip}" for b in BLOCKS if b.skip and b.skip not in SKIP_REASONS]
    assert not unknown, f"skip reasons must be one of {sorted(SKIP_REASONS)}: {unknown}"


# ---- flags, commands, links, summaries ----

@pytest.mark.unit
def test_serving_flag_tables_are_the_parsers():
    from pageserve.app import flag_table

    text = (ROOT / "docs" / "serving.md").read_text()
    assert flag_table.BEGIN in text and flag_table.END in text, "docs/serving.md lost its flag table markers"
    written = text[text.index(flag_table.BEGIN) + len(flag_table.BEGIN):text.index(flag_table.END)]
    assert written.strip() == flag_table.flag_tables().strip(), (
        f"docs/serving.md's flag tables differ from `pageserve serve`'s flags; regenerate them with "
        f"`{flag_table.REGENERATE}`")


@pytest.mark.unit
def test_a_vllm_flag_pageserve_does_not_take_gets_its_line(capsys):
    from pageserve.app.cli import main
    from pageserve.app.flag_table import serve_parser
    from pageserve.app.vllm_flags import NOT_TAKEN

    taken = {s for a in serve_parser()._actions for s in a.option_strings}
    assert not taken & set(NOT_TAKEN), "a flag in app/vllm_flags.py is one pageserve serve now takes"
    assert main(["serve", "--trust-remote-code", "--load-format=dummy", "--port", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["pageserve serve: error: --trust-remote-code is vLLM's: " + NOT_TAKEN["--trust-remote-code"],
                   "--load-format is vLLM's: " + NOT_TAKEN["--load-format"]]
    assert main(["serve", "--kv-cache-dtype=fp8_e5m2", "--port", "1"]) == 1  # taken, but not that value
    assert "of the float8 formats only e4m3 is" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # any other flag: argparse's own answer
        main(["serve", "--no-such-flag"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def _serve_commands() -> list[tuple[str, list[str]]]:
    """Each `pageserve serve ...` command in the docs' shell blocks: where, and its arguments."""
    out = []
    for b in BLOCKS:
        if b.lang not in ("sh", "bash"):
            continue
        for line in b.code.replace("\\\n", " ").splitlines():
            if "pageserve serve" not in line:
                continue
            words = shlex.split(line, comments=True)
            for i in range(len(words) - 1):
                if words[i].endswith("pageserve") and words[i + 1] == "serve":
                    out.append((b.name, words[i + 2:]))
    return out


@pytest.mark.unit
def test_serve_commands_in_the_docs_parse():
    from pageserve.app.flag_table import serve_parser

    parser = serve_parser()
    parser.exit_on_error = False
    commands = _serve_commands()
    assert len(commands) > 10
    wrong = []
    for where, args in commands:
        try:
            _, unknown = parser.parse_known_args(args)
        except (argparse.ArgumentError, SystemExit) as e:
            wrong.append(f"{where}: {shlex.join(args)}: {e}")
            continue
        if unknown:
            wrong.append(f"{where}: unknown {unknown}")
    assert not wrong, "\n".join(wrong)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = FENCE.sub("", page.read_text())
    for m in re.finditer(r"^#{1,6} (.+)$", text, re.M):
        a = _anchor(m.group(1))
        out.add(a if a not in seen else f"{a}-{seen[a]}")
        seen[a] = seen.get(a, 0) + 1
    return out


@pytest.mark.unit
def test_internal_links_resolve():
    wrong = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # not a file of the repository
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if ROOT not in dest.parents and dest != ROOT:
                wrong.append(f"{page.name}: {target} leaves the repository")
            elif not dest.exists():
                wrong.append(f"{page.name}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                wrong.append(f"{page.name}: {target}: no such heading")
    assert not wrong, "\n".join(wrong)


@pytest.mark.unit
def test_every_docs_page_starts_with_a_two_line_summary():
    wrong = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        lines = page.read_text().splitlines()
        ok = (len(lines) > 4 and lines[0].startswith("# ") and not lines[1] and lines[2] and lines[3]
              and not lines[4])
        if not ok:
            wrong.append(page.name)
    assert not wrong, f"not a title, a blank line, two lines of summary, a blank line: {wrong}"


@pytest.mark.unit
def test_the_readme_stays_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert text.startswith("```sh\nmake serve ") and "\nmake test " in text.split("```", 2)[1]
    assert len(text.splitlines()) <= 160
    shot = ROOT / "docs" / "images" / "chat.png"
    assert "(docs/images/chat.png)" in text
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size < 300_000
